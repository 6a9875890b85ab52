"""``unclip recipe shapes OUT``: the bundled model's training as one command.

unclip/shapes/recipe.py runs the steps; unclip/cli/recipe.py is the command."""

import json
import os
import subprocess
import sys
import time
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
    assert "(broken input)" in msg  # the step's last log line
    assert "after_bad: not run: bad did not finish" in msg and "run the command again" in msg
    assert "broken input" in (out / "logs" / "bad.log").read_text()
    assert (tmp_path / "slow").exists() and not (tmp_path / "after_bad").exists()
    assert set(recipe.finished_steps(out / "timings.tsv")) == {"slow"}

    steps[0] = _step("bad", "pass")  # the cause fixed: the rerun runs what did not finish
    took = recipe.run_steps(steps, out, say=lambda _: None, poll=0.05)
    assert set(took) == {"bad", "after_bad"}


def test_independent_steps_run_side_by_side_and_an_order_only_wait_survives_a_failure(tmp_path):
    # each step waits for the other to have started: a runner that ran them one after the other
    # would time the first out
    def handshake(me, other):
        return (
            f"import pathlib, sys, time; d = pathlib.Path({str(tmp_path)!r}); "
            f"(d / {me!r}).touch(); t = time.time()\n"
            f"while not (d / {other!r}).exists():\n"
            "    time.sleep(0.02)\n"
            "    if time.time() - t > 60: sys.exit(1)"
        )

    bad = _step("bad", "import sys; sys.exit(1)")
    late = recipe.Step("late", [sys.executable, "-c", _stamp(tmp_path, "late")], wait_for=("bad",))
    steps = [_step("a", handshake("a", "b")), _step("b", handshake("b", "a")), bad, late]
    with pytest.raises(recipe.RecipeError) as err:
        recipe.run_steps(steps, tmp_path / "run", say=lambda _: None, poll=0.05)
    assert "late" not in str(err.value) and (tmp_path / "late").exists()
    assert set(recipe.finished_steps(tmp_path / "run" / "timings.tsv")) == {"a", "b", "late"}


