"""Shared helpers for the benchmark scripts: machine description, timing, configs, JSON output.

Not part of the library; imported by ``benchmarks/bench_*.py`` (run as ``python
benchmarks/<name>.py``) and by the studies in ``experiments/`` (which point :data:`RESULTS` at their
own folder).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from unclip.utils.precision import dtype_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# the captions of the training benchmarks' fixed batches (shapes-world phrasing)
CAPTIONS = [
    "a small red circle on the left",
    "a big blue square in the center",
    "a green triangle at the top",
    "a red circle to the left of a green triangle",
    "a yellow star",
    "two blue squares",
]


def fp32_pipeline(model=None):
    """A trained pipeline (``model``: a folder, default the bundled shapes model) in full
    precision and the default memory layout, which the benchmarks that study something else (a
    sampler, a prior, editing, adapters) measure on, so that their figures do not depend on
    whether the CPU runs bf16 natively. The loaded defaults (bf16 autocast where native,
    channels-last) are measured in bench_sampling.py and bench_shapes_speed.py."""
    from unclip.pipeline.pipeline import UnCLIPPipeline

    return UnCLIPPipeline.from_pretrained(model, autocast_dtype=None, memory_format=None)


def captions(n: int) -> list[str]:
    """``n`` captions for a benchmark batch: :data:`CAPTIONS` over and over."""
    return [CAPTIONS[i % len(CAPTIONS)] for i in range(n)]


# ------------------------------------------------------------------------------------------ machine
def machine() -> dict:
    """CPU model, cores, ISA flags that matter for torch on CPU, library versions, load at start."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        flags = set(fields.get("Flags", "").split())
        info.update(
            {
                "cpu": fields.get("Model name"),
                "sockets": fields.get("Socket(s)"),
                "cores_per_socket": fields.get("Core(s) per socket"),
                "threads_per_core": fields.get("Thread(s) per core"),
                "l2": fields.get("L2 cache"),
                "l3": fields.get("L3 cache"),
                "hypervisor": fields.get("Hypervisor vendor"),
                "isa": sorted(
                    f
                    for f in flags
                    if f
                    in {
                        "avx2",
                        "fma",
                        "avx512f",
                        "avx512_bf16",
                        "avx512_vnni",
                        "amx_bf16",
                        "amx_tile",
                        "avx_vnni",
                    }
                ),
            }
        )
    except (OSError, subprocess.CalledProcessError):
        info["cpu"] = platform.processor()
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    info["mkldnn_bf16"] = bool(torch.backends.mkldnn.is_available()) and "avx512_bf16" in info.get(
        "isa", []
    )
    return info


def machine_line(m: dict) -> str:
    return (
        f"{m.get('cpu')} ({m.get('cpus')} vCPU, {m.get('threads')} torch threads; "
        f"{', '.join(m.get('isa', []))}), torch {m.get('torch')}, diffusers "
        f"{m.get('diffusers', '-')}, load average at start {m.get('loadavg_at_start')}"
    )


# ------------------------------------------------------------------------------------------ timing
def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs):
    return float(statistics.median(xs))


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]`` (timings taken back to back in the same round)."""
    return median([x / y for x, y in zip(a, b)])


def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Time each variant ``repeats`` times in rounds (A B C, then C B A, ...) after ``warmup``
    untimed rounds.

    Interleaving makes slow drifts of a shared machine's load hit every variant alike, and
    alternating the order within rounds cancels any advantage of running first or last in a round.
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times = {k: [] for k in variants}
    for i in range(repeats):
        for k in rounds_order(list(variants), i):
            times[k].append(timed(variants[k])[0])
    return times


def rounds_order(names: list, i: int) -> list:
    """Round ``i``'s order: as given on even rounds, reversed on odd ones."""
    return names if i % 2 == 0 else names[::-1]


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 7) -> dict:
    """Median achieved TFLOP/s of ``n×n @ n×n`` matmuls in ``dtype`` (2·n³ FLOPs each), and the
    share of one CPU per thread the process got meanwhile (below 1: other processes took the
    rest)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    ts, cpu0 = [], time.process_time()
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    share = (time.process_time() - cpu0) / sum(ts) / torch.get_num_threads()
    med = median(ts)
    return {
        "dtype": dtype_name(dtype),
        "n": n,
        "median_s": med,
        "tflops": 2 * n**3 / med / 1e12,
        "best_tflops": 2 * n**3 / min(ts) / 1e12,
        "cpu_share": share,
    }


def flop_counter():
    """``FlopCounterMode`` that also counts PyTorch's CPU SDPA kernels (the stock table only knows
    the CUDA flash/efficient/cuDNN ones, so attention on CPU would count as zero)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    return FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd,
        },
    )


