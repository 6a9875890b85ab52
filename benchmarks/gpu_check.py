"""One prepared check of every CUDA path of the library, sized for one H200 in at most 8 minutes.

Everything the full-scale docs claim about GPUs was proven on fake CUDA tensors and CPU numerics;
this script is the first meeting with real kernels. Each section runs the project's own training
and sampling code, is time-boxed and failure-isolated (a section that fails or runs out of time
records its error and what it had measured, and the next one starts), and the whole run has a
global deadline. The report (``gpu_check.json`` + ``gpu_check.md``) is rewritten after every
section, so a run killed from outside still leaves everything finished before it (a SIGTERM, as
``timeout`` sends, also writes the section it interrupted).

    bash benchmarks/gpu_check.sh OUT_DIR                # on the GPU machine: wheels, then this
    python benchmarks/gpu_check.py --out OUT_DIR        # the same, packages already installed
    python benchmarks/gpu_check.py --cpu --out OUT_DIR  # smoke mode: CPU, tiny sizes, 2.5-4.5 min

docs/gpu_check.md says how to run it on a lent H200 and what each section measures.

Sections, in run order (``--only NAME ...`` runs a subset): ``env`` (versions, measured bf16
matmul rate), ``gpu_configs`` (every GPU-size network built from the GPU mode's own configs on the
meta device), ``attention`` (the SDPA back-end each network ran and its numerics against fp32),
``train`` (every stage's real training run in fp16 with the scaler and in bf16: accumulation,
clipping, EMA, checkpoints, a SIGKILLed run resumed bit-identically), ``memory`` (a real step's
peak against ``unclip plan``), ``full_decoder`` (the 3.5B decoder's bf16 step: s/sample, MFU, days
on 8 × A100), ``fsdp`` (FSDP2 on one GPU process, then two), ``sampling`` (the bundled model, a
Karlo-size random cascade against diffusers' ``UnCLIPPipeline`` at equal precision), ``tokens``
(DALL-E and Mega sampling with and without the KV cache), ``compile`` (``pipe.compile()`` and its
compile time), ``cuda_graphs`` (the same with ``mode="reduce-overhead"``). ``unclip plan``'s
fake-tensor steps, which take minutes of CPU, run in a background process from the start and the
``memory`` and ``full_decoder`` sections collect them.

``--cpu`` runs the same code paths on the CPU at tiny sizes (fake CUDA tensors where the plan is
concerned), so the script is exercised by the test suite between GPU loans
(``tests/test_gpu_check.py`` runs the driver on a few sections). What only a GPU can show (the
fp16 loss scaler, NCCL, the fused attention back-ends, the CUDA allocator's peak, utilisation,
CUDA graphs) is recorded there as ``skipped: needs CUDA``, never as a figure: every number in a
smoke report is a CPU number. The exit status is 0 when every section ended ``ok`` or
``skipped``, 1 otherwise."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check_train import Skipped, end_children  # noqa: E402 - needs the path above


class SectionTimeout(BaseException):
    """A section ran past its time box (raised in the main thread by an interval timer). Not an
    ``Exception``, so that a section's own ``except Exception`` (one network's failure is its
    row) cannot swallow it and run on past the box."""


class Terminated(BaseException):
    """The run was asked to stop (SIGTERM): the report is written with the section it stopped."""


@dataclass
class Check:
    """What every section gets: the mode, where to write, the device, the clock."""

    cpu: bool
    out: Path
    work: Path  # scratch space for runs and exported folders (removed at the end)
    deadline: float  # time.perf_counter() value after which no section starts
    networks: tuple[str, ...] = ()  # the train section's networks (empty: all)
    shared: dict = field(default_factory=dict)  # figures one section measures for another

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.cpu else "cuda")

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        """Wait for the GPU's queued kernels, so that a wall clock read next times them."""
        if not self.cpu:
            import torch

            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object]) -> tuple[float, object]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out


@dataclass(frozen=True)
class Section:
    """One section: its function (``fn(check, result_dict)``, or its name in ``module``) and its
    time boxes in seconds on the GPU and in the smoke mode."""

    module: Optional[str]
    function: Union[str, Callable]
    gpu_s: float
    cpu_s: float

    def resolve(self) -> Callable:
        if callable(self.function):
            return self.function
        if self.module is None:
            return globals()[self.function]
        return getattr(__import__(self.module), self.function)


