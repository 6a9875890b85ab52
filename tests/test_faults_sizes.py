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


def test_generate_counts_the_decoders_activations_per_candidate(tiny_dir, tmp_path, capsys):
    """The check once counted four 16 px images per candidate (12 KiB) and let 100,000 candidates
    through as 1.2 GB; the decoder's activations are some 40 times that. A count the images-only
    estimate passes (a quarter of the memory there is) is refused, and the estimate per
    candidate is within 30 % of what the tiny decoder's candidates really take."""
    from unclip.cli.generate import main as generate_main
    from unclip.pipeline.limits import _LiveBytes, decoder_bytes_per_candidate
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.utils.limits import available_memory

    images_only = 4 * 3 * 16 * 16 * 4
    count = available_memory() // (4 * images_only)
    args = ["a red circle", "--model", str(tiny_dir), "--out", str(tmp_path / "o")]
    status = run_main("unclip generate", generate_main, [*args, "--decoder-best-of", str(count)])
    _one_line(capsys, status, "generate", f"--decoder-best-of {count}", "activations")
    assert not (tmp_path / "o").exists()

    pipe = UnCLIPPipeline.from_pretrained(tiny_dir, autocast_dtype=None)

    def peak(k):  # the live bytes of a call drawing k candidates
        meter = _LiveBytes()
        with meter:
            pipe("a", sampling={"decoder": {"best_of": k}}, progress=False, output_type="pt")
        return meter.peak

    real = (peak(12) - peak(4)) / 8
    estimate = decoder_bytes_per_candidate(pipe.decoder, guided=True)
    assert 0.7 < estimate / real < 1.3, (estimate, real)
    assert estimate > 20 * images_only


def test_a_token_pipeline_refuses_a_batch_past_memory(token_parts):
    """`TokenPipeline` samples every candidate of every image at once and had no check: a
    request past the memory there is is one line before anything is allocated (candidates
    themselves are bounded by sampling.candidates' stated maximum)."""
    from conftest import token_pipeline

    from unclip.utils.limits import available_memory

    pipe = token_pipeline(token_parts, upsamplers=False)
    n = available_memory() // 1024  # ~10 KiB per image of the tiny pipeline: ten times too many
    with pytest.raises(ValueError) as err:
        pipe("a red square", num_images_per_prompt=n, output_type="pt")
    msg = str(err.value)
    assert msg.startswith(f"{n} image(s) (prompts × num_images_per_prompt) × sampling.candidates")
    assert "key/value cache" in msg and "lower it" in msg and "\n" not in msg
    images = pipe("a red square", num_images_per_prompt=2, output_type="pt").images
    assert images.shape[0] == 2


def test_the_unclip_pipeline_call_refuses_candidates_past_memory(tiny_pipe):
    """The Python API checks decoder candidates as `unclip generate` does, before anything is
    sampled, naming the call's setting."""
    from unclip.utils.limits import available_memory

    count = available_memory() // 1024  # ~500 KiB per tiny candidate: far past the memory
    with pytest.raises(ValueError) as err:
        tiny_pipe("a red circle", sampling={"decoder": {"best_of": count}}, progress=False)
    msg = str(err.value)
    assert msg.startswith(f"sampling['decoder']['best_of'] {count}") and "\n" not in msg
    assert "activations" in msg
