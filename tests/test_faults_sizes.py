"""Absurd sizes are refused against a memory estimate before anything is allocated: decoder
candidates, a training batch, edit frames and a planned micro-batch, each with one line naming
the setting, the estimate and the limit."""

import pytest
from conftest import CONFIGS

from unclip.cli.errors import run_main

SR32 = CONFIGS / "tiny" / "sr32.yaml"


def _one_line(capsys, status, command, *needles):
    err = capsys.readouterr().err
    assert status == 1, err
    assert len(err.splitlines()) == 1 and err.startswith(f"unclip {command}: error: "), err
    for needle in (*needles, "needs at least", "GiB", "lower it"):
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from unclip.pipeline.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("tiny")
    tiny_pipeline(seed=0, sizes=(16,)).save_pretrained(path)
    return path


def test_available_memory_is_read():
    from unclip.utils.limits import available_memory

    assert available_memory() > 2**20


def test_generate_refuses_a_decoder_best_of_past_memory(tiny_dir, tmp_path, capsys):
    from unclip.cli.generate import main as generate_main

    args = ["a red circle", "--model", str(tiny_dir), "--out", str(tmp_path / "o")]
    status = run_main("unclip generate", generate_main, [*args, "--decoder-best-of", "1000000000"])
    _one_line(capsys, status, "generate", "--decoder-best-of 1000000000", "available memory")
    assert not (tmp_path / "o").exists()


def test_training_refuses_a_batch_past_memory(tmp_path, capsys):
    from unclip.cli.train_decoder import main as train_decoder

    argv = [str(SR32), "data.batch_size=100000000000", "--output-dir", str(tmp_path / "run")]
    status = run_main("unclip train-decoder", train_decoder, argv)
    _one_line(capsys, status, "train-decoder", "data.batch_size 100000000000")


def test_edit_text_diff_refuses_frames_past_memory(tiny_dir, tmp_path, capsys):
    from PIL import Image

    from unclip.cli.edit import main as edit_main

    image = tmp_path / "x.png"
    Image.new("RGB", (16, 16)).save(image)
    args = ["text-diff", str(image), "--source", "a", "--target", "b", "--frames", "10000000000"]
    args += ["--model", str(tiny_dir), "--out", str(tmp_path / "o")]
    status = run_main("unclip edit", edit_main, args)
    _one_line(capsys, status, "edit", "--frames 10000000000")


def test_plan_refuses_a_micro_batch_past_the_gpu(capsys):
    from unclip.cli.plan import main as plan_main

    status = run_main("unclip plan", plan_main, [str(SR32), "--micro-batch", "100000000"])
    _one_line(capsys, status, "plan", "--micro-batch 100000000", "--gpu-memory 80GiB")
