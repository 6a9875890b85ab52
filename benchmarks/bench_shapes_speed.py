"""Seconds per image of the bundled shapes model, per stage, at its defaults and at other settings.

    python benchmarks/bench_shapes_speed.py                 # results/bench_shapes_speed.json
    python benchmarks/bench_shapes_speed.py --quick         # 4 images, 1 round
    python benchmarks/bench_shapes_speed.py --variant fast='{"decoder": {"steps": 10}}'
    python benchmarks/bench_shapes_speed.py --threads 2     # both cores of a 2-core machine

Images are sampled as the evaluator samples them (held-out prompts, half single-object and half
two-object, one generator per image) in batches of ``--batch`` (16: the figure docs/shapes_model.md
quotes), every variant once per round in alternating order (after one untimed call each), in fp32
with the default layout, in fp32 channels-last (the networks' activations NHWC) and at the loaded
pipeline's defaults (``defaults``: channels-last and ``autocast_dtype="auto"``, i.e. bf16 autocast
on a CPU that runs it natively, as the JSON's ``autocast_dtype`` records; ``--no-channels-last``:
fp32 NCHW only); the figure is the median over rounds of seconds per image, per stage and end to
end. ``--cli`` also times the README's first command (four images,
including starting Python and loading the model) as a subprocess. Quality at the same settings is
measured by ``unclip shapes-eval --sampling`` (docs/shapes_model.md); this script measures time
only. A run is stored under key ``default`` of ``results/bench_shapes_speed.json``; ``--out
bench_shapes_speed:KEY`` stores it under another key beside the earlier runs (common.write_json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common
import torch

from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.shapes.evaluate import heldout_samples
from unclip.utils.precision import dtype_name

README_COMMAND = ["generate", "a small red circle on the left", "--num-images", "4", "--seed", "0"]


def sample(pipe, captions, sampling) -> dict[str, float]:
    """One batch; the pipeline's per-stage seconds plus the whole call's, per image."""
    gens = [torch.Generator().manual_seed(i) for i in range(len(captions))]
    t0 = time.perf_counter()
    out = pipe(captions, generator=gens, sampling=sampling, output_type="pt", progress=False)
    total = time.perf_counter() - t0
    per = {k: v / len(captions) for k, v in out.timings.items()}
    per["end_to_end"] = total / len(captions)
    return per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the bundled model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="sampling overrides per stage to time beside the defaults (repeatable)",
    )
    p.add_argument("--no-channels-last", action="store_true", help="fp32 NCHW only")
    p.add_argument("--cli", action="store_true", help="also time the README's first command")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for sampling and for the --cli command (default: torch's, i.e. "
        "OMP_NUM_THREADS or every core); the JSON's machine.threads records it",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench_shapes_speed:default")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.rounds = 4, 1
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    settings = {"defaults": None}
    for v in args.variant:
        name, _, text = v.partition("=")
        try:
            settings[name] = json.loads(text)
        except json.JSONDecodeError as exc:
            p.error(f"--variant {v!r}: the part after '=' must be JSON ({exc})")
    if args.quick and args.out == "bench_shapes_speed:default":
        args.out = "bench_shapes_speed_quick"
    pipe = UnCLIPPipeline.from_pretrained(args.model, autocast_dtype=None, memory_format=None)
    for name, sampling in settings.items():
        try:
            pipe.sampling_settings(sampling)
        except (TypeError, ValueError) as exc:
            p.error(f"--variant {name}: {exc}")
    samples = heldout_samples(args.batch // 2 + args.batch % 2)
    half = args.batch // 2
    captions = [s.caption for s in samples[: args.batch - half]]
    captions += [s.caption for s in samples[len(samples) // 2 :][:half]]
    # (label, autocast setting, memory format)
    formats = [("nchw", None, torch.contiguous_format)]
    if not args.no_channels_last:
        formats.append(("channels_last", None, torch.channels_last))
        formats.append(("defaults", "auto", torch.channels_last))
    runs = {
        f"{name}/{fmt}": (sampling, ac, mf)
        for name, sampling in settings.items()
        for fmt, ac, mf in formats
    }
    times: dict[str, list[dict]] = {k: [] for k in runs}
    common.log(f"{len(runs)} variants x {args.rounds} rounds, batch {args.batch}")
    for sampling, ac, mf in runs.values():  # warm-up: schedulers, layouts, allocations
        pipe.to(memory_format=mf)
        pipe.autocast_dtype = ac
        sample(pipe, captions[:2], sampling)
    for i in range(args.rounds):
        for key in common.rounds_order(list(runs), i):
            sampling, ac, mf = runs[key]
            pipe.to(memory_format=mf)
            pipe.autocast_dtype = ac
            times[key].append(sample(pipe, captions, sampling))
            common.log(f"round {i} {key}: {times[key][-1]['end_to_end']:.3f} s/image")
    pipe.to(memory_format=torch.contiguous_format)
    pipe.autocast_dtype = "auto"
    autocast = pipe.autocast_dtype  # what the defaults resolved to on this machine
    pipe.autocast_dtype = None
    table = {
        key: {stage: round(common.median([r[stage] for r in rs]), 4) for stage in rs[0]}
        for key, rs in times.items()
    }
    result = {
        "machine": common.machine(),
        "batch": args.batch,
        "rounds": args.rounds,
        "variants": dict(settings),
        "autocast_dtype": dtype_name(autocast),
        "sampling_defaults": {k: vars(v) for k, v in pipe.sampling_settings(None).items()},
        "seconds_per_image_median": table,
        "per_round": times,
    }
    if args.cli:
        walls = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                cmd = [sys.executable, "-m", "unclip.cli", *README_COMMAND, "--out", tmp]
                if args.model:
                    cmd += ["--model", args.model]
                env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                walls.append(time.perf_counter() - t0)
        result["readme_command_seconds"] = {"median": round(common.median(walls), 2), "runs": walls}
    print(f"{'variant':32s} " + " ".join(f"{s:>10s}" for s in next(iter(table.values()))))
    for key, row in table.items():
        print(f"{key:32s} " + " ".join(f"{v:10.3f}" for v in row.values()))
    if args.cli:
        wall = result["readme_command_seconds"]["median"]
        print(f"README command (4 images, with loading): {wall} s")
    path = common.write_json(args.out, result)
    common.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
