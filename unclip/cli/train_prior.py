"""``unclip train-prior``: train the diffusion prior (see :mod:`unclip.train.prior`).

unclip train-prior configs/tiny/prior.yaml train.max_steps=200
accelerate launch train_prior.py configs/prior_vit_l14.yaml --resume latest
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unclip.train.config import StageConfig


def stage_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments every stage trainer takes: a config, dotted overrides and run control."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("config", help="stage config YAML (see configs/)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.batch_size=16"
    )
    add_run_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def run_config_command(
    prog: str, description: str, config_help: str, argv, load: str, train: str
) -> int:
    """A training command that takes ``CONFIG [overrides]`` and the run options
    (:func:`add_run_arguments`): ``load`` and ``train`` name the config loader and the training
    function as ``"module:function"`` (imported after parsing, so ``--help`` stays instant)."""
    import importlib

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("config", help=config_help)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=500")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_run_arguments(p)
    args = p.parse_intermixed_args(argv)
    from unclip.utils.config import to_yaml

    def named(spec: str):
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = named(load)(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    return named(train)(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """``--resume``/``--overwrite`` (one or neither), ``--output-dir``, ``--max-steps-this-run``."""
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", default=None, help="'latest' or a checkpoint folder to resume from"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output_dir that holds an earlier run: its checkpoints, final/, "
        "samples and metrics are deleted first (without it such a folder is refused)",
    )
    p.add_argument("--output-dir", default=None, help="overrides train.output_dir")
    p.add_argument(
        "--max-steps-this-run",
        type=int,
        default=None,
        help="stop (with a checkpoint, without exporting) after this many optimizer steps in this "
        "invocation, e.g. to fit a scheduler's time slot; resume later with --resume latest",
    )


def stage_config(args: argparse.Namespace, stages: tuple[str, ...]) -> StageConfig:
    """The stage config named by the parsed arguments, ``--output-dir`` applied."""
    from unclip.train.config import load_stage_config

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    return load_stage_config(args.config, overrides, stages)


def run_kandinsky(args: argparse.Namespace, stage: str) -> int | None:
    """Train the config named by ``args`` if it is a Kandinsky fine-tuning config (a
    ``kandinsky:`` section, :mod:`unclip.train.kandinsky`) of ``stage``; ``None`` when it is a
    native stage config."""
    from unclip.train.kandinsky import is_kandinsky_config, load_kandinsky_config, train_kandinsky
    from unclip.utils.config import to_yaml

    if not is_kandinsky_config(args.config):
        return None
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = load_kandinsky_config(args.config, overrides, (stage,))
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    return train_kandinsky(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


def main(argv=None) -> int:
    parser = stage_parser(
        "unclip train-prior",
        "train the diffusion prior (or fine-tune a Kandinsky 2.2 prior: a config with a "
        "'kandinsky:' section)",
    )
    args = parser.parse_intermixed_args(argv)
    from unclip.utils.config import to_yaml

    done = run_kandinsky(args, "prior")
    if done is not None:
        return done
    cfg = stage_config(args, ("prior",))
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from unclip.train.prior import train_prior

    return train_prior(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-prior", main, sys.argv[1:]))
