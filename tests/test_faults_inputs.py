"""The last faults of the command line and the library's inputs: finalize never deletes or
half-writes a pipeline, NaN reranker weights are caught, and a bad device, an invalid YAML file,
a damaged LoRA adapter, a folder or an oversized image are one-line errors."""

import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch

from unclip.cli.errors import run_main
from unclip.cli.shapes_finalize import main as finalize_main


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from unclip.pipeline.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("pipe")
    tiny_pipeline(seed=0, sizes=(16, 32)).save_pretrained(path)
    return path


@pytest.fixture
def sampling(tmp_path) -> Path:
    path = tmp_path / "sampling.yaml"
    path.write_text("decoder: {steps: 3}\n")
    return path


def _one_line(capsys, status, command, *needles):
    err = capsys.readouterr().err
    assert status == 1, err
    assert len(err.splitlines()) == 1 and err.startswith(f"unclip {command}: error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_finalize_refuses_an_existing_out_and_overwrite_replaces_it(
    pipe_dir, sampling, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = [str(pipe_dir), "--sampling", str(sampling), "--dtype", "float32", "--out", str(out)]
    status = run_main("unclip shapes-finalize", finalize_main, args)
    _one_line(capsys, status, "shapes-finalize", str(out), "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"
    assert run_main("unclip shapes-finalize", finalize_main, [*args, "--overwrite"]) == 0
    assert (out / "unclip.json").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sampling.yaml"]  # no .tmp


def test_finalize_out_given_a_file_leaves_nothing(pipe_dir, sampling, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("a file")
    args = [str(pipe_dir), "--sampling", str(sampling), "--out", str(out)]
    status = run_main("unclip shapes-finalize", finalize_main, args)
    _one_line(capsys, status, "shapes-finalize", "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sampling.yaml"]


def test_in_place_finalize_cut_between_its_renames_is_recovered_by_a_rerun(
    pipe_dir, sampling, tmp_path
):
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.shapes.finalize import finalize

    pipe = tmp_path / "pipe"
    shutil.copytree(pipe_dir, pipe)
    # what a kill leaves after the old folder was moved aside and before the new one moved in
    shutil.copytree(pipe_dir, tmp_path / "pipe.tmp")
    (pipe).rename(tmp_path / "pipe.old")
    finalize(pipe, sampling, dtype="float32")
    assert UnCLIPPipeline.from_pretrained(pipe).sampling["decoder"].steps == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "sampling.yaml"]


@pytest.mark.parametrize("text", ["decoder: {steps: [3\n", "- a list\n"])
def test_invalid_sampling_yaml_is_one_line(pipe_dir, tmp_path, capsys, text):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    args = [str(pipe_dir), "--sampling", str(bad), "--out", str(tmp_path / "out")]
    status = run_main("unclip shapes-finalize", finalize_main, args)
    _one_line(capsys, status, "shapes-finalize", "--sampling", str(bad))
    assert not (tmp_path / "out").exists()


def test_invalid_accelerate_config_yaml_is_one_line(tmp_path, capsys):
    from unclip.cli.plan import main as plan_main

    bad = tmp_path / "accelerate.yaml"
    bad.write_text("distributed_type: [FSDP\n")
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "sr32.yaml"
    status = run_main("unclip plan", plan_main, [str(config), "--accelerate-config", str(bad)])
    _one_line(capsys, status, "plan", "--accelerate-config", "not valid YAML")


def test_nan_reranker_weights_are_caught_not_silently_ranked(tiny_pipe):
    from unclip.sampling.candidates import rerank_candidates as rerank

    reranker = tiny_pipe.clip
    images = torch.zeros(2, 3, reranker.image_size, reranker.image_size)
    keep = rerank(reranker, images, "a red circle", k=2)  # healthy weights rank
    assert keep.tolist() in ([0], [1])
    saved = {k: v.clone() for k, v in reranker.state_dict().items()}
    try:
        with torch.no_grad():
            next(reranker.parameters()).fill_(float("nan"))
        with pytest.raises(ValueError, match="reranking CLIP produced NaN"):
            rerank(reranker, images, "a red circle", k=2)
    finally:
        reranker.load_state_dict(saved)


@pytest.mark.parametrize(
    "device, needle",
    [("tpu9", "not a torch device"), ("cuda", "no CUDA GPU"), ("cuda:7", "CUDA")],
)
def test_an_unusable_device_is_one_line_before_loading(tmp_path, capsys, device, needle):
    from unclip.cli.generate import main as generate_main

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    missing = tmp_path / "no-model"  # never reached: the device is checked first
    args = ["a red circle", "--model", str(missing), "--out", str(tmp_path / "o"), "--device"]
    status = run_main("unclip generate", generate_main, [*args, device])
    _one_line(capsys, status, "generate", f"--device {device}", needle)


def test_edit_checks_the_device_before_loading(tmp_path, capsys):
    from unclip.cli.edit import main as edit_main

    image = tmp_path / "x.png"
    image.write_bytes(b"")
    args = ["invert", str(image), "--model", str(tmp_path / "none"), "--out", str(tmp_path)]
    status = run_main("unclip edit", edit_main, [*args, "--device", "tpu9"])
    _one_line(capsys, status, "edit", "--device tpu9")


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width × height`` pixels (PIL refuses it on opening, before any
    pixel is decoded: no gigabytes are needed to write or test it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


def test_a_400_megapixel_image_or_mask_is_a_clear_error(tmp_path):
    from unclip.pipeline.edit_ops import read_image, read_mask

    bomb = _png_header(tmp_path / "huge.png", 20000, 20000)
    with pytest.raises(ValueError, match="huge.png is too large to open"):
        read_image(bomb)
    with pytest.raises(ValueError, match="mask .*huge.png is too large to open"):
        read_mask(bomb, 64, 64)


def test_an_image_argument_naming_a_folder_says_so(tmp_path):
    from unclip.pipeline.edit_ops import read_image
    from unclip.utils.images import as_image_input

    for read in (read_image, as_image_input):
        with pytest.raises(ValueError, match="is a folder; give an image file"):
            read(tmp_path)


def test_a_truncated_lora_adapter_names_the_file(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import save_file

    from unclip.nets.lora import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        LORA_FORMAT,
        LORA_META,
        read_adapter,
    )

    folder = tmp_path / "decoder_lora"
    folder.mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(folder / ADAPTER_WEIGHTS))
    data = (folder / ADAPTER_WEIGHTS).read_bytes()
    (folder / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    (folder / ADAPTER_CONFIG).write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["x"]}')
    (folder / LORA_META).write_text(f'{{"format": "{LORA_FORMAT}", "stage": "decoder"}}')
    with pytest.raises(ValueError, match=f"{ADAPTER_WEIGHTS} is truncated or corrupt"):
        read_adapter(folder)
