"""``unclip recipe shapes OUT``: the bundled model's training as one command.

unclip/shapes/recipe.py runs the steps; unclip/cli/recipe.py is the command."""

import subprocess
import sys
from pathlib import Path

import pytest

from unclip.shapes import recipe


def _step(name, code, after=()):
    return recipe.Step(name, [sys.executable, "-c", code], tuple(after))


def _stamp(out, name):  # a step that records when it ran, after the files of the steps it needs
    return (
        f"import pathlib, time; pathlib.Path({str(out)!r}, {name!r}).write_text(str(time.time()))"
    )


def test_steps_run_after_what_they_need_and_a_rerun_skips_the_finished(tmp_path):
    out = tmp_path / "run"
    steps = [
        _step("a", _stamp(tmp_path, "a")),
        _step("b", f"import time; time.sleep(0.3); {_stamp(tmp_path, 'b')}"),
        _step("c", _stamp(tmp_path, "c"), after=["a", "b"]),
    ]
    said = []
    took = recipe.run_steps(steps, out, say=said.append, poll=0.05)
    assert set(took) == {"a", "b", "c"}
    stamps = {n: float((tmp_path / n).read_text()) for n in "abc"}
    assert stamps["c"] > max(stamps["a"], stamps["b"])
    assert set(recipe.finished_steps(out / "timings.tsv")) == {"a", "b", "c"}

    (tmp_path / "a").unlink()
    took = recipe.run_steps(steps, out, say=said.append, poll=0.05)
    assert took == {} and not (tmp_path / "a").exists()
    assert sum(line.startswith("skip") for line in said) == 3


def test_a_failed_step_stops_what_needs_it_and_the_rest_finishes(tmp_path):
    out = tmp_path / "run"
    steps = [
        _step("bad", "import sys; print('broken input'); sys.exit(3)"),
        _step("after_bad", _stamp(tmp_path, "after_bad"), after=["bad"]),
        _step("slow", f"import time; time.sleep(0.5); {_stamp(tmp_path, 'slow')}"),
    ]
    with pytest.raises(recipe.RecipeError) as err:
        recipe.run_steps(steps, out, say=lambda _: None, poll=0.05)
    msg = str(err.value)
    assert f"bad: exit status 3; see {out / 'logs' / 'bad'}.log" in msg
    assert "after_bad: not run: bad failed" in msg and "run the same command again" in msg
    assert "broken input" in (out / "logs" / "bad.log").read_text()
    assert (tmp_path / "slow").exists() and not (tmp_path / "after_bad").exists()
    assert set(recipe.finished_steps(out / "timings.tsv")) == {"slow"}

    steps[0] = _step("bad", "pass")  # the cause fixed: the rerun runs what did not finish
    took = recipe.run_steps(steps, out, say=lambda _: None, poll=0.05)
    assert set(took) == {"bad", "after_bad"}


@pytest.mark.parametrize(
    "items, message",
    [
        (["decoder:train.lr"], "expected STEP:key=value"),
        (["train.max_steps=5"], "expected STEP:key=value"),
        (["upsampler:train.lr=1"], "unknown step 'upsampler'; the training steps are clip,"),
    ],
)
def test_override_errors(items, message):
    with pytest.raises(recipe.RecipeError, match=message):
        recipe.parse_overrides(items)


def test_overrides_go_to_their_steps_after_the_recipes_own(tmp_path):
    got = recipe.parse_overrides(["all:train.max_steps=2", "prior:train.lr=1e-4"])
    assert got["clip"] == ["train.max_steps=2"]
    assert got["prior"] == ["train.max_steps=2", "train.lr=1e-4"]
    steps = {s.name: s for s in recipe.shapes_steps(tmp_path, recipe.default_configs(), got)}
    pairs = steps["decoder_pairs"].argv
    # the user's setting comes after the recipe's own, so it wins
    assert pairs.index("train.max_steps=2") > pairs.index("train.max_steps=7000")
    with pytest.raises(recipe.RecipeError, match="pass --configs with the repository's"):
        recipe.shapes_steps(tmp_path, tmp_path / "nowhere")


@pytest.mark.slow
def test_the_whole_recipe_runs_resumes_after_a_failure_and_gives_a_pipeline(tmp_path):
    """Every step of the real recipe at 2 optimizer steps (the decoder with 2 gloo processes):
    a broken prior setting fails that step and what needs it, the rest finishes; the same command
    with the setting fixed runs only what is left and gives a pipeline that generates."""
    out = tmp_path / "shapes"
    quick = ["--set", "all:train.max_steps=2", "--set", "clip:data.batch_size=16"]
    quick += ["--set", "clip:output.eval_samples=16"]
    cmd = [sys.executable, "-m", "unclip.cli", "recipe", "shapes", str(out), *quick]
    first = subprocess.run(
        [*cmd, "--set", "prior:train.lr=-1"], capture_output=True, text=True, timeout=400
    )
    assert first.returncode == 1, first.stdout + first.stderr
    assert "prior: exit status" in first.stderr and "assemble: not run" in first.stderr
    assert "train.lr must be a positive" in (out / "logs" / "prior.log").read_text()
    done = recipe.finished_steps(out / "timings.tsv")
    assert set(done) == {"clip", "sr64", "sr128", "decoder", "decoder_pairs"}
    assert not (out / "pipeline").exists()

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("skip") == 5 and "start prior" in second.stdout
    assert set(recipe.finished_steps(out / "timings.tsv")) == {
        *done,
        "prior",
        "assemble",
        "finalize",
    }
    from unclip.pipeline import UnCLIPPipeline

    pipe = UnCLIPPipeline.from_pretrained(out / "pipeline")
    images = pipe(
        "a small red circle on the left",
        sampling={"prior": {"steps": 2}, "decoder": {"steps": 2, "best_of": 1}},
        output_type="pt",
        progress=False,
    ).images
    assert tuple(images.shape) == (1, 3, 128, 128)
    assert Path(out / "logs" / "decoder.log").read_text().count("exported decoder") == 1
