"""How much of the shapes world an image tokenizer keeps: held-out renders → tokens → images,
scored by the shapes evaluator's detector (the same one ``unclip shapes-eval`` uses).

    python benchmarks/tokenizer_roundtrip.py runs/shapes/dvae/final/tokenizer \
        runs/shapes/vqgan/final/tokenizer [--num 100] [--out results/tokenizer_roundtrip.json] \
        [--grid docs/families_roundtrip.png]

For each tokenizer folder: the round trip's mean squared error (pixels in [-1, 1]), the codes used
(distinct codes over all the round-tripped images / codebook size) and the detector's "all right"
rate for single-object and two-object images; the renders themselves are scored as the ceiling.
A transformer over a tokenizer's codes cannot score above its round trip. ``--grid`` draws the
first three prompts of each kind: a row of renders, then one row per tokenizer's round trip.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from unclip.nets.token_components import load_tokenizer
from unclip.shapes.detector import evaluate_images
from unclip.shapes.evaluate import heldout_samples
from unclip.utils.images import image_grid


def to_uint8(images: torch.Tensor) -> list[np.ndarray]:
    """``[B, 3, H, W]`` in [-1, 1] → HWC uint8 arrays."""
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).numpy())


def summary(report: dict) -> dict:
    return {
        "single_all": report["single"].get("all", 0.0),
        "pair_all": report["pair"].get("all", 0.0),
    }


@torch.no_grad()
def roundtrip(folder: Path, samples, chunk: int = 50) -> dict:
    tokenizer, cfg = load_tokenizer(folder)
    size = cfg.model.image_size
    images = torch.stack(
        [torch.from_numpy(np.array(s.image.resize((size, size)))) for s in samples]
    )
    images = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    tokens, recon = [], []
    # the images themselves go back for --grid; the report below keeps only the scores
    for i in range(0, len(images), chunk):
        t = tokenizer.encode(images[i : i + chunk])
        tokens.append(t)
        recon.append(tokenizer.decode(t).float())
    out = torch.cat(recon)
    used = torch.cat(tokens).unique().numel()
    report = evaluate_images(to_uint8(out), [s.caption for s in samples])
    return {
        "folder": str(folder),
        "mse": float(((out - images) ** 2).mean()),
        "codes_used": used,
        "num_codes": cfg.model.num_codes,
        **summary(report),
        "images": to_uint8(out),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="tokenizer folders (final/tokenizer)")
    p.add_argument("--num", type=int, default=100, help="held-out prompts of each kind")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--grid", type=Path, default=None, help="write a PNG of round trips here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    samples = heldout_samples(args.num, resolution=args.resolution)
    renders = [np.asarray(s.image) for s in samples]
    rows = [
        {"folder": "renders", **summary(evaluate_images(renders, [s.caption for s in samples]))}
    ]
    rows += [roundtrip(f, samples) for f in args.folders]
    if args.grid is not None:
        # the first three of each kind (heldout_samples lists the singles, then the pairs)
        k = min(3, args.num)
        pick = [*range(k), *range(args.num, args.num + k)]
        tiles = [renders[i] for i in pick]
        tiles += [row["images"][i] for row in rows[1:] for i in pick]
        big = [Image.fromarray(t).resize((64, 64), Image.NEAREST) for t in tiles]
        image_grid(big, cols=len(pick)).save(args.grid)
    for row in rows[1:]:
        del row["images"]
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps({"num": args.num, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
