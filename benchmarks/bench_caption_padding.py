"""Planned training FLOPs of the full-scale prior and decoder against the length of a batch's
longest caption.

    python benchmarks/bench_caption_padding.py                       # prior and decoder, 4 lengths
    python benchmarks/bench_caption_padding.py --lengths 77 256 --configs prior_vit_l14

Both full-scale configs encode captions with their own 1.31B caption transformer over a 256-token
context. The caption transformer runs only up to the batch's longest caption, and so do the
prior's transformer and the decoder's attention context (docs/training.md), which a fake-tensor
dry run cannot see: its tensors hold no values to find the longest caption in. A config whose
``text_context_length`` is K describes exactly the work of a batch whose longest caption has K
tokens (start and end tokens included), so ``unclip plan``'s count of its step (forward FLOPs per
operation, the trained network's three times, checkpointed blocks once more, the frozen CLIP's
once; one micro-batch) is that batch's. Reported: TFLOP per training sample and the ratio to the
whole 256-token context.

Writes ``benchmarks/results/bench_caption_padding.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import common

from unclip.train.config import load_stage_config
from unclip.train.plan import measure_step

SECTIONS = {"prior_vit_l14": "prior", "decoder_64": "decoder"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--lengths", nargs="+", type=int, default=[32, 77, 128, 256])
    args = p.parse_args(argv)
    if any(k < 2 or k > 256 for k in args.lengths):
        p.error("--lengths: each between 2 (start and end tokens) and 256 (the configs' context)")
    started = time.perf_counter()
    result: dict = {"machine": common.machine(), "configs": {}}
    for name in args.configs:
        rows = {}
        for k in sorted(set(args.lengths) | {256}):
            common.log(f"[{name}] longest caption {k} tokens: dry run")
            override = f"{SECTIONS[name]}.text_context_length={k}"
            cfg = load_stage_config(common.ROOT / "configs" / f"{name}.yaml", [override])
            m = measure_step(cfg, accumulation=1)
            rows[k] = {
                "train_tflop_per_sample": m.train_flops_per_sample / 1e12,
                "forward_tflop_per_micro_batch": m.forward_flops / 1e12,
                "micro_batch": m.micro_batch,
            }
        whole = rows[256]["train_tflop_per_sample"]
        for row in rows.values():
            row["of_whole_context"] = row["train_tflop_per_sample"] / whole
        result["configs"][name] = {str(k): v for k, v in rows.items()}
    return common.finish("bench_caption_padding", result, started, report)


def report(r: dict) -> str:
    rows = [
        {
            "config": name,
            "k": k,
            "tflop": f"{v['train_tflop_per_sample']:.2f}",
            "share": f"{v['of_whole_context']:.2f}",
        }
        for name, by_k in r["configs"].items()
        for k, v in by_k.items()
    ]
    cols = [
        ("config", "config"),
        ("longest caption in the batch, tokens", "k"),
        ("TFLOP per training sample", "tflop"),
        ("of the whole 256-token context", "share"),
    ]
    return common.table(rows, cols, "planned training FLOPs against the batch's longest caption")


if __name__ == "__main__":
    sys.exit(main())
