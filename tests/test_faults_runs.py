"""The last faults of a training run: one run per output folder (a lock), a diverged run, damaged
initial weights and Ctrl-C are one-line errors that keep the run's checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CONFIGS, ROOT

from unclip.cli.errors import run_main
from unclip.cli.train_decoder import main as train_decoder

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
