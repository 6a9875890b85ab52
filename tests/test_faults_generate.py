"""Faults and bad input when generating: non-finite guidance, NaN weights, an output folder that
cannot be written, and requests too large for one batch."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unclip.cli.errors import format_error
from unclip.pipeline.jobs import GRID_MAX_IMAGES, generate_to_folder
from unclip.pipeline.tiny import tiny_pipeline
from unclip.utils.files import check_output_folder

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
FEW = {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 2}}
FEW_FLAGS = ["--prior-steps", "2", "--decoder-steps", "2", "--upsampler-steps", "2"]


def _unclip(args, cwd, timeout=120) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "unclip.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc, *needles: str) -> str:
    """The single stderr line of a failed ``unclip generate`` (exit 1), containing ``needles``."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("unclip generate: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------ non-finite guidance
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("stage", ["prior", "decoder", "sr32", "upsampler"])
def test_non_finite_guidance_scale_names_stage_and_value(tiny_pipe, stage, value):
    with pytest.raises(ValueError) as e:
        tiny_pipe("a cat", sampling={stage: {"guidance_scale": value}}, progress=False)
    shown = "sr32" if stage == "upsampler" else stage  # every upsampler's check names it
    assert f"{shown}: guidance scale must be a finite number >= 0, got {value!r}" in str(e.value)


def test_cli_nan_guidance_is_one_line_error(tmp_path):
    proc = _unclip(
        ["generate", "a cat", "--tiny", "--decoder-guidance-scale", "nan", "--out", "out"],
        tmp_path,
    )
    _one_line_error(proc, "decoder: guidance scale must be a finite number >= 0, got nan")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- NaN weights
def _poisoned(stage: str, value: float):
    """A tiny pipeline with one weight of ``stage``'s denoising network set to ``value``."""
    pipe = tiny_pipeline()
    net = pipe.denoisers()[stage]
    with torch.no_grad():
        next(p for p in net.parameters() if p.ndim > 1).view(-1)[0] = value
    return pipe


@pytest.mark.parametrize(
    "stage,value",
    [("prior", float("nan")), ("decoder", float("nan")), ("sr32", float("inf"))],
)
def test_non_finite_weights_name_the_stage(stage, value):
    with pytest.raises(ValueError) as e:
        _poisoned(stage, value)("a cat", sampling=FEW, progress=False)
    assert (
        str(e.value)
        == f"{stage} produced NaN/inf values: its weights hold NaN/inf; check the model folder"
    )


def test_euler_a_at_three_steps_samples_finite_images():
    # diffusers' ancestral Euler computes sqrt(sigma_to² - sigma_up²) in float32; from the
    # squaredcos_cap_v2 schedule's sigma_max (about 2e4) the difference rounds below zero at 3 steps
    pipe = tiny_pipeline()
    sampling = {**FEW, "upsampler": {"scheduler": "euler_a", "steps": 3}}
    images = pipe("a cat", sampling=sampling, progress=False, output_type="pt").images
    assert torch.isfinite(images).all()


def test_a_diverging_sampler_is_not_blamed_on_the_model_folder():
    # finite weights, but a guidance scale so large that the sampler overflows
    pipe = tiny_pipeline()
    sampling = {**FEW, "decoder": {"steps": 2, "guidance_scale": 1e38}}
    with pytest.raises(ValueError) as e:
        pipe("a cat", sampling=sampling, progress=False)
    message = str(e.value)
    assert message.startswith("decoder produced NaN/inf values: its weights are finite")
    assert "steps)" in message and "try another sampler or more steps" in message
    assert "model folder" not in message


def test_generate_with_nan_decoder_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="decoder produced NaN/inf values"):
        generate_to_folder(
            _poisoned("decoder", float("nan")), ["a cat"], tmp_path / "out", sampling=FEW
        )
    assert not (tmp_path / "out").exists()


