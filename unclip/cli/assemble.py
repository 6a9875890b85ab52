"""``unclip assemble``: a pipeline folder from component folders written by the training commands.

    unclip assemble --clip runs/prior/final/clip --prior runs/prior/final/prior \\
        --decoder runs/decoder/final/decoder --upsampler runs/sr256/final/sr256 --out my-pipeline
    unclip assemble --tokenizer runs/shapes/dvae/final/tokenizer \\
        --transformer runs/shapes/dalle/final/transformer --clip unclip/bundled/shapes/clip \\
        --upsampler unclip/bundled/shapes/sr64 --upsampler unclip/bundled/shapes/sr128 --out dalle

The second form builds a DALL-E or DALL-E Mega pipeline (``--clip`` optional: the CLIP that
reranks its candidates and scores it in the evaluators; the upsamplers run after the tokenizer).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="unclip assemble", description=__doc__.splitlines()[0])
    p.add_argument(
        "--clip",
        help="CLIP folder (final/clip of any training run); for a token pipeline, the CLIP that "
        "reranks and scores (optional)",
    )
    p.add_argument("--prior", help="prior component folder")
    p.add_argument("--decoder", help="decoder component folder (unCLIP)")
    p.add_argument("--tokenizer", help="image tokenizer folder (DALL-E / DALL-E Mega)")
    p.add_argument("--transformer", help="token transformer folder (DALL-E / DALL-E Mega)")
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
    if args.tokenizer or args.transformer:
        return _assemble_tokens(args)
    if not args.clip or not args.decoder:
        raise ValueError(
            "unclip assemble needs --clip and --decoder (an unCLIP pipeline) or --tokenizer and "
            "--transformer (a DALL-E or DALL-E Mega pipeline)"
        )
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


def _assemble_tokens(args) -> int:
    if not (args.tokenizer and args.transformer):
        raise ValueError("a token pipeline needs both --tokenizer and --transformer")
    extra = [f for f in ("prior", "decoder", "reranker") if getattr(args, f)]
    if extra:
        raise ValueError(
            f"--{extra[0]} belongs to unCLIP pipelines; a token pipeline takes --tokenizer, "
            "--transformer, --clip and --upsampler"
        )
    from unclip.pipeline.jobs import assemble_token_pipeline

    pipe = assemble_token_pipeline(
        args.tokenizer,
        args.transformer,
        args.clip,
        args.upsampler,
        out=args.out,
        overwrite=args.overwrite,
    )
    stages = ", ".join(["transformer", "tokenizer", *pipe.upsampler_names])
    clip = "; reranking CLIP" if pipe.clip is not None else ""
    print(f"wrote {pipe.family} pipeline ({stages}; {pipe.resolution}px{clip}) to {args.out}")
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip assemble", main, sys.argv[1:]))
