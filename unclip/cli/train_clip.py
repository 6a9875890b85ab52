"""``unclip train-clip``: train a small CLIP on the shapes world (see
:mod:`unclip.shapes.train_clip`).

unclip train-clip configs/shapes/clip.yaml --output-dir runs/shapes/clip train.max_steps=2000
"""

from __future__ import annotations

import argparse
import sys

from unclip.cli.train_prior import add_run_arguments


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="unclip train-clip",
        description="train a small CLIP on the shapes world (contrastive image-caption loss)",
    )
    p.add_argument(
        "config",
        help="YAML with clip:, data:, train:, output: sections (see configs/shapes/clip.yaml)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=500")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_run_arguments(p)
    args = p.parse_intermixed_args(argv)
    from unclip.shapes.train_clip import load_clip_train_config, train_clip
    from unclip.utils.config import to_yaml

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = load_clip_train_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    return train_clip(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-clip", main, sys.argv[1:]))