@contextlib.contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread after ``seconds``. A Python-level loop
    stops at its next bytecode; a call blocked in a kernel stops when the kernel returns (the
    wrapper's ``timeout`` is the hard limit)."""

    def expire(signum, frame):
        raise SectionTimeout(f"ran past its {seconds:.0f} s time box")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def clean(obj):
    """JSON-safe: non-finite floats become strings (``"nan"``, ``"inf"``), so that a reader sees
    them as what they are rather than as numbers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def run_section(check: Check, report: dict, name: str, fn, budget: float) -> None:
    """Run one section inside its time box; its result dict is filled as it goes, so a section
    that fails or times out keeps what it measured. Status: ``ok``, ``error`` (it raised, or a
    row of its tables holds an error), ``timeout``,
    ``skipped`` (the global deadline left too little, or the section cannot run here, e.g. it
    needs CUDA) or ``terminated`` (SIGTERM; re-raised after recording)."""
    entry: dict = {"status": "running", "budget_s": budget, "result": {}}
    report["sections"][name] = entry
    left = check.left()
    if left < min(budget, 20):
        entry.update(status="skipped", seconds=0.0, error=f"global deadline: {left:.0f} s left")
        return
    box = min(budget, left)
    t0 = time.perf_counter()
    print(f"[gpu_check] {name} (time box {box:.0f} s)", flush=True)
    try:
        with time_box(box):
            fn(check, entry["result"])
        failed = failed_rows(entry["result"])
        if failed:
            entry.update(status="error", error=f"{len(failed)} rows failed; first: {failed[0]}")
        else:
            entry["status"] = "ok"
    except SectionTimeout as e:
        entry.update(status="timeout", error=str(e))
    except Skipped as e:
        entry.update(status="skipped", error=str(e))
    except Terminated:
        entry.update(status="terminated", error="SIGTERM while this section ran")
        entry["seconds"] = time.perf_counter() - t0
        raise
    except Exception as e:  # a section's failure is a finding, not the end of the run
        entry.update(
            status="error",
            error=f"{type(e).__name__}: {e}"[:2000],
            traceback=traceback.format_exc()[-4000:],
        )
    finally:
        end_children()  # a section stopped early leaves no process of its own running
    entry["seconds"] = time.perf_counter() - t0
    print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)
    release_memory(check)


def failed_rows(result: dict) -> list[str]:
    """The rows of a section's tables that hold an ``error``: a section that records one
    network's failure as its row and goes on to the next has not passed."""
    return [
        f"{key}[{i}]: {row['error']}"[:300]
        for key, rows in result.items()
        if isinstance(rows, list)
        for i, row in enumerate(rows)
        if isinstance(row, dict) and "error" in row
    ]


def release_memory(check: Check) -> None:
    """Free what a section left (its models die with its frames) so the next one measures its
    own memory."""
    gc.collect()
    if not check.cpu:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------------- the report
def write_report(check: Check, report: dict) -> None:
    report["wall_s"] = time.perf_counter() - report["_t0"]
    data = clean({k: v for k, v in report.items() if not k.startswith("_")})
    (check.out / "gpu_check.json").write_text(json.dumps(data, indent=2) + "\n")
    (check.out / "gpu_check.md").write_text(markdown(data))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:120]
    return str(v).replace("|", "/").replace("\n", " ")[:160]


def markdown(data: dict) -> str:
    """The report as Markdown: a summary table of the sections, then each section's scalars as
    a list and its lists of rows as tables."""
    lines = [
        f"# GPU check ({data['mode']})",
        "",
        f"Device: {data['machine'].get('device', '-')}; torch {data['machine'].get('torch')}; "
        f"wall {data['wall_s']:.0f} s of a {data['deadline_s']:.0f} s deadline.",
        "",
        "| section | status | seconds | error |",
        "| --- | --- | ---: | --- |",
    ]
    for name, s in data["sections"].items():
        err = _cell(s.get("error", ""))
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', 0):.1f} | {err} |")
    for name, s in data["sections"].items():
        lines += ["", f"## {name}: {s['status']}", ""]
        rows = {k: v for k, v in s["result"].items() if isinstance(v, list) and v}
        for k, v in s["result"].items():
            if k not in rows:
                lines.append(f"- {k}: {_cell(v)}")
        for k, v in rows.items():
            if not all(isinstance(r, dict) for r in v):
                lines.append(f"- {k}: {_cell(v)}")
                continue
            cols = list(dict.fromkeys(c for r in v for c in r))
            lines += ["", f"### {k}", "", "| " + " | ".join(cols) + " |"]
            lines.append("| " + " | ".join("---" for _ in cols) + " |")
            lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in v]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ environment
