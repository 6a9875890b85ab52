"""``unclip assemble``: a pipeline folder from component folders written by the training commands.

    unclip assemble --clip runs/prior/final/clip --prior runs/prior/final/prior \\
        --decoder runs/decoder/final/decoder --upsampler runs/sr256/final/sr256 --out my-pipeline
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="unclip assemble", description=__doc__.splitlines()[0])
    p.add_argument("--clip", required=True, help="CLIP folder (final/clip of any training run)")
    p.add_argument("--prior", help="prior component folder")
    p.add_argument("--decoder", required=True, help="decoder component folder")
    p.add_argument(
        "--upsampler", action="append", default=[], help="upsampler folder, in order (repeatable)"
    )
    p.add_argument(
        "--reranker",
        help="CLIP folder that scores decoder candidates (reranking) instead of --clip",
    )
    p.add_argument("--out", required=True, help="output pipeline folder")
    p.add_argument(
        "--license",
        default=None,
        help="the weights' license for the model card (an SPDX id such as mit or apache-2.0; "
        "left out of the card when not given)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out entirely (otherwise it is refused)",
    )
    args = p.parse_args(argv)
    from unclip.pipeline.jobs import assemble_pipeline

    pipe = assemble_pipeline(
        args.clip,
        args.decoder,
        args.prior,
        args.upsampler,
        args.reranker,
        out=args.out,
        overwrite=args.overwrite,
        model_card={"license": args.license} if args.license else None,
    )
    extra = "; reranker CLIP" if pipe.reranker is not None else ""
    print(
        f"wrote pipeline ({', '.join(pipe.stage_names)}; {pipe.resolution}px{extra}) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip assemble", main, sys.argv[1:]))
