"""Faithfulness on the shapes world vs sampling steps for several diffusers schedulers.

    python benchmarks/bench_schedulers.py   # docs/schedulers.json, read by docs/schedulers.md
    python benchmarks/bench_schedulers.py --quick --out /tmp/s

The bundled model samples the held-out prompts (``--num`` single-object and as many two-object)
with one scheduler for every stage at a number of steps per stage, the decoder drawing one
candidate (best_of 1, so the table compares samplers, not reranking); the project's evaluator
scores the final 128 px images. Seconds per image are end to end on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common
import torch

from unclip.shapes.evaluate import evaluate_pipeline

SCHEDULERS = ("ddim", "dpm++", "unipc", "euler", "heun")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 + 4 prompts, two step counts")
    p.add_argument("--num", type=int, default=32, help="prompts of each kind")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    torch.set_num_threads(1)
    num = 4 if args.quick else args.num
    steps_list = (5, 10) if args.quick else (5, 10, 25)
    pipe = common.fp32_pipeline()
    rows = []
    for steps in steps_list:
        for name in SCHEDULERS:
            sampling = {
                "prior": {"scheduler": name, "steps": steps},
                "decoder": {"scheduler": name, "steps": steps, "best_of": 1},
                "upsampler": {"scheduler": name, "steps": steps},
            }
            t0 = time.perf_counter()
            rep = evaluate_pipeline(pipe, num, sampling=sampling, batch_size=32)
            final = rep["stages"][rep["final_stage"]]
            row = {
                "scheduler": name,
                "steps": steps,
                "single_all": final["single"]["all"],
                "pair_all": final["pair"]["all"],
                "all": final["all"],
                "clip_score_100": rep["clip_score_100"],
                "seconds_per_image": round((time.perf_counter() - t0) / (2 * num), 3),
            }
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": "bundled shapes model", "prompts_per_kind": num, "rows": rows}
    (out / "schedulers.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'schedulers.json'}")


if __name__ == "__main__":
    main()