def section_env(check: Check, rec: dict) -> None:
    """Versions, the device, and the bf16 matmul rate measured here (the MFU's denominator)."""
    import importlib.metadata as md

    import torch

    for pkg in ("diffusers", "open_clip_torch", "accelerate", "transformers", "xformers"):
        try:
            rec[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            rec[pkg] = "not installed"
    if check.cpu:
        from common import matmul_peak

        peak = matmul_peak(torch.bfloat16, n=512, repeats=3)
        rec["bf16_matmul_tflops"] = peak["tflops"]  # the CPU's: no GPU figure derives from it
        rec["sdpa_flash_available"] = rec["cudnn"] = "skipped: needs CUDA"
    else:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        seconds, _ = check.timed(lambda: [a @ b for _ in range(10)])
        rec["bf16_matmul_tflops"] = 10 * 2 * n**3 / seconds / 1e12
        rec["sdpa_flash_available"] = bool(torch.backends.cuda.flash_sdp_enabled())
        rec["cudnn"] = torch.backends.cudnn.version()
    check.shared["peak_flops"] = rec["bf16_matmul_tflops"] * 1e12


def machine(check: Check) -> dict:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    if check.cpu:
        info["device"] = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    else:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            memory_GiB=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


# ------------------------------------------------------------------------------------------- main
#: the sections in run order: the cheap, widest checks first, the long ones where a cut costs
#: least last. The GPU's boxes add up to more than the deadline on purpose: most sections end well
#: inside theirs, and the deadline cuts the last ones when they do not. The smoke mode's boxes are
#: about three times what the sections take on a 2-core CPU.
SECTIONS = {
    "env": Section(None, "section_env", 20, 30),
    "gpu_configs": Section("gpu_check_scale", "section_gpu_configs", 20, 60),
    "attention": Section("gpu_check_sample", "section_attention", 30, 60),
    "train": Section("gpu_check_train", "section_train", 150, 240),
    "memory": Section("gpu_check_scale", "section_memory", 40, 120),
    "full_decoder": Section("gpu_check_scale", "section_full_decoder", 70, 120),
    "fsdp": Section("gpu_check_scale", "section_fsdp", 60, 150),
    "sampling": Section("gpu_check_sample", "section_sampling", 90, 120),
    "tokens": Section("gpu_check_sample", "section_tokens", 25, 60),
    "compile": Section("gpu_check_sample", "section_compile", 60, 120),
    "cuda_graphs": Section("gpu_check_sample", "section_cuda_graphs", 45, 30),
}
#: the sections whose work runs in processes forked from the server that preloads the training
#: code (the background plans included)
FORKING = {"train", "fsdp", "memory", "full_decoder"}


def main(argv=None, sections: Optional[dict[str, Section]] = None) -> int:
    """Run the check; ``sections`` replaces :data:`SECTIONS` (same form, run in its order)."""
    sections = SECTIONS if sections is None else sections
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--cpu", action="store_true", help="smoke mode: CPU, tiny sizes")
    p.add_argument(
        "--deadline", type=float, default=None, help="global seconds (default 440; --cpu 600)"
    )
    p.add_argument("--only", nargs="+", choices=list(sections), help="run only these sections")
    p.add_argument(
        "--networks",
        nargs="+",
        default=[],
        help="the train section's networks (default all; a token model brings its tokenizer)",
    )
    args = p.parse_args(argv)
    if args.cpu:
        # no GPU even where there is one: the smoke mode must mean the same on every machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if args.cpu:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the smoke mode")
    if args.networks:
        from gpu_check_train import SPEC

        unknown = sorted(set(args.networks) - set(SPEC))
        if unknown:
            p.error(f"unknown networks {unknown}; known: {sorted(SPEC)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = args.deadline or (600.0 if args.cpu else 440.0)
    t0 = time.perf_counter()
    selected = [n for n in sections if not args.only or n in args.only]

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    status = 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        check = Check(
            cpu=args.cpu,
            out=out,
            work=Path(work),
            deadline=t0 + deadline,
            networks=tuple(args.networks),
        )
        report = {
            "_t0": t0,
            "mode": "cpu smoke" if args.cpu else "gpu",
            "deadline_s": deadline,
            "machine": machine(check),
            "sections": {},
        }
        try:
            if FORKING & set(selected):
                from multiprocessing import forkserver as server

                from gpu_check_train import forkserver, preload_for

                # the server imports the training code while this process does
                forkserver(preload_for(selected, check.networks))
                server.ensure_running()
            # the library's imports (seconds) are the run's, not the first section's
            t_import = time.perf_counter()
            import unclip.train.loop  # noqa: F401

            report["import_s"] = time.perf_counter() - t_import
            if {"memory", "full_decoder"} & set(selected):
                from gpu_check_scale import start_plans

                start_plans(check, selected)  # the first fork waits for the server's imports
            for name in selected:
                section = sections[name]
                budget = section.cpu_s if args.cpu else section.gpu_s
                run_section(check, report, name, section.resolve(), budget)
                write_report(check, report)
                if report["sections"][name]["status"] not in ("ok", "skipped"):
                    status = 1
        except Terminated:
            status = 128 + signal.SIGTERM
        finally:
            end_children(everything=True)
            signal.signal(signal.SIGTERM, previous)
            write_report(check, report)
    print(f"wrote {out / 'gpu_check.json'} and gpu_check.md ({time.perf_counter() - t0:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
