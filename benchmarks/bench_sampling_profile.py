"""Where sampling time goes: the mid model's stages under torch.profiler, top operators per stage.

    python benchmarks/bench_sampling_profile.py           # about 2 minutes
    python benchmarks/bench_sampling_profile.py --quick   # fewer steps

The mid-size model of ``bench_sampling.py`` (its headline comparison with diffusers'
``UnCLIPPipeline``) samples one image at diffusers' default settings (prior 25 steps × guidance 4,
decoder 25 × 8, super-res 7, ``UnCLIPScheduler``), one thread, fp32: text encoding, prior, decoder
and upsampler are each run once untimed (warm-up) and once under ``torch.profiler``, through the
pipeline's stage methods (``encode_text``, ``sample_image_embeds``, ``decode``, ``upsample``).
Reported per stage: wall seconds, the share of the whole call, and the operators with the most
self CPU time. Then the same where the CPU runs bf16 natively under bf16 autocast
(``pipe.autocast_dtype = torch.bfloat16``, NCHW: what diffusers' networks under autocast run),
with the decoder and upsampler in channels-last (``pipe.to(memory_format=torch.channels_last)``,
the CPU speed option that applies on every machine), and both (autocast ``"auto"`` and
channels-last).

Writes ``benchmarks/results/bench_sampling_profile.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import models
import torch

from unclip.utils.precision import dtype_name

PROMPT = "a red circle to the left of a blue square"


def profile(fn, top: int) -> dict:
    fn()  # warm-up: oneDNN primitives, allocator
    return common.profile_top(fn, top)


def stages(pipe, steps: dict, top: int) -> dict:
    sampling = {k: {"steps": v} for k, v in steps.items()}
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    text = pipe.encode_text([PROMPT])
    embeds = pipe.sample_image_embeds(text, generator=gen(), sampling=sampling, progress=False)
    image = pipe.decode(embeds, text, generator=gen(), sampling=sampling, progress=False)
    out = {
        "text encoding": profile(lambda: pipe.encode_text([PROMPT]), top),
        "prior": profile(
            lambda: pipe.sample_image_embeds(
                text, generator=gen(), sampling=sampling, progress=False
            ),
            top,
        ),
        "decoder": profile(
            lambda: pipe.decode(embeds, text, generator=gen(), sampling=sampling, progress=False),
            top,
        ),
        "upsampler": profile(
            lambda: pipe.upsample(image, generator=gen(), sampling=sampling, progress=False), top
        ),
    }
    total = sum(s["wall_s_profiled"] for s in out.values())
    for s in out.values():
        s["share_of_call"] = s["wall_s_profiled"] / total
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="prior 10, decoder 5, upsampler 3 steps")
    p.add_argument("--top", type=int, default=8, help="operators per stage")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    steps = (
        {"prior": 10, "decoder": 5, "upsampler": 3}
        if args.quick
        else {"prior": 25, "decoder": 25, "upsampler": 7}
    )
    pipe = models.mid_pipeline()
    result = {"machine": common.machine(), "steps": steps, "variants": {}}
    result["variants"]["default"] = stages(pipe, steps, args.top)
    pipe.autocast_dtype = "auto"  # bf16 where the CPU runs it natively, else None
    result["defaults_autocast_dtype"] = dtype_name(pipe.autocast_dtype)
    if pipe.autocast_dtype is not None:
        result["variants"]["bf16"] = stages(pipe, steps, args.top)
    pipe.autocast_dtype = None
    pipe.to(memory_format=torch.channels_last)
    result["variants"]["channels_last"] = stages(pipe, steps, args.top)
    pipe.autocast_dtype = "auto"
    if pipe.autocast_dtype is not None:
        result["variants"]["defaults"] = stages(pipe, steps, args.top)
    name = "bench_sampling_profile_quick" if args.quick else "bench_sampling_profile"
    return common.finish(name, result, started, report)


def report(r: dict) -> str:
    out = [f"machine: {common.machine_line(r['machine'])}"]
    default, cl = r["variants"]["default"], r["variants"]["channels_last"]
    fast = r["variants"].get("defaults")
    bf = r["variants"].get("bf16")
    rows = [
        {
            "stage": k,
            "s": v["wall_s_profiled"],
            "share": f"{v['share_of_call']:.1%}",
            "cl_s": cl[k]["wall_s_profiled"],
            "speedup": v["wall_s_profiled"] / cl[k]["wall_s_profiled"],
            **(
                {
                    "b_s": bf[k]["wall_s_profiled"],
                    "b_speedup": v["wall_s_profiled"] / bf[k]["wall_s_profiled"],
                }
                if bf
                else {}
            ),
            **(
                {
                    "d_s": fast[k]["wall_s_profiled"],
                    "d_share": f"{fast[k]['share_of_call']:.1%}",
                    "d_speedup": v["wall_s_profiled"] / fast[k]["wall_s_profiled"],
                }
                if fast
                else {}
            ),
        }
        for k, v in default.items()
    ]
    cols = [
        ("stage", "stage"),
        ("s (profiled)", "s"),
        ("share of the call", "share"),
        ("channels-last s", "cl_s"),
        ("channels-last speedup (one run)", "speedup"),
    ]
    if bf:
        cols += [("bf16 s", "b_s"), ("bf16 speedup (one run)", "b_speedup")]
    if fast:
        cols += [
            ("bf16 + channels-last s", "d_s"),
            ("bf16 + channels-last share", "d_share"),
            (f"{r['defaults_autocast_dtype']} + channels-last speedup (one run)", "d_speedup"),
        ]
    steps = r["steps"]
    out.append(
        common.table(
            rows,
            cols,
            f"mid model, one image, prior {steps['prior']} / decoder {steps['decoder']} / "
            f"super-res {steps['upsampler']} steps, fp32, 1 thread",
        )
    )
    named = (
        ("fp32", default),
        ("bf16 autocast, NCHW", r["variants"].get("bf16", {})),
        ("bf16 autocast, channels-last", fast or {}),
    )
    for variant, stages_ in named:
        for k, v in stages_.items():
            prow = [
                {"op": t["op"], "ms": t["self_cpu_ms"], "share": f"{t['share']:.1%}"}
                for t in v["top"]
            ]
            out.append(
                common.table(
                    prow,
                    [("op", "op"), ("self ms", "ms"), ("share", "share")],
                    f"{k}, {variant}: top ops",
                )
            )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
