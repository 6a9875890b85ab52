"""``unclip shapes-eval``: measure a shapes pipeline on the held-out split.

    unclip shapes-eval                                      # the bundled model, 200 + 200 prompts
    unclip shapes-eval --model runs/shapes/pipeline --out report.json --grid docs/shapes_grid.png
    unclip shapes-eval --model P --num 60 --stages decoder --sampling '{"decoder": {"steps": 50}}'
    unclip shapes-eval --model P --oracle    # decode from the true renders' CLIP image embeddings
    unclip shapes-eval --stages upsamplers --sampling '{"sr128": {"steps": 2}}'  # true renders up

See :mod:`unclip.shapes.evaluate` for what is measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from unclip.cli.errors import seed_type
from unclip.cli.generate import add_autocast_arg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unclip shapes-eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="pipeline folder (default: the bundled shapes model)"
    )
    p.add_argument("--num", type=int, default=200, help="prompts per kind (single, two-object)")
    p.add_argument("--seed", type=seed_type, default=0, help="image i is sampled with seed + i")
    p.add_argument(
        "--prompt-seed", type=seed_type, default=1000, help="seed of the held-out captions"
    )
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument(
        "--sampling",
        default=None,
        help='JSON overrides per stage, e.g. \'{"decoder": {"guidance_scale": 5}}\'',
    )
    p.add_argument(
        "--stages",
        # unclip.shapes.evaluate.STAGES, written out: importing it would load torch for --help
        choices=("all", "decoder", "upsamplers"),
        default="all",
        help="the whole pipeline, up to the base decoder, or the upsamplers alone on true "
        "renders at the decoder's resolution",
    )
    p.add_argument(
        "--oracle", action="store_true", help="decode from the true renders' CLIP image embeddings"
    )
    p.add_argument(
        "--decoder-weights",
        default=None,
        help="load these decoder weights instead (e.g. a training checkpoint's raw, non-EMA "
        "model.safetensors; a repa run's alignment head is left out)",
    )
    p.add_argument(
        "--reranker",
        default=None,
        help="CLIP folder that scores the decoder candidates instead of the pipeline's own "
        "reranker/CLIP",
    )
    add_autocast_arg(p)
    p.add_argument("--out", default=None, help="write the report JSON here")
    p.add_argument("--grid", default=None, help="write a small sample grid PNG here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sampling = json.loads(args.sampling) if args.sampling else None
    except json.JSONDecodeError as e:
        parser.error(f"--sampling is not valid JSON: {e}")
    from unclip.shapes.evaluate import run

    report = run(
        args.model,
        args.num,
        seed=args.seed,
        prompt_seed=args.prompt_seed,
        batch_size=args.batch_size,
        sampling=sampling,
        stages=args.stages,
        oracle=args.oracle,
        decoder_weights=args.decoder_weights,
        reranker=args.reranker,
        out=args.out,
        grid=args.grid,
        autocast_dtype=args.autocast,
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip shapes-eval", main, sys.argv[1:]))
