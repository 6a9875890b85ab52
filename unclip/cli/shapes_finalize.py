"""``unclip shapes-finalize``: finish an assembled shapes pipeline for shipping.

    unclip shapes-finalize runs/shapes/pipeline --sampling configs/shapes/sampling.yaml

Default sampling settings from the YAML, fp16 weights, optionally closed-vocabulary CLIPs; see
:mod:`unclip.shapes.finalize`.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unclip shapes-finalize", description=__doc__.splitlines()[0])
    p.add_argument("pipeline", help="assembled pipeline folder (rewritten in place unless --out)")
    p.add_argument(
        "--sampling", required=True, help="YAML with the default sampling settings per stage"
    )
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    p.add_argument(
        "--closed-vocabulary",
        action="append",
        default=[],
        choices=("clip", "reranker"),
        help="store this CLIP's token table for the shapes caption vocabulary only (repeatable)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write here (a new or empty folder) instead of rewriting PIPELINE",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out entirely if it holds files"
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from unclip.shapes.finalize import finalize

    finalize(
        args.pipeline,
        args.sampling,
        dtype=args.dtype,
        closed_vocabulary=args.closed_vocabulary,
        out=args.out,
        overwrite=args.overwrite,
    )
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip shapes-finalize", main, sys.argv[1:]))
