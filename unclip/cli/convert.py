"""``unclip convert``: diffusers/Karlo unCLIP folders to native unclip folders, and back.

unclip convert karlo-v1-alpha karlo-unclip            # diffusers/Karlo → native unclip folder
unclip convert my-unclip my-diffusers --to diffusers  # native unclip → diffusers folder
unclip convert org/karlo-repo karlo-unclip             # a Hugging Face Hub repo id as the source
unclip convert kandinsky-community/kandinsky-2-2-decoder k22  # decoder + its prior in k22/prior
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unclip.cli.generate import add_hub_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="unclip convert",
        description="Convert between diffusers/Karlo unCLIP folders and native unclip pipeline "
        "folders.",
    )
    parser.add_argument(
        "src",
        help="source folder, Hugging Face Hub repo id (org/name), or 'shapes' (the bundled "
        "model) (diffusers/Karlo for --to unclip; unclip or diffusers for --to diffusers)",
    )
    parser.add_argument("dst", help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument(
        "--to",
        choices=("unclip", "diffusers"),
        default="unclip",
        help="target format (default: unclip)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty output folder"
    )
    parser.add_argument(
        "--parts",
        help="with --to diffusers: write only these comma-separated parts (text_encoder, prior, "
        "decoder, super_res) as diffusers component folders, for a pipeline diffusers cannot "
        "express as a whole (the error lists which parts export)",
    )
    add_hub_args(parser)
    args = parser.parse_args(argv)
    parts = None if args.parts is None else [p.strip() for p in args.parts.split(",") if p.strip()]
    if parts is not None and args.to != "diffusers":
        raise ValueError("--parts applies to --to diffusers only")
    from unclip.interop.diffusers import convert

    # user errors propagate: the command runner prints them on one line and exits 1
    try:
        pipe = convert(
            args.src,
            args.dst,
            to=args.to,
            overwrite=args.overwrite,
            revision=args.revision,
            cache_dir=args.cache_dir,
            parts=parts,
        )
    except ImportError as exc:  # a missing optional dependency (transformers) is the user's to fix
        raise ValueError(str(exc)) from exc
    if pipe.family == "kandinsky":
        print(
            f"wrote Kandinsky 2.2 folder {args.dst} in diffusers' layouts (stages: "
            f"{', '.join(pipe.stage_names)}; the prior in prior/)"
        )
    elif args.to == "unclip":
        print(f"wrote unclip pipeline {args.dst} (stages: {', '.join(pipe.stage_names)})")
    else:
        names = sorted(p.name for p in Path(args.dst).iterdir() if p.is_dir())
        what = "UnCLIPPipeline" if parts is None else "components of an UnCLIPPipeline"
        print(f"wrote diffusers {what} {args.dst} (components: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip convert", main, sys.argv[1:]))
