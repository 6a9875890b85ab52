"""``unclip embed``: precompute CLIP image and text embeddings (clip-retrieval layout) and their
statistics; see :mod:`unclip.train.embed`.

    unclip embed --source webdataset --data "shards/{00000..00099}.tar" --clip-config pipe/ --out
    emb/ torchrun --nproc_per_node 8 -m unclip.cli.embed --source folder --data images/ \\
        --clip-config prior.yaml --out emb/
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unclip embed",
        description="precompute CLIP image and text embeddings in the clip-retrieval layout, plus "
        "their statistics",
    )
    p.add_argument(
        "--data", help="image folder, or tar shards (path, brace pattern, '::' list, pipe: URL)"
    )
    p.add_argument("--source", required=True, choices=["folder", "webdataset", "shapes"])
    p.add_argument(
        "--clip-config",
        required=True,
        help="pipeline folder (with clip/), CLIP folder, or YAML with a 'clip:' section",
    )
    p.add_argument("--out", required=True, help="output folder (clip-retrieval layout)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--shard-size",
        type=int,
        default=10000,
        help="rows per output shard for folder/shapes (webdataset: one output shard per tar shard)",
    )
    p.add_argument(
        "--num", type=int, default=None, help="embed only the first N items (folder/shapes)"
    )
    p.add_argument(
        "--dtype",
        choices=["float16", "float32"],
        default="float16",
        help="dtype of the .npy shards",
    )
    p.add_argument("--resolution", type=int, default=64, help="shapes: render resolution")
    p.add_argument("--shapes-seed", type=int, default=0)
    p.add_argument("--shapes-split", default="train", choices=["train", "heldout", "all"])
    p.add_argument("--overwrite", action="store_true", help="delete existing shards in --out first")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    from unclip.train.embed import EmbedJob, embed

    args["progress"] = not args.pop("no_progress")
    return embed(EmbedJob(**args))


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip embed", main, sys.argv[1:]))
