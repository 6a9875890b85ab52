"""Training-step speed options on the mid model: which of PyTorch's faster paths pay on this CPU.

    python benchmarks/bench_train_options.py            # about 6 minutes
    python benchmarks/bench_train_options.py --quick    # tiny model, about a minute

One process per stage builds the stage as ``bench_peers.py`` does (its real ``TrainLoop`` and task,
fp32 unless ``--mixed-precision bf16``, one thread) and times one training step under each variant
in alternating rounds (A B C …, then reversed), switching the variant on the same model and
optimizer between rounds:

* ``base``: what training does by default — torch's AdamW as it picks its implementation (on a
  CPU: the per-parameter loop), diffusers' ``EMAModel`` updating one parameter at a time,
  contiguous (NCHW) convolutions;
* ``fused``: AdamW's fused kernel (``fused=True``, available on CPUs since torch 2.4);
* ``foreach``: AdamW's multi-tensor path (``foreach=True``);
* ``ema_foreach``: the EMA update with ``torch._foreach`` ops (``EMAModel(foreach=True)``);
* ``channels_last`` (decoder, upsampler): weights and activations NHWC, so oneDNN runs the
  convolutions without layout reorders.

Reported: the median step time per variant and the median of per-round ratios to ``base``
(> 1: faster), from wall and from CPU seconds. Writes
``benchmarks/results/bench_train_options.json`` (``_bf16`` with ``--mixed-precision bf16``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import common
import torch

VARIANTS = {
    "prior": ["base", "fused", "foreach", "ema_foreach"],
    "decoder": ["base", "fused", "ema_foreach", "channels_last"],
    "upsampler": ["base", "fused", "ema_foreach", "channels_last"],
}


def measure(stage: str, quick: bool, rounds: int, steps: int, precision: str = "no") -> dict:
    import peers_models

    setup = peers_models.SETUPS["quick" if quick else "full"]
    spec = {
        "size": setup["size"],
        "batch": setup["batch"][stage],
        "upsampler_sizes": list(setup["upsampler_sizes"]),
        "unclip_upsampler": setup["unclip_upsampler"],
        "mixed_precision": precision,
    }
    built = peers_models.build_unclip(stage, spec, tempfile.mkdtemp(prefix="bench-opts-"))
    loop = built["loop"]
    optimizer = getattr(loop.optimizer, "optimizer", loop.optimizer)

    def use(variant: str) -> None:
        for group in optimizer.param_groups:
            group["fused"] = variant == "fused"
            group["foreach"] = variant == "foreach"
        loop.ema.foreach = variant == "ema_foreach"
        if stage != "prior":
            fmt = torch.channels_last if variant == "channels_last" else torch.contiguous_format
            loop.model.to(memory_format=fmt)

    variants = VARIANTS[stage]
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}  # CPU seconds: steadier than wall time on a shared machine
    for v in variants:  # warm-up: each path once (allocations, oneDNN primitive caches)
        use(v)
        built["step"]()
    for i in range(rounds):
        for v in common.rounds_order(variants, i):
            use(v)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                built["step"]()
            times[v].append((time.perf_counter() - t0) / steps)
            cpu[v].append((time.process_time() - c0) / steps)
        common.log(
            f"{stage} round {i + 1}/{rounds}: "
            + ", ".join(f"{v} {times[v][-1]:.3f} s" for v in variants)
        )
    return {
        "stage": stage,
        "batch": spec["batch"],
        "step_s": times,
        "cpu_s": cpu,
        "variants": {
            v: {
                "median_step_s": common.median(times[v]),
                "speedup_vs_base": common.paired_ratio(times["base"], times[v]),
                "speedup_vs_base_cpu_time": common.paired_ratio(cpu["base"], cpu[v]),
            }
            for v in variants
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per variant and round")
    p.add_argument("--stages", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument(
        "--mixed-precision",
        choices=("no", "bf16"),
        default="no",
        help="train.mixed_precision of every variant (default no: fp32; bf16: results in "
        "bench_train_options_bf16.json)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    rounds = args.rounds or (2 if args.quick else 5)
    result = {
        "machine": common.machine(),
        "quick": args.quick,
        "rounds": rounds,
        "mixed_precision": args.mixed_precision,
        "stages": [],
    }
    for stage in args.stages:
        steps = args.steps or (2 if args.quick or stage != "prior" else 4)
        result["stages"].append(measure(stage, args.quick, rounds, steps, args.mixed_precision))
    name = "bench_train_options_quick" if args.quick else "bench_train_options"
    if args.mixed_precision != "no":
        name += f"_{args.mixed_precision}"
    return common.finish(name, result, started, report)


def report(r: dict) -> str:
    rows = [
        {"stage": s["stage"], "variant": v, **x}
        for s in r["stages"]
        for v, x in s["variants"].items()
    ]
    cols = [
        ("stage", "stage"),
        ("variant", "variant"),
        ("median step s", "median_step_s"),
        ("speedup vs base (median of per-round ratios)", "speedup_vs_base"),
        ("same, from CPU seconds", "speedup_vs_base_cpu_time"),
    ]
    precision = {"no": "fp32", "bf16": "bf16 autocast"}[r.get("mixed_precision", "no")]
    title = f"training-step options, {precision}, 1 thread, {r['rounds']} rounds"
    return f"machine: {common.machine_line(r['machine'])}\n" + common.table(rows, cols, title)


if __name__ == "__main__":
    sys.exit(main())