def conv_peak(dtype: torch.dtype = torch.float32, repeats: int = 7) -> dict:
    """Median achieved TFLOP/s of a 3×3 convolution 256→256 channels on ``[8, 256, 32, 32]``
    (oneDNN), a second reference: on AMD CPUs MKL's fp32 GEMM runs well below oneDNN's AVX-512
    convolutions."""
    x = torch.randn(8, 256, 32, 32).to(dtype)
    w = torch.randn(256, 256, 3, 3).to(dtype)
    flops = 2 * 8 * 256 * 256 * 9 * 32 * 32
    torch.nn.functional.conv2d(x, w, padding=1)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.conv2d(x, w, padding=1)
        ts.append(time.perf_counter() - t0)
    med = median(ts)
    return {
        "dtype": dtype_name(dtype),
        "median_s": med,
        "tflops": flops / med / 1e12,
        "best_tflops": flops / min(ts) / 1e12,
    }


# ------------------------------------------------------------------------------------------ output
def write_json(name: str, data: dict) -> Path:
    """Write ``data`` as ``RESULTS/<name>.json``. A ``name`` of the form ``FILE:KEY`` stores it
    under ``KEY`` of ``RESULTS/FILE.json`` instead, keeping the file's other keys: one benchmark's
    runs with different settings side by side in one file, named by what differs."""
    file, _, key = name.partition(":")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{file}.json"
    if key:
        runs = json.loads(path.read_text()) if path.exists() else {}
        if "machine" in runs:
            raise SystemExit(f"{path} holds a single run, not runs by key: write to another name")
        runs[key] = data
        data = runs
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def finish(name: str, result: dict, started: float, report) -> int:
    """Record the wall time since ``started``, write ``result`` as ``results/<name>.json`` (or
    under a key, see :func:`write_json`) and print ``report(result)`` and where the JSON went;
    returns the exit status 0."""
    result["wall_seconds"] = time.perf_counter() - started
    path = write_json(name, result)
    print(report(result))
    print(f"\nwrote {path} ({result['wall_seconds']:.0f} s)")
    return 0


def table(rows: list[dict], columns: list[tuple[str, str]], title: str = "") -> str:
    """A GitHub-markdown table (printed to the console and pasted into the README)."""
    head = "| " + " | ".join(h for h, _ in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = []
    for r in rows:
        cells = []
        for _, key in columns:
            v = r.get(key, "")
            if isinstance(v, float):
                v = f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
            cells.append(str(v))
        body.append("| " + " | ".join(cells) + " |")
    text = "\n".join([head, sep, *body])
    return (f"\n### {title}\n\n" if title else "\n") + text + "\n"


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def stage_runners(pipe, prompts: list, steps: dict):
    """``(sampling, stage_fn, inputs)`` for timing each stage alone: the stage inputs ``inputs``
    (text encoding, image embeddings, base images) are computed once with seed 0, and ``stage_fn(p,
    stage)`` returns a zero-argument callable that runs ``stage``
    (``prior``/``decoder``/``upsampler``) of pipeline ``p``."""
    sampling = {
        "prior": {"steps": steps["prior"]},
        "decoder": {"steps": steps["decoder"]},
        "upsampler": {"steps": steps["upsampler"]},
    }
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    text = pipe.encode_text(prompts)
    embeds = pipe.sample_image_embeds(text, generator=g(), sampling=sampling, progress=False)
    small = pipe.decode(embeds, text, generator=g(), sampling=sampling, progress=False)

    def stage_fn(p, stage):
        if stage == "prior":
            return lambda: p.sample_image_embeds(
                text, generator=g(), sampling=sampling, progress=False
            )
        if stage == "decoder":
            return lambda: p.decode(embeds, text, generator=g(), sampling=sampling, progress=False)
        return lambda: p.upsample(small, generator=g(), sampling=sampling, progress=False)

    return sampling, stage_fn, {"text": text, "embeds": embeds, "small": small}


def profile_top(step: Callable[[], object], top: int) -> dict:
    """One call of ``step`` under ``torch.profiler`` (CPU): its wall seconds, the total self CPU
    milliseconds and the ``top`` operators by self CPU time (share of the total, calls)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall = time.perf_counter() - t0
    events = list(prof.key_averages())
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "wall_s_profiled": wall,
        "self_cpu_ms_total": total / 1e3,
        "top": [
            {
                "op": e.key,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in events[:top]
        ],
    }