def test_a_hangup_that_nohup_ignores_stays_ignored(tmp_path):
    import signal

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        hup = _step("hup", "import os, signal; os.kill(os.getppid(), signal.SIGHUP)")
        took = recipe.run_steps([hup], tmp_path / "run", say=lambda _: None, poll=0.05)
        assert set(took) == {"hup"} and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_sigterm_stops_the_steps_even_one_that_ignores_it(tmp_path):
    import signal

    pid_file = tmp_path / "pid"
    child = (
        "import os, pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    )
    script = (
        "import sys; from unclip.shapes import recipe; recipe.STOP_GRACE = 0.5; "
        f"recipe.run_steps([recipe.Step('stubborn', [sys.executable, '-c', {child!r}])], "
        f"{str(tmp_path / 'run')!r}, poll=0.05)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not pid_file.exists() and time.time() - t0 < 60:
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) != 0
    with pytest.raises(ProcessLookupError):  # killed after the grace time and reaped
        os.kill(int(pid_file.read_text()), 0)
    assert recipe.finished_steps(tmp_path / "run" / "timings.tsv") == {}


def test_a_step_with_changed_settings_is_refused_and_what_follows_a_rerun_step_reruns(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "train.yaml"
    config.write_text("lr: 1\n")
    first = recipe.Step("first", [sys.executable, "-c", "pass"], trains=True, inputs=(config,))
    second = _step("second", "pass", after=["first"])
    recipe.run_steps([first, second], out, say=lambda _: None, poll=0.05)
    config.write_text("lr: 2\n")  # the config changed since the step finished
    with pytest.raises(recipe.RecipeError, match="step first finished in .* with other settings"):
        recipe.run_steps([first, second], out, say=lambda _: None, poll=0.05)
    config.write_text("lr: 1\n")
    # the first step's line deleted: it runs again, and the step after it with it
    lines = (out / "timings.tsv").read_text().splitlines()
    (out / "timings.tsv").write_text("\n".join(lines[1:]) + "\n")
    took = recipe.run_steps([first, second], out, say=lambda _: None, poll=0.05)
    assert set(took) == {"first", "second"}
    # a step that does not train runs again with new settings, or when its output is gone
    sampling = tmp_path / "sampling.yaml"
    sampling.write_text("steps: 1\n")
    (tmp_path / "made").mkdir()
    fin = _step("fin", "pass", after=["first"])
    fin.inputs, fin.output = (sampling,), tmp_path / "made"
    recipe.run_steps([first, fin], out, say=lambda _: None, poll=0.05)
    sampling.write_text("steps: 2\n")
    assert set(recipe.run_steps([first, fin], out, say=lambda _: None, poll=0.05)) == {"fin"}
    (tmp_path / "made").rmdir()
    assert recipe.plan([first, fin], out)[0] == {"first"}
    # a training step after one that runs again is refused: its folder holds the earlier run
    third = recipe.Step("third", [sys.executable, "-c", "pass"], ("first",), trains=True)
    recipe.run_steps([first, third], out, say=lambda _: None, poll=0.05)
    lines = (out / "timings.tsv").read_text().splitlines()
    (out / "timings.tsv").write_text("\n".join(x for x in lines if not x.startswith("first")))
    with pytest.raises(recipe.RecipeError, match="third finished .* but first, which it was"):
        recipe.run_steps([first, third], out, say=lambda _: None, poll=0.05)


def test_a_malformed_record_a_second_recipe_and_a_missing_output_are_errors(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "timings.tsv").write_text("clip\t12\tabc\nprior\tabc\n")
    with pytest.raises(recipe.RecipeError, match=r"timings.tsv:2: 'prior\\tabc' is not"):
        recipe.run_steps([_step("prior", "pass")], out, say=lambda _: None)
    (out / "timings.tsv").unlink()

    held = recipe._lock(out)
    try:
        with pytest.raises(recipe.RecipeError, match="another unclip recipe is running in"):
            recipe.run_steps([_step("a", "pass")], out, say=lambda _: None)
    finally:
        held.close()

    quiet = recipe.Step("quiet", [sys.executable, "-c", "print('stopped early')"])
    quiet.output = tmp_path / "never"
    killed = _step("killed", "import os, signal; print('last words'); os.kill(os.getpid(), 9)")
    with pytest.raises(recipe.RecipeError) as err:
        recipe.run_steps([quiet, killed], out, say=lambda _: None, poll=0.05)
    msg = str(err.value)
    assert f"quiet: exit status 0 but no {tmp_path / 'never'}" in msg
    assert "killed: killed by SIGKILL (out of memory?)" in msg and "(last words)" in msg
    assert recipe.finished_steps(out / "timings.tsv") == {}


def test_an_interrupted_recipe_stops_its_steps_and_records_none_of_them(tmp_path):
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    slow = _step(
        "slow",
        f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str("
        "os.getpid())); time.sleep(60)",
    )
    trigger = _step(
        "trigger",
        f"import pathlib, time\nwhile not pathlib.Path({str(pid_file)!r}).exists(): "
        "time.sleep(0.05)",
    )

    def say(line):
        if line.endswith("done  trigger") or "done  trigger" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recipe.run_steps([slow, trigger], out, say=say, poll=0.05)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)
    assert set(recipe.finished_steps(out / "timings.tsv")) == {"trigger"}
    assert "=== " in (out / "logs" / "slow.log").read_text()  # the run's header line


@pytest.mark.parametrize(
    "items, message",
    [
        (["decoder:train.lr"], "expected STEP:key=value"),
        (["train.max_steps=5"], "expected STEP:key=value"),
        (["decoder:--max-steps-this-run=5"], "expected STEP:key=value with a dotted config key"),
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
    got["decoder"].append("clip.pretrained=mine.safetensors")
    out = tmp_path / "odd {name} #1"  # braces and a YAML comment sign in the folder's name
    steps = {s.name: s for s in recipe.shapes_steps(out, recipe.default_configs(), got)}
    argv = steps["decoder"].argv
    # the user's setting comes after the recipe's own, so it wins
    clip = out / "clip" / "final" / "clip" / "model.safetensors"
    ours = f"clip.pretrained={json.dumps(str(clip))}"
    assert argv.index("clip.pretrained=mine.safetensors") > argv.index(ours)
    assert "train.max_steps=2" in argv and "train.lr=1e-4" not in argv
    assert steps["assemble"].argv[steps["assemble"].argv.index("--decoder") + 1] == str(
        out / "decoder_pairs" / "final" / "decoder"
    )
    from unclip.train.config import load_stage_config

    cfg = load_stage_config(recipe.default_configs() / "prior.yaml", [ours])
    assert cfg.clip.pretrained == str(clip)  # the quoted path reads back whole
    with pytest.raises(recipe.RecipeError, match="pass --configs with the repository's"):
        recipe.shapes_steps(tmp_path, tmp_path / "nowhere")


def _stage_config(step, load=None):
    """The config ``step`` trains with: its YAML file and overrides read by ``load`` (default: the
    stage configs' loader)."""
    from unclip.train.config import load_stage_config

    i = next(i for i, a in enumerate(step.argv) if a.endswith(".yaml"))
    load = load or load_stage_config
    return load(step.argv[i], step.argv[i + 1 : step.argv.index("--output-dir")])


def test_the_recipes_steps(tmp_path, monkeypatch):
    from unclip.shapes.train_clip import load_clip_train_config

    def steps(name):
        got = recipe.shapes_steps(tmp_path, recipe.default_configs(), recipe=name)
        return {s.name: s for s in got}

    full, ranked, hour = steps("shapes-one-clip"), steps("shapes"), steps("shapes-1h")
    for each in (full, ranked):
        pairs = _stage_config(each["decoder_pairs"])
        assert pairs.train.init_weights == str(tmp_path / "decoder" / "final" / "decoder")
        assert pairs.data.shapes_two_object_prob == 0.6 and pairs.train.max_steps == 4000
        assert pairs.repa is None  # a fresh alignment head would pull a trained decoder back
        assert each["decoder_pairs"].output == tmp_path / "decoder_pairs" / "final" / "decoder"
        assert each["decoder_pairs"].after == ("decoder",)
        assert "decoder_pairs" in each["assemble"].after
    # shapes-one-clip: one CLIP with relation and colour-swap hard negatives conditions and
    # reranks
    clip_cfg = _stage_config(full["clip"], load_clip_train_config)
    assert clip_cfg.data.hard_negatives == 0.25
    assert clip_cfg.data.pair_negatives == {"swap": 0.5, "relation": 0.5}
    assert "reranker" not in full and "--reranker" not in full["assemble"].argv
    assert full["finalize"].argv[-2:] == ["--closed-vocabulary", "clip"]
    # both decoder runs in bf16 where the CPU runs it natively (levers 23 and 24); the first
    # decoder run alone (shapes-1h) keeps the config's fp32
    for name in ("decoder", "decoder_pairs"):
        assert _stage_config(full[name]).train.mixed_precision == "auto"
        assert _stage_config(ranked[name]).train.mixed_precision == "auto"
    assert _stage_config(hour["decoder"]).train.mixed_precision == "no"
    # shapes (levers 22 and 24): the CLIP without hard negatives conditions, a second CLIP with
    # them, on the upsamplers' core, is assembled as the reranker
    assert _stage_config(ranked["clip"], load_clip_train_config).data.hard_negatives == 0.0
    rank = ranked["reranker"]
    rank_cfg = _stage_config(rank, load_clip_train_config)
    assert rank.argv[rank.argv.index("unclip.cli") + 1] == "train-clip"
    assert rank_cfg.data.hard_negatives == 0.25
    assert rank_cfg.data.pair_negatives == {"swap": 0.5, "relation": 0.5}
    assert rank.wait_for == ("sr128",) and rank.after == ()
    assert rank.output == tmp_path / "reranker" / "final" / "clip"
    argv = ranked["assemble"].argv
    assert argv[argv.index("--reranker") + 1] == str(rank.output)
    assert "reranker" in ranked["assemble"].after
    assert ranked["finalize"].argv[-4:] == [
        "--closed-vocabulary",
        "clip",
        "--closed-vocabulary",
        "reranker",
    ]
    assert "decoder_pairs" not in hour and "decoder" in hour["assemble"].after
    assert "reranker" not in hour and "--reranker" not in hour["assemble"].argv
    assert hour["finalize"].argv[-2:] == ["--closed-vocabulary", "clip"]
    assert _stage_config(hour["clip"], load_clip_train_config).data.hard_negatives == 0.0
    for each in (full, ranked, hour):  # every recipe's first decoder run is lever 19's aligned one
        cfg = _stage_config(each["decoder"])
        assert (cfg.repa.weight, cfg.repa.clip_layer) == (0.05, "layer1")
        assert (cfg.data.shapes_two_object_prob, cfg.train.max_steps) == (0.5, 4600)
        assert each["sr128"].wait_for == ("sr64",) and each["sr128"].after == ()
        assert each["prior"].after == ("clip",) and each["decoder"].after == ("clip",)
        assert each["finalize"].after == ("assemble",)
    one = recipe.training_steps("shapes-one-clip")
    assert one == (*recipe.BASE_STEPS, "decoder", "decoder_pairs")  # the CLIP once
    with pytest.raises(recipe.RecipeError, match="unknown step 'decoder_pairs'"):
        recipe.parse_overrides(["decoder_pairs:train.lr=1"], recipe.training_steps("shapes-1h"))
    for steps in (one, recipe.training_steps("shapes-1h")):
        with pytest.raises(recipe.RecipeError, match="unknown step 'reranker'"):
            recipe.parse_overrides(["reranker:train.lr=1"], steps)
    mine = recipe.parse_overrides(
        ["reranker:train.max_steps=7", "clip:data.hard_negatives=0.5"],
        recipe.training_steps("shapes"),
    )
    got = {s.name: s for s in recipe.shapes_steps(tmp_path, recipe.default_configs(), mine)}
    assert _stage_config(got["reranker"], load_clip_train_config).train.max_steps == 7
    assert _stage_config(got["clip"], load_clip_train_config).data.hard_negatives == 0.5
    mine = recipe.parse_overrides(["clip:data.hard_negatives=0.5"], one)
    got = recipe.shapes_steps(tmp_path, recipe.default_configs(), mine, recipe="shapes-one-clip")
    got = {s.name: s for s in got}
    # the user's setting comes after the recipe's own, so it wins
    assert _stage_config(got["clip"], load_clip_train_config).data.hard_negatives == 0.5
    with pytest.raises(recipe.RecipeError, match="unknown recipe 'shapes-2h'; the recipes are"):
        recipe.shapes_steps(tmp_path, recipe.default_configs(), recipe="shapes-2h")
    # a recipe's settings reach every base step it names
    own = {name: ("train.max_steps=3",) for name in recipe.BASE_STEPS}
    monkeypatch.setitem(recipe.RECIPES, "shapes-test", {**own, "decoder": ()})
    got = recipe.shapes_steps(tmp_path, recipe.default_configs(), recipe="shapes-test")
    for step in got:
        if step.name in recipe.BASE_STEPS:
            assert "train.max_steps=3" in step.argv, step.name


def _run_recipe(cmd, timeout=400):
    """The command in a session of its own, so that a timeout stops its steps too."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_the_whole_recipe_runs_resumes_after_a_failure_and_gives_a_pipeline(tmp_path):
    """Every step of the real recipe at 2 optimizer steps (the decoder with 2 gloo processes):
    a broken prior setting fails that step and what needs it, the rest finishes; the same command
    with the setting fixed runs only what is left and gives a pipeline that generates."""
    out = tmp_path / "shapes"
    quick = ["--set", "all:train.max_steps=2", "--set", "clip:data.batch_size=16"]
    quick += ["--set", "clip:output.eval_samples=16"]
    quick += ["--set", "reranker:data.batch_size=16", "--set", "reranker:output.eval_samples=16"]
    cmd = [sys.executable, "-m", "unclip.cli", "recipe", "shapes", str(out), *quick]
    first = _run_recipe([*cmd, "--set", "prior:train.lr=-1"])
    assert first.returncode == 1, first.stdout + first.stderr
    assert "prior: exit status 1" in first.stderr and "assemble: not run" in first.stderr
    assert "train.lr must be a positive" in first.stderr  # the step's own error, quoted
    done = recipe.finished_steps(out / "timings.tsv")
    assert set(done) == {"clip", "sr64", "sr128", "decoder", "decoder_pairs", "reranker"}
    assert not (out / "pipeline").exists()

    second = _run_recipe(cmd)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("skip") == 6 and "start prior" in second.stdout
    assert set(recipe.finished_steps(out / "timings.tsv")) == {
        *done,
        "prior",
        "assemble",
        "finalize",
    }
    from unclip.pipeline.pipeline import UnCLIPPipeline

    pipe = UnCLIPPipeline.from_pretrained(out / "pipeline")
    assert pipe.reranker is not None  # the recipe's reranking CLIP chooses the candidates
    images = pipe(
        "a small red circle on the left",
        sampling={"prior": {"steps": 2}, "decoder": {"steps": 2, "best_of": 1}},
        output_type="pt",
        progress=False,
    ).images
    assert tuple(images.shape) == (1, 3, 128, 128)
    assert Path(out / "logs" / "decoder.log").read_text().count("exported decoder") == 1
