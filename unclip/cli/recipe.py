"""``unclip recipe shapes OUT``: train the shapes model from scratch with one command.

    unclip recipe shapes runs/shapes             # then: unclip generate ... --model OUT/pipeline
    unclip recipe shapes runs/quick --set all:train.max_steps=200 --set clip:data.batch_size=64
    unclip recipe shapes runs/shapes --dry-run       # print the steps' commands

The steps, their order and what runs side by side: :mod:`unclip.shapes.recipe`. Run the same
command again after a failure or an interruption: finished steps are skipped, interrupted training
resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unclip recipe", description=__doc__.splitlines()[0])
    from unclip.shapes.recipe import RECIPES  # the standard library only: --help stays instant

    p.add_argument(
        "recipe",
        choices=tuple(RECIPES),
        help="shapes: the bundled shapes model's recipe (about an hour on two CPU cores; gives the "
        "bundled weights: an aligned decoder and its fine-tune on two-object scenes, in bf16 "
        "where native, and a reranking CLIP); shapes-one-clip: the reranking CLIP conditions too "
        "(fewer prompts right); shapes-1h: the first decoder run alone, in fp32 (far fewer "
        "two-object scenes right). docs/shapes_model.md has the measured times and figures",
    )
    p.add_argument("out", help="output folder: one folder per step, logs/, timings.tsv, pipeline/")
    p.add_argument(
        "--configs",
        default=None,
        help="folder with the recipe's YAML files (default: configs/shapes of the source checkout)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="STEP:KEY=VALUE",
        help="a config override for one training step (clip, sr64, sr128, prior, decoder, "
        "decoder_pairs, reranker) or all of them, e.g. all:train.max_steps=100 (repeatable)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=2,
        help="data-parallel processes for the decoder (torchrun; default 2, one per core)",
    )
    p.add_argument("--dry-run", action="store_true", help="print each step's command and exit")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from pathlib import Path

    from unclip.shapes import recipe

    # absolute, so that the recorded settings do not depend on the working directory
    configs = Path(args.configs).resolve() if args.configs else recipe.default_configs()
    overrides = recipe.parse_overrides(args.overrides, recipe.training_steps(args.recipe))
    out = Path(args.out).resolve()
    steps = recipe.shapes_steps(
        out, configs, overrides, processes=args.processes, recipe=args.recipe
    )
    if args.dry_run:
        finished = recipe.plan(steps, out)[0] if out.is_dir() else set()
        for step in steps:
            after = f"  (after {', '.join(step.after)})" if step.after else ""
            skip = "  [finished: skipped]" if step.name in finished else ""
            print(f"{step.name}{after}{skip}:\n  {shlex.join(step.argv)}")
        return 0
    start = time.monotonic()
    try:
        took = recipe.run_steps(steps, out)
    except KeyboardInterrupt:
        print(
            "unclip recipe: interrupted; run the same command again to go on "
            f"({out / 'timings.tsv'} records the finished steps, training resumes from its last "
            "checkpoint)",
            file=sys.stderr,
        )
        raise
    minutes = (time.monotonic() - start) / 60
    if not took:
        print(f"every step had finished in an earlier run; pipeline: {out / 'pipeline'}")
        return 0
    print(
        f"pipeline: {out / 'pipeline'}  ({len(took)} steps in {minutes:.1f} min of wall clock; "
        f"each step's in {out / 'timings.tsv'})\n"
        f"evaluate: unclip shapes-eval --model {out / 'pipeline'}"
    )
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip recipe", main, sys.argv[1:]))