def test_cli_nan_model_folder_is_one_line_error(tmp_path):
    _poisoned("decoder", float("nan")).save_pretrained(tmp_path / "model")
    proc = _unclip(
        ["generate", "a cat", "--model", "model", "--out", "out", "--no-progress", *FEW_FLAGS],
        tmp_path,
    )
    _one_line_error(
        proc, "decoder produced NaN/inf values", "weights hold NaN", "check the model folder"
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- output folder
def test_output_folder_checked_before_the_model_loads(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    t0 = time.perf_counter()
    # the model folder is missing too: the output folder's error shows it was checked first
    with pytest.raises(ValueError) as e:
        generate_to_folder(tmp_path / "missing-model", ["a cat"], tmp_path / "afile")
    assert str(e.value) == (
        f"output folder {tmp_path / 'afile'} is a file; give a folder (a missing one is created)"
    )
    with pytest.raises(ValueError) as e:
        generate_to_folder(tmp_path / "missing-model", ["a cat"], tmp_path / "afile" / "sub")
    assert str(e.value) == (
        f"cannot create output folder {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a "
        "file, not a folder"
    )
    assert time.perf_counter() - t0 < 5
    assert (tmp_path / "afile").read_text() == "not a folder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_cli_out_file_fails_before_loading(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    proc = _unclip(["generate", "a cat", "--model", "missing-model", "--out", "afile"], tmp_path)
    _one_line_error(proc, "output folder afile is a file; give a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused_before_loading(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as e:
            generate_to_folder(tmp_path / "missing-model", ["a cat"], locked / "out")
    finally:
        locked.chmod(0o755)
    assert e.value.filename == str(locked / "out")
    assert format_error(e.value) == (
        f"{locked / 'out'}: Permission denied (choose a folder you can write to)"
    )
    assert list(locked.iterdir()) == []


def test_existing_output_folder_is_written_into(tiny_pipe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    assert check_output_folder(out) == out and check_output_folder(out / "new" / "sub")
    assert not (out / "new").exists()  # checking creates nothing
    generate_to_folder(tiny_pipe, ["a cat"], out, sampling=FEW, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "000_00.png",
        "generate.json",
        "grid.png",
        "keep.txt",
    ]
    assert (out / "keep.txt").read_text() == "mine\n"


# ------------------------------------------------------------------------- bounded batches
def _decoder_batches(pipe) -> tuple[list, object]:
    """Batch sizes of every decoder network call, recorded by a forward pre-hook."""
    seen: list[int] = []
    handle = pipe.decoder.register_forward_pre_hook(lambda _m, args: seen.append(len(args[0])))
    return seen, handle


UNGUIDED = {
    "prior": {"steps": 2, "guidance_scale": 1.0, "best_of": 1},
    "decoder": {"steps": 2, "guidance_scale": 1.0, "best_of": 1},
    "upsampler": {"steps": 1},
}


def test_large_request_streams_through_bounded_batches(tmp_path):
    pipe = tiny_pipeline(sizes=(16, 32))
    seen, handle = _decoder_batches(pipe)
    try:
        record = generate_to_folder(
            pipe,
            ["a cat"],
            tmp_path / "out",
            num_images_per_prompt=5,
            batch_size=2,
            seed=3,
            sampling=UNGUIDED,
            progress=False,
        )
    finally:
        handle.remove()
    # unguided with best_of 1: one decoder row per image; batches of 2, 2, 1, two steps each
    assert seen == [2, 2, 2, 2, 1, 1]
    files = [f"000_{j:02d}.png" for j in range(5)]
    assert sorted(p.name for p in (tmp_path / "out").glob("0*.png")) == files
    on_disk = json.loads((tmp_path / "out" / "generate.json").read_text())
    assert on_disk == record
    assert [f["file"] for f in record["files"]] == files
    assert [f["index"] for f in record["files"]] == list(range(5))
    assert {f["seed"] for f in record["files"]} == {3} and record["batch_size"] == 2
    arrays = [np.asarray(Image.open(tmp_path / "out" / f)) for f in files]
    # the prompt's generator carries on into the next batch instead of restarting
    assert not np.array_equal(arrays[0], arrays[2])
    # deterministic for the same seed and batch size
    generate_to_folder(
        pipe,
        ["a cat"],
        tmp_path / "again",
        num_images_per_prompt=5,
        batch_size=2,
        seed=3,
        sampling=UNGUIDED,
        progress=False,
    )
    for f in files:
        assert (tmp_path / "again" / f).read_bytes() == (tmp_path / "out" / f).read_bytes()


def test_request_in_one_batch_is_one_pipeline_call(tiny_pipe, tmp_path):
    prompts = ["a cat", "a dog"]
    record = generate_to_folder(
        tiny_pipe,
        prompts,
        tmp_path,
        num_images_per_prompt=2,
        batch_size=4,
        seed=5,
        sampling=FEW,
        progress=False,
    )
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    direct = tiny_pipe(prompts, 2, gens, sampling=FEW, output_type="uint8", progress=False)
    for k, entry in enumerate(record["files"]):
        assert np.array_equal(np.asarray(Image.open(tmp_path / entry["file"])), direct.images[k])


def test_grid_shows_the_first_images_only(tmp_path):
    pipe = tiny_pipeline(sizes=(16,))
    n = GRID_MAX_IMAGES + 1
    record = generate_to_folder(
        pipe,
        ["a cat"],
        tmp_path,
        num_images_per_prompt=n,
        sampling={"prior": {"steps": 1}, "decoder": {"steps": 1}},
        progress=False,
    )
    assert len(record["files"]) == n == len(list(tmp_path.glob("000_*.png")))
    assert record["grid_images"] == GRID_MAX_IMAGES == 64
    assert Image.open(tmp_path / "grid.png").size == (8 * 16, 8 * 16)


def test_cli_batch_size(tmp_path):
    proc = _unclip(
        ["generate", "a cat", "--tiny", "--num-images", "5", "--batch-size", "2", "--out", "out"]
        + ["--no-progress", *FEW_FLAGS],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert "note: --tiny" in proc.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("0*.png")) == [f"000_{j:02d}.png" for j in range(5)]
    record = json.loads((out / "generate.json").read_text())
    assert record["batch_size"] == 2 and len(record["files"]) == 5
    assert record["command"][-len(FEW_FLAGS) :] == FEW_FLAGS


def test_cli_default_batch_size_matches_library():
    from unclip.pipeline.jobs import DEFAULT_BATCH_SIZE
    from unclip.pipeline.jobs import DEFAULT_BATCH_SIZE as cli_default

    assert cli_default == DEFAULT_BATCH_SIZE
