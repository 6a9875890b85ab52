"""``unclip make-shapes``: write the procedural shapes text-image dataset (folder or webdataset
shards).

    unclip make-shapes data/shapes --num 10000 --resolution 64 --format webdataset

See :func:`unclip.shapes.world.write_shapes` for the layout of the files.
"""

from __future__ import annotations

import argparse
import sys

from unclip.cli.errors import seed_type
from unclip.shapes.export import write_shapes
from unclip.shapes.world import SPLITS


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _resolution(text: str) -> int:
    value = _int_at_least(1)(text)
    if not 8 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"--resolution must be in [8, 4096], got {value}")
    return value


def _probability(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{flag} must be in [0, 1], got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unclip make-shapes", description="Write the procedural shapes text-image dataset."
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--num", type=_int_at_least(1), required=True, help="number of samples")
    p.add_argument(
        "--resolution", type=_resolution, default=64, help="image side in pixels (8..4096)"
    )
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--format", choices=("folder", "webdataset"), default="folder")
    p.add_argument("--shard-size", type=_int_at_least(1), default=1000)
    p.add_argument("--start-index", type=_int_at_least(0), default=0)
    p.add_argument("--image-format", choices=("png", "jpg"), default="png")
    p.add_argument("--two-object-prob", type=_probability("--two-object-prob"), default=0.3)
    p.add_argument(
        "--background-phrase-prob", type=_probability("--background-phrase-prob"), default=0.5
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv=None) -> int:
    """``unclip make-shapes OUT --num N [--resolution R --seed S --split train ...]``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        paths = write_shapes(
            args.out,
            args.num,
            resolution=args.resolution,
            seed=args.seed,
            split=args.split,
            format=args.format,
            shard_size=args.shard_size,
            start_index=args.start_index,
            image_format=args.image_format,
            two_object_prob=args.two_object_prob,
            background_phrase_prob=args.background_phrase_prob,
            progress=not args.no_progress,
        )
    except ValueError as e:
        parser.error(str(e))
    kind = "shards" if args.format == "webdataset" else "images"
    print(f"wrote {args.num} samples ({len(paths)} {kind}) to {args.out}")
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip make-shapes", main, sys.argv[1:]))
