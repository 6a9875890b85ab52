"""``unclip convert``: diffusers/Karlo unCLIP folders to native unclip folders, and back.

unclip convert karlo-v1-alpha karlo-unclip            # diffusers/Karlo → native unclip folder
unclip convert my-unclip my-diffusers --to diffusers  # native unclip → diffusers folder
unclip convert org/karlo-repo karlo-unclip             # a Hugging Face Hub repo id as the source
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
        help="source folder or Hugging Face Hub repo id (org/name) (diffusers/Karlo for --to "
        "unclip; unclip or diffusers for --to diffusers)",
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
    add_hub_args(parser)
    args = parser.parse_args(argv)
    from unclip.interop.diffusers import convert

    try:
        pipe = convert(
            args.src,
            args.dst,
            to=args.to,
            overwrite=args.overwrite,
            revision=args.revision,
            cache_dir=args.cache_dir,
        )
    except (ValueError, FileNotFoundError, ImportError) as exc:
        parser.error(str(exc))
    if args.to == "unclip":
        print(f"wrote unclip pipeline {args.dst} (stages: {', '.join(pipe.stage_names)})")
    else:
        names = sorted(p.name for p in Path(args.dst).iterdir() if p.is_dir())
        print(f"wrote diffusers UnCLIPPipeline {args.dst} (components: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip convert", main, sys.argv[1:]))
