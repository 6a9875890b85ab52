"""``unclip train-clip``: train a small CLIP on the shapes world (see
:mod:`unclip.shapes.train_clip`).

unclip train-clip configs/shapes/clip.yaml --output-dir runs/shapes/clip train.max_steps=2000
"""

from __future__ import annotations

import sys

from unclip.cli.train_prior import run_config_command


def main(argv=None) -> int:
    return run_config_command(
        "unclip train-clip",
        "train a small CLIP on the shapes world (contrastive image-caption loss)",
        "YAML with clip:, data:, train:, output: sections (see configs/shapes/clip.yaml)",
        argv,
        load="unclip.shapes.train_clip:load_clip_train_config",
        train="unclip.shapes.train_clip:train_clip",
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-clip", main, sys.argv[1:]))
