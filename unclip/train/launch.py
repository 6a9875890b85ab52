"""How many processes a launch asked for: ``accelerate launch --num_processes N`` on CPUs runs one
process unless told otherwise, so a run reads its launcher's command line to warn that fewer
processes run than were asked for (``torchrun --nproc_per_node N`` starts them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def launch_shortfall(
    num_processes: int, launcher_argv: Optional[list[str]] = None
) -> Optional[str]:
    """A one-line warning when ``accelerate launch`` was asked for more processes than run.

    Without GPUs, ``accelerate launch --num_processes 2`` (or a config file saying 2) starts one
    plain process and trains alone, without a word. ``launcher_argv``: the launching command's
    arguments (default: the parent process's, read from ``/proc``; none elsewhere)."""
    if num_processes > 1:
        return None
    argv = _parent_argv() if launcher_argv is None else list(launcher_argv)
    if "launch" not in argv or not any(Path(a).name.startswith("accelerate") for a in argv[:3]):
        return None
    asked = _asked_processes(argv)
    if asked is None or asked <= num_processes:
        return None
    return (
        f"accelerate launch was asked for {asked} processes but started {num_processes}: without "
        f"GPUs it runs one process; for {asked} CPU processes (DDP over gloo) run the same script "
        f"with `torchrun --nproc_per_node {asked}` in place of `accelerate launch` "
        f"(e.g. torchrun --nproc_per_node {asked} train_prior.py CONFIG)"
    )


def _parent_argv() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def _asked_processes(argv: list[str]) -> Optional[int]:
    """``--num_processes N`` of an ``accelerate launch`` command line, else its config file's."""
    values = {}
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes", "--config_file", "--config-file"):
            if arg == flag and i + 1 < len(argv):
                values[flag.replace("-", "_")] = argv[i + 1]
            elif arg.startswith(flag + "="):
                values[flag.replace("-", "_")] = arg.split("=", 1)[1]
    if "__num_processes" in values:
        try:
            return int(values["__num_processes"])
        except ValueError:
            return None
    if "__config_file" in values:
        try:
            import yaml

            config = yaml.safe_load(Path(values["__config_file"]).read_text())
            return int(config.get("num_processes"))
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
            return None
    return None
