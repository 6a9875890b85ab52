"""``pipe.compile()`` (torch.compile, inductor): compile time vs per-step gain, per stage of the mid
pipeline.

    python benchmarks/bench_compile.py            # prior, decoder and upsampler (~8 minutes here)
    python benchmarks/bench_compile.py --quick    # prior only (~2 minutes)

For each stage: the first call of the compiled pipeline (compilation + one run) with an empty
inductor cache ("cold", a fresh temporary TORCHINDUCTOR_CACHE_DIR) and again after
``torch._dynamo.reset()`` with the cache filled ("warm", what a second process would pay); then
eager vs compiled stage calls in alternating rounds, medians over ``--repeats`` (speedup: median of
per-round ratios); break-even = compile overhead ÷ per-step saving, in steps; and the max abs
difference of the compiled stage's output from eager's.
"""

from __future__ import annotations

import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="unclip-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
    _CACHE  # before torch is imported: a cold cache for this run
)

import argparse  # noqa: E402
import copy  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import common  # noqa: E402
import models  # noqa: E402
import torch  # noqa: E402

PROMPTS = ["a red circle to the left of a blue square"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the prior only (about 2 minutes)")
    parser.add_argument(
        "--stages", nargs="*", default=None, choices=("prior", "decoder", "upsampler")
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be >= 3")
    stages = args.stages or (["prior"] if args.quick else ["prior", "decoder", "upsampler"])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {
        "machine": common.machine(),
        "args": vars(args),
        "torch_compile": "default (inductor, mode=None)",
    }
    common.log("machine:", common.machine_line(result["machine"]))

    pipe = models.mid_pipeline()
    steps = {"prior": 25, "decoder": 6, "upsampler": 4}
    sampling, stage_fn, _ = common.stage_runners(pipe, PROMPTS, steps)

    rows = []
    try:
        for stage in stages:
            common.log(f"[compile] {stage}: cold compile")
            eager = stage_fn(pipe, stage)
            compiled_pipe = copy.deepcopy(pipe).compile()
            compiled = stage_fn(compiled_pipe, stage)
            t_eager_first, ref = common.timed(eager)
            t_cold, out = common.timed(compiled)
            common.log(f"[compile] {stage}: cold {t_cold:.0f} s; timing eager vs compiled")
            times = common.interleaved(
                {"eager": eager, "compiled": compiled}, args.repeats, warmup=1
            )
            torch._dynamo.reset()
            warm_pipe = copy.deepcopy(pipe).compile()
            t_warm, _ = common.timed(stage_fn(warm_pipe, stage))
            e, c = common.median(times["eager"]), common.median(times["compiled"])
            per_step_saving = (e - c) / steps[stage]
            overhead_cold, overhead_warm = t_cold - c, t_warm - c
            rows.append(
                {
                    "stage": stage,
                    "steps": steps[stage],
                    "eager_s": e,
                    "compiled_s": c,
                    "speedup": common.paired_ratio(times["eager"], times["compiled"]),
                    "eager_per_step_s": e / steps[stage],
                    "compiled_per_step_s": c / steps[stage],
                    "first_call_cold_s": t_cold,
                    "first_call_warm_cache_s": t_warm,
                    "compile_overhead_cold_s": overhead_cold,
                    "compile_overhead_warm_s": overhead_warm,
                    "break_even_steps_cold": overhead_cold / per_step_saving
                    if per_step_saving > 0
                    else None,
                    "break_even_steps_warm": overhead_warm / per_step_saving
                    if per_step_saving > 0
                    else None,
                    "max_abs_diff": float((out.float() - ref.float()).abs().max()),
                    "raw": times,
                }
            )
            del compiled_pipe, warm_pipe
            torch._dynamo.reset()
    finally:
        shutil.rmtree(_CACHE, ignore_errors=True)
    result["rows"] = rows
    return common.finish("bench_compile", result, started, report)


def report(r: dict) -> str:
    columns = [
        ("stage", "stage"),
        ("steps", "steps"),
        ("eager s", "eager_s"),
        ("compiled s", "compiled_s"),
        ("speedup", "speedup"),
        ("first call, cold cache s", "first_call_cold_s"),
        ("first call, warm cache s", "first_call_warm_cache_s"),
        ("break-even steps (cold)", "break_even_steps_cold"),
        ("break-even steps (warm)", "break_even_steps_warm"),
        ("max abs diff", "max_abs_diff"),
    ]
    title = f"torch.compile on the mid model (median of {r['args']['repeats']}, 1 image)"
    return f"machine: {common.machine_line(r['machine'])}\n" + common.table(
        r["rows"], columns, title
    )


if __name__ == "__main__":
    raise SystemExit(main())
