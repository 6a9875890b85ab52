"""A grid of the three families side by side on the same held-out shapes prompts: a row of the
true renders, then one row per pipeline; one column per prompt (the first single-object and
two-object captions of the held-out split that ``unclip shapes-eval`` uses), each image sampled
with seed = its column, in full precision.

    python benchmarks/families_grid.py --out docs/families_grid.png \\
        --model unclip=bundled --model dalle=runs/shapes/dalle/final/pipeline \\
        --model mega=runs/shapes/mega/final/pipeline

``bundled`` names the bundled unCLIP shapes model. The captions go to the same path with suffix
``.txt``, the row labels first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="LABEL=FOLDER (or bundled)")
    p.add_argument("--out", required=True)
    p.add_argument("--per-kind", type=int, default=3, help="prompts of each kind (single, pair)")
    p.add_argument("--tile", type=int, default=64)
    args = p.parse_args(argv)
    from PIL import Image

    from unclip.pipeline.auto import load_pipeline
    from unclip.shapes.evaluate import heldout_samples
    from unclip.utils.images import image_grid, to_output

    samples = heldout_samples(args.per_kind, resolution=128)
    captions = [s.caption for s in samples]
    # the first row: the true renders of the captions
    tiles = [s.image.resize((args.tile, args.tile), Image.BICUBIC) for s in samples]
    labels = ["renders"]
    for spec in args.model:
        label, _, folder = spec.partition("=")
        pipe = load_pipeline(None if folder == "bundled" else folder, autocast_dtype=None)
        gens = [torch.Generator().manual_seed(i) for i in range(len(captions))]
        out = pipe(captions, generator=gens, output_type="pt", progress=False)
        for img in to_output(out.images * 2 - 1, "uint8"):
            tiles.append(Image.fromarray(img).resize((args.tile, args.tile), Image.BICUBIC))
        labels.append(f"{label}: {folder}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # 64 colours keep the flat shapes and make the PNG a few tens of kB
    image_grid(tiles, cols=len(captions)).quantize(64).save(args.out, optimize=True)
    text = ["rows: " + "; ".join(labels), *(f"column {i}: {c}" for i, c in enumerate(captions))]
    Path(args.out).with_suffix(".txt").write_text("\n".join(text) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
