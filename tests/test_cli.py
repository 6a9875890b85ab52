"""The `unclip` command and `unclip generate`."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from unclip import cli
from unclip.cli.generate import main as generate
from unclip.utils.precision import native_cpu_bf16


def test_generate_writes_what_it_claims(tiny_pipe, tmp_path):
    tiny_pipe.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    args = [
        "a red circle",
        "a blue square",
        "--model",
        str(tmp_path / "model"),
        "--num-images",
        "2",
        "--seed",
        "7",
        "--out",
        str(out),
        "--decoder-steps",
        "3",
        "--decoder-guidance-scale",
        "2.5",
        "--upsampler-scheduler",
        "ddpm",
        "--prior-best-of",
        "1",
        "--decoder-best-of",
        "2",
        "--decoder-rerank-at",
        "2",
        "--upsampler-steps",
        "2",
        "--no-progress",
    ]
    assert generate(args) == 0
    record = json.loads((out / "generate.json").read_text())
    files = sorted(p.name for p in out.glob("0*.png"))
    assert files == ["000_00.png", "000_01.png", "001_00.png", "001_01.png"]
    assert [f["file"] for f in record["files"]] == files
    assert record["seeds"] == [7, 8] and record["prompts"] == ["a red circle", "a blue square"]
    assert (
        record["sampling"]["decoder"]["steps"] == 3
        and record["sampling"]["decoder"]["guidance_scale"] == 2.5
    )
    assert (
        record["sampling"]["sr32"]["scheduler"] == "ddpm"
        and record["sampling"]["prior"]["best_of"] == 1
    )
    assert record["sampling"]["decoder"]["best_of"] == 2
    assert record["sampling"]["decoder"]["rerank_at"] == 2
    assert record["sampling"]["sr32"]["steps"] == record["sampling"]["sr64"]["steps"] == 2
    assert set(record["seconds_per_stage"]) == {"prior", "decoder", "sr32", "sr64"}
    assert record["rerank_clip"] == "clip"
    # the default ("auto") as it resolved on this machine, since bf16 changes the images
    assert record["autocast_dtype"] == ("bfloat16" if native_cpu_bf16() else None)
    assert record["batch_size"] == 16 and record["grid_images"] == 4
    for f in files:
        assert Image.open(out / f).size == (64, 64)
    assert Image.open(out / "grid.png").size == (128, 128)
    # the sidecar reproduces the images
    again = tmp_path / "again"
    assert generate([a if a != str(out) else str(again) for a in args]) == 0
    for f in files:
        assert (out / f).read_bytes() == (again / f).read_bytes()


@pytest.mark.parametrize(
    "args,match",
    [
        (["--tiny", "--num-images", "0"], "--num-images"),
        (["--tiny"], "at least one prompt"),
        (["", "--tiny"], "empty"),
        (["a cat", "--tiny", "--decoder-steps", "0"], "steps must be an integer >= 1"),
        (["a cat", "--tiny", "--decoder-best-of", "0"], "best_of must be an integer >= 1"),
        (["a cat", "--tiny", "--decoder-rerank-at", "0"], "rerank_at must be an integer >= 1"),
        (["a cat", "--tiny", "--decoder-rerank-at", "half"], "a step number or 'none'"),
        (
            ["a cat", "--tiny", "--decoder-rerank-contrast", "clip"],
            "one of ['shapes', 'shapes-pairs', 'shapes-pairs-regions'] or 'none'",
        ),
        (["a cat", "--tiny", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["a cat", "--tiny", "--rerank", "2"], "unrecognized arguments: --rerank"),
        (["a cat", "--tiny", "--sr-steps", "2"], "unrecognized arguments: --sr-steps"),
        (["a cat", "--tiny", "--autocast", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_generate_bad_input(args, match, capsys, tmp_path):
    with pytest.raises((SystemExit, ValueError)) as e:
        generate(args + ["--out", str(tmp_path)])
    text = str(e.value) + capsys.readouterr().err
    assert match in text


@pytest.mark.parametrize("flag,recorded", [("none", None), ("bf16", "bfloat16")])
def test_generate_autocast_flag(flag, recorded, tmp_path, monkeypatch):
    # a CPU on which auto would have given the other answer: the flag is what counts
    monkeypatch.setattr("unclip.utils.precision.native_cpu_bf16", lambda: recorded is None)
    out = tmp_path / flag
    args = ["a red circle", "--tiny", "--autocast", flag, "--no-progress", "--out", str(out)]
    assert generate(args + ["--decoder-steps", "2", "--upsampler-steps", "1"]) == 0
    assert json.loads((out / "generate.json").read_text())["autocast_dtype"] == recorded


def test_generate_to_folder_keeps_a_passed_pipelines_autocast(tiny_pipe, tmp_path):
    from unclip.pipeline.jobs import generate_to_folder

    few = {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 1}}
    kw = dict(sampling=few, progress=False)
    assert tiny_pipe.autocast_setting is None
    assert generate_to_folder(tiny_pipe, ["a cat"], tmp_path / "a", **kw)["autocast_dtype"] is None
    rec = generate_to_folder(tiny_pipe, ["a cat"], tmp_path / "b", autocast_dtype="bf16", **kw)
    assert rec["autocast_dtype"] == "bfloat16"  # asked for, so applied for the call
    assert tiny_pipe.autocast_setting is None  # and the caller's pipeline given back as it was


def test_generate_prompts_file_errors(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"a red circle\n\xff\xfe bad\n")
    with pytest.raises(SystemExit):
        generate(["--prompts-file", str(f), "--tiny", "--out", str(tmp_path)])
    assert "not UTF-8" in capsys.readouterr().err


def test_cli_dispatch(capsys):
    assert cli.main([]) == 0 and "generate" in capsys.readouterr().out
    assert cli.main(["generat"]) == 2 and "did you mean 'generate'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip()
    # every command is a module of unclip/cli with main(argv)
    assert {"shapes-eval", "shapes-finalize", "make-shapes", "evaluate"} <= set(cli.COMMANDS)
    assert all(module.startswith("unclip.cli.") for module, _ in cli.COMMANDS.values())
    for name in cli.COMMANDS:
        __import__(cli.COMMANDS[name][0])  # every subcommand module exists and imports


def test_console_script_installed():
    proc = subprocess.run(
        [sys.executable, "-m", "unclip.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "train-decoder" in proc.stdout


_CONSOLE = """
import atexit, sys
atexit.register(lambda: print("teardown ran", flush=True))
sys.argv = ["unclip", *sys.argv[1:]]
from unclip.cli import console
console()
"""


def test_console_ends_generate_without_teardown_and_keeps_its_output(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", _CONSOLE, *args], capture_output=True, text=True, timeout=300
        )

    out = tmp_path / "out"
    small = ["--decoder-steps", "2", "--prior-steps", "2", "--upsampler-steps", "1"]
    proc = run("generate", "a red circle", "--tiny", "--no-progress", "--out", str(out), *small)
    assert proc.returncode == 0, proc.stderr
    # stdout is a pipe, so block-buffered: its lines arrive only if it is flushed before the exit
    assert "wrote 1 image (64px)" in proc.stdout and "teardown ran" not in proc.stdout
    assert Image.open(out / "000_00.png").size == (64, 64)
    assert json.loads((out / "generate.json").read_text())["files"]
    # a failure keeps its status and its one error line
    proc = run("generate", "a red circle", "--model", str(tmp_path / "missing"), *small)
    assert proc.returncode == 1 and "unclip generate: error:" in proc.stderr
    assert "teardown ran" not in proc.stdout
    # every other command exits normally
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("teardown ran")
    # so does generate under a profiler (which writes its results at exit) or when opted out
    profiled = tmp_path / "p.prof"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cProfile",
            "-o",
            str(profiled),
            "-m",
            "unclip.cli",
            "generate",
            "a red circle",
            "--tiny",
            "--no-progress",
            "--out",
            str(tmp_path / "o2"),
            *small,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert profiled.stat().st_size > 0
    env = {**os.environ, "UNCLIP_NO_FAST_EXIT": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CONSOLE,
            "generate",
            "a red circle",
            "--tiny",
            "--no-progress",
            "--out",
            str(tmp_path / "o3"),
            *small,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("teardown ran"), proc.stderr


def test_decoder_rerank_at_flag_sets_or_clears_the_models_setting():
    """``--decoder-rerank-at 7`` overrides the decoder's setting; ``none`` clears a model's saved
    one (choose among the finished images)."""
    from unclip.cli.generate import build_parser, sampling_overrides

    p = build_parser()
    assert sampling_overrides(p.parse_args(["a cat", "--decoder-rerank-at", "7"])) == {
        "decoder": {"rerank_at": 7}
    }
    assert sampling_overrides(p.parse_args(["a cat", "--decoder-rerank-at", "None"])) == {
        "decoder": {"rerank_at": None}
    }
    assert sampling_overrides(p.parse_args(["a cat", "--decoder-rerank-contrast", "shapes"])) == {
        "decoder": {"rerank_contrast": "shapes"}
    }
    assert sampling_overrides(p.parse_args(["a cat", "--decoder-rerank-contrast", "none"])) == {
        "decoder": {"rerank_contrast": None}
    }
    args = ["a cat", "--decoder-prune-at", "3", "--decoder-prune-keep", "8"]
    assert sampling_overrides(p.parse_args(args)) == {"decoder": {"prune_at": 3, "prune_keep": 8}}
    # 'none' turns pruning off as a whole, so the model's prune_keep is not left alone
    assert sampling_overrides(p.parse_args(["a cat", "--decoder-prune-at", "none"])) == {
        "decoder": {"prune_at": None, "prune_keep": None}
    }
