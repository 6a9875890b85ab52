"""A multi-process launch that silently runs one process is named, with the launch that works."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unclip.train.launch import launch_shortfall

ACCELERATE = ["/venv/bin/python3", "/venv/bin/accelerate", "launch"]


@pytest.mark.parametrize(
    "flags", [["--num_processes", "2"], ["--num_processes=2"], ["--num-processes", "2"]]
)
def test_accelerate_asked_for_two_processes_but_one_runs(flags):
    message = launch_shortfall(1, [*ACCELERATE, *flags, "train_prior.py", "c.yaml"])
    assert "asked for 2 processes but started 1" in message
    assert "torchrun --nproc_per_node 2" in message


def test_the_process_count_of_an_accelerate_config_file_counts(tmp_path):
    config = tmp_path / "cpu2.yaml"
    config.write_text("distributed_type: NO\nnum_processes: 2\n")
    argv = [*ACCELERATE, "--config_file", str(config), "train_prior.py", "c.yaml"]
    assert "torchrun --nproc_per_node 2" in launch_shortfall(1, argv)


def test_no_warning_when_the_processes_run_or_were_not_asked_for():
    argv = [*ACCELERATE, "--num_processes", "2", "train_prior.py"]
    assert launch_shortfall(2, argv) is None
    assert launch_shortfall(1, [*ACCELERATE, "--num_processes", "1", "train_prior.py"]) is None
    assert launch_shortfall(1, [*ACCELERATE, "train_prior.py"]) is None
    torchrun = ["/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "launch"]
    assert launch_shortfall(1, torchrun) is None


def test_the_launching_command_is_read_from_the_parent_process(tmp_path):
    if not Path(f"/proc/{os.getpid()}/cmdline").is_file():
        pytest.skip("reads /proc")
    # a stand-in `accelerate` executable whose child checks its own launch, as a training
    # process started by `accelerate launch --num_processes 2` does
    child = "from unclip.train.launch import launch_shortfall; print(launch_shortfall(1))"
    launcher = tmp_path / "accelerate"
    launcher.write_text(
        f"#!{sys.executable}\nimport subprocess, sys\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode)\n"
    )
    launcher.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [str(launcher), "launch", "--num_processes", "2", "train_prior.py"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torchrun --nproc_per_node 2" in proc.stdout
