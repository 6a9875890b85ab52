"""The last faults of a training run: one run per output folder (a lock), a diverged run, damaged
initial weights and Ctrl-C are one-line errors that keep the run's checkpoint; the lock never
harms a file it did not create, a failed run lets go of its folder, and a launch that failed
before its first step is relaunched by the same command."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CONFIGS, ROOT

from unclip.cli.errors import run_main
from unclip.cli.train_decoder import main as train_decoder
from unclip.train.config import load_stage_config
from unclip.train.decoder import train_decoder as train_decoder_api
from unclip.train.run_folder import LOCK_FILE

SR32 = CONFIGS / "tiny" / "sr32.yaml"
QUIET = ["train.progress=false", "train.warmup_steps=1", "train.log_every=1"]


def train(out, *args):
    argv = [str(SR32), *QUIET, *args, "--output-dir", str(out)]
    return run_main("unclip train-decoder", train_decoder, argv)


def _one_line(capsys, status, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1, err
    assert len(err) == 1 and err[0].startswith("unclip train-decoder: error: "), err
    for needle in needles:
        assert needle in err[0], err
    return err[0]


def _hold_lock(folder):
    """Another process holding ``folder``'s run lock until it is killed."""
    code = (
        "import sys\nfrom unclip.train.run_folder import RunLock\n"
        "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\nsys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_folder_in_use_is_refused_and_a_killed_holder_is_taken_over(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert train(out, "train.max_steps=1") == 0
    holder = _hold_lock(out)
    try:
        status = train(out, "train.max_steps=2", "--resume", "latest")
        _one_line(capsys, status, "in use by another run", f"process {holder.pid}")
        assert not (out / "checkpoints" / "step_00000002").exists()
    finally:
        holder.kill()
        holder.wait()
    # killed: the kernel dropped its lock, its record stays and names it
    assert train(out, "train.max_steps=2", "--resume", "latest") == 0
    assert f"taking over the lock of process {holder.pid}" in caplog.text
    assert (out / "checkpoints" / "step_00000002").is_dir()


def test_a_diverging_run_is_one_line_and_keeps_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    status = train(out, "train.lr=1e30", "train.max_steps=20", "train.max_consecutive_nonfinite=2")
    _one_line(capsys, status, "consecutive optimizer steps had a non-finite", "lower train.lr")
    assert any((out / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("content", [b"\x80\x04\x95 a pickle", b"\xff" * 64])
def test_init_weights_that_are_no_safetensors_are_one_line(tmp_path, capsys, content):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(content)
    status = train(tmp_path / "run", "train.max_steps=1", f"train.init_weights={weights}")
    _one_line(capsys, status, "init_weights", str(weights), "truncated or corrupt")


def test_ctrl_c_checkpoints_the_step_and_names_the_resume_command(tmp_path):
    out = tmp_path / "run"
    args = [str(SR32), *QUIET, "train.max_steps=100000", "train.checkpoint_every=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("UNCLIP_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "unclip.cli", "train-decoder", *args, "--output-dir", str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("unclip train-decoder: interrupted: stopped at step "), line
    assert line.endswith(f"--output-dir {out} --resume latest"), line
    steps = sorted((out / "checkpoints").glob("step_*"))
    assert steps, "no checkpoint kept at the interrupt"
    assert steps[-1].name in line


# --------------------------------------------------------------------------------------------------
# the lock file is the run's own
# --------------------------------------------------------------------------------------------------
def _plant_symlink(lock, target):
    lock.symlink_to(target)


def _plant_hardlink(lock, target):
    os.link(target, lock)


@pytest.mark.parametrize("plant", [_plant_symlink, _plant_hardlink], ids=["symlink", "hardlink"])
def test_a_planted_lock_file_is_refused_and_its_target_survives(tmp_path, capsys, plant):
    """Anyone who can write into a shared output folder could plant run.lock as a link to a file
    the trainer's user can write: the lock must refuse it, never empty or write the target."""
    target = tmp_path / "precious.txt"
    target.write_text("the user's data\n")
    out = tmp_path / "run"
    out.mkdir()
    plant(out / LOCK_FILE, target)
    status = train(out, "train.max_steps=1")
    _one_line(capsys, status, str(out / LOCK_FILE), "remove it")
    assert target.read_text() == "the user's data\n"
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing else written


def test_a_dangling_lock_symlink_creates_nothing(tmp_path, capsys):
    target = tmp_path / "elsewhere" / "new.txt"
    target.parent.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(target)
    status = train(out, "train.max_steps=1")
    _one_line(capsys, status, "is a symbolic link", str(target))
    assert not target.exists()


# --------------------------------------------------------------------------------------------------
# a failed run lets go of its folder; a launch that failed early is relaunched as it was
# --------------------------------------------------------------------------------------------------
def _lock_is_free(out) -> bool:
    """Whether another process could take ``out``'s lock now (a flock on a second open file
    conflicts with the first even within one process)."""
    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_run_that_fails_after_claiming_its_folder_lets_go_of_it(tmp_path, caplog):
    """In a live Python session (pytest keeps the traceback, and with it the loop, as a notebook
    does) the folder is free at once, with no stale record, and the same call, fixed, starts."""
    out = tmp_path / "run"
    missing = tmp_path / "no_such_clip.safetensors"
    overrides = [*QUIET, f"train.output_dir={out}", "train.max_steps=1"]
    cfg = load_stage_config(SR32, [*overrides, f"clip.pretrained={missing}"])
    with pytest.raises((ValueError, FileNotFoundError), match="no_such_clip") as err:
        train_decoder_api(cfg)
    assert err.value.__traceback__ is not None  # the failed call's frames are still alive
    assert (out / "config.yaml").is_file()  # it did claim the folder
    assert _lock_is_free(out)
    assert (out / LOCK_FILE).read_text() == ""
    # the folder holds only what a launch writes before its first step: the same command runs
    assert train_decoder_api(load_stage_config(SR32, overrides)) == 0
    assert "taking over the lock" not in caplog.text
    assert (out / "checkpoints" / "step_00000001").is_dir()


def test_a_launch_that_crashed_before_its_first_step_is_relaunched_by_the_same_command(
    tmp_path, capsys
):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "config.yaml").write_text("stage: upsampler\n")
    (out / "checkpoints" / "step_00000001.tmp").mkdir(parents=True)  # cut short by the crash
    (out / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    (out / "metrics.jsonl").touch()
    assert train(out, "train.max_steps=1") == 0
    steps = [json.loads(x).get("step") for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps and set(steps) == {1}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


@pytest.mark.parametrize(
    "work",
    ["metrics.jsonl", "samples", "checkpoints/step_00000001", "checkpoints/step_00000001.old"],
)
def test_a_folder_holding_a_runs_work_is_still_refused(tmp_path, capsys, work):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "config.yaml").write_text("stage: upsampler\n")
    if work == "metrics.jsonl":
        (out / work).write_text(json.dumps({"step": 3, "loss": 0.5}) + "\n")
    else:
        (out / work).mkdir(parents=True)
    status = train(out, "train.max_steps=1")
    _one_line(capsys, status, "already holds files", "--resume latest", "--overwrite")
    assert (out / work).exists() and (out / "config.yaml").read_text() == "stage: upsampler\n"
