"""``torch.compile`` of the training step (inductor): compile time against per-step gain and
break-even, per stage, at full precision.

    python benchmarks/bench_compile_train.py            # prior, decoder, upsampler ("small")
    python benchmarks/bench_compile_train.py --quick    # prior only, fewer rounds

The step is bench_training.py's (the stage's real loss, backward, clipping, AdamW, EMA, fp32). One
forked process per stage holds two copies of the model with the same weights, one eager and one
compiled with ``module.compile()`` (forward and, through AOTAutograd, backward), each with its own
optimizer; rounds alternate the two (medians of per-round ratios). The compiled copy's first step
is timed with an empty inductor cache ("cold"); a second process, after the first filled the
cache, times its first step again ("warm": what a second process pays). Break-even = (first step −
compiled step) ÷ (eager step − compiled step), in steps; "never" when compiling does not make the
step faster. ``first_loss_diff``: the two copies' losses on their first step (the same weights,
batch and noise: the compiled arithmetic's own difference); ``max_loss_diff``: the largest over
the timed steps, where the copies' weights have drifted apart through the updates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import traceback
import warnings

import bench_training
import common
import torch


def child(spec: dict, queue) -> None:
    try:
        warnings.filterwarnings("ignore")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec["cache"]
        torch.set_num_threads(spec["threads"])
        torch.manual_seed(0)
        _, _, eager_step, _ = bench_training.build(spec)
        torch.manual_seed(0)
        model, _, compiled_step, _ = bench_training.build(spec)
        model.compile()
        eager_loss = eager_step()
        t0 = time.perf_counter()
        compiled_loss = compiled_step()
        first = time.perf_counter() - t0
        if spec["first_only"]:
            queue.put({"first_step_s": first})
            return
        for _ in range(spec["warmup"]):
            eager_step()
            compiled_step()
        eager, compiled, diffs = [], [], []
        for i in range(spec["rounds"]):
            order = [("eager", eager_step), ("compiled", compiled_step)]
            losses = {}
            for name, step in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                losses[name] = step()
                (eager if name == "eager" else compiled).append(time.perf_counter() - t0)
            diffs.append(abs(losses["eager"] - losses["compiled"]))
        queue.put(
            {
                "first_step_s": first,
                "eager_s": eager,
                "compiled_s": compiled,
                "first_loss_diff": abs(eager_loss - compiled_loss),
                "max_loss_diff": max(diffs),
            }
        )
    except Exception:  # report, don't hang the parent
        queue.put({"error": traceback.format_exc()})


def measure(stage: str, size: str, rounds: int, threads: int) -> dict:
    cache = tempfile.mkdtemp(prefix="unclip-inductor-train-")
    try:
        spec = {
            "stage": stage,
            "size": size,
            "batch": bench_training.DEFAULT_BATCH[size],
            "threads": threads,
            "warmup": 2,
            "rounds": rounds,
            "cache": cache,
            "first_only": False,
        }
        cold = bench_training.run_child(spec, child)
        warm = bench_training.run_child({**spec, "first_only": True}, child)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    eager = common.median(cold["eager_s"])
    compiled = common.median(cold["compiled_s"])
    speedup = common.paired_ratio(cold["eager_s"], cold["compiled_s"])
    saving = eager - compiled

    def break_even(first: float):
        return (first - compiled) / saving if saving > 0 else None

    return {
        "stage": stage,
        "size": size,
        "batch": spec["batch"],
        "eager_step_s": eager,
        "compiled_step_s": compiled,
        "speedup": speedup,
        "first_step_cold_s": cold["first_step_s"],
        "first_step_warm_s": warm["first_step_s"],
        "break_even_cold_steps": break_even(cold["first_step_s"]),
        "break_even_warm_steps": break_even(warm["first_step_s"]),
        "first_loss_diff": cold["first_loss_diff"],
        "max_loss_diff": cold["max_loss_diff"],
        "eager_s": cold["eager_s"],
        "compiled_s": cold["compiled_s"],
    }


def report(r: dict) -> str:
    def steps(v):
        return "never" if v is None else f"{v:,.0f}"

    rows = [
        {
            **row,
            "break_even": f"{steps(row['break_even_cold_steps'])} / "
            f"{steps(row['break_even_warm_steps'])}",
        }
        for row in r["rows"]
    ]
    return common.table(
        rows,
        [
            ("stage", "stage"),
            ("batch", "batch"),
            ("eager s", "eager_step_s"),
            ("compiled s", "compiled_step_s"),
            ("speedup", "speedup"),
            ("first step, cold cache s", "first_step_cold_s"),
            ("first step, warm cache s", "first_step_warm_s"),
            ("break-even (cold / warm), steps", "break_even"),
            ("first loss diff", "first_loss_diff"),
            ("max loss diff", "max_loss_diff"),
        ],
        "torch.compile of the training step (fp32)",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="prior only, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 9)")
    parser.add_argument("--size", default="small", choices=sorted(bench_training.DEFAULT_BATCH))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    stages = ["prior"] if args.quick else ["prior", "decoder", "upsampler"]
    rounds = args.rounds or (5 if args.quick else 9)
    rows = []
    for stage in stages:
        common.log(f"{stage}: compiling and timing")
        rows.append(measure(stage, args.size, rounds, args.threads))
        common.log(report({"rows": rows[-1:]}))
    result = {"machine": common.machine(), "threads": args.threads, "rows": rows}
    return common.finish("bench_compile_train", result, started, report)


if __name__ == "__main__":
    raise SystemExit(main())
