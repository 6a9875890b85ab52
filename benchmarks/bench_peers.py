"""Training speed against DALLE2-pytorch (``dalle2_pytorch``), the trainer unCLIP is usually trained
with: one training step of each stage, side by side, at matched parameter counts.

    python benchmarks/bench_peers.py --peers-python /path/to/venv-peers/bin/python
    python benchmarks/bench_peers.py --quick ...   # tiny models, 2 rounds: a smoke run (~1 min)
    python benchmarks/bench_peers.py --stages prior decoder --rounds 7 ...

``dalle2_pytorch`` pins ``open-clip-torch<3``, which this library's CLIP (open_clip 3) cannot
share a process with, so it lives in its own virtualenv (``--peers-python``, or
``UNCLIP_PEERS_PYTHON``; default: this interpreter) layered over the main one (same torch build);
see benchmarks/README.md ("Peers") for the commands. Without it the script prints how to create it
and exits 0.

Per stage (diffusion prior; 64 px base decoder; one upsampler, 64 → 128 px by default,
``--upsampler-size 256`` for the paper's 64 → 256, about 4× slower per step) both libraries build a
model of about the same parameter count (both counts are reported), at the same resolution, batch
and precision (fp32; ``--mixed-precision bf16``: both under bf16 autocast, unclip's
``train.mixed_precision`` and DALLE2's trainers handed ``Accelerator(mixed_precision="bf16")``),
and run one step at a time in their own worker process:

* unclip: its real training code, ``unclip.train.loop.TrainLoop.run_step`` with the stage's task
  (``PriorTask`` / ``DecoderTask`` / ``UpsamplerTask``: condition dropout, noising, the frozen CLIP
  encoding the captions inside the loss, blur + noise-level corruption of the upsampler's input) —
  loss, backward, clipping at 1.0, AdamW, LR schedule, EMA update;
* DALLE2-pytorch: ``DiffusionPriorTrainer`` / ``DecoderTrainer`` — ``loss = trainer(...)`` (loss and
  backward) then ``trainer.update()`` (clipping at 1.0, AdamW, LR schedule, EMA update). Its EMA
  (``ema_pytorch``) is told to update every step (its default is every 10th step after step 100) so
  both do the same work per step. It is fed precomputed CLIP text embeddings and token encodings
  (using its CLIP adapters would download pretrained weights); unclip's step encodes its captions
  with its frozen CLIP, so that time is measured (timer around ``clip.encode_text``) and a second
  ratio leaves it out. The benchmark's batches repeat six captions, so with the prior's caption
  cache (``train.text_cache_mb``, on by default) every encoding after the warm-up round comes from
  the cache; ``--no-text-cache`` measures the step of data whose captions never repeat.

One untimed warm-up round, then ``--rounds`` rounds of one step per library, the order alternating
(A B, B A, ...); the only process computing is the one timing its step. Ratios are medians of the
per-round ratios (``common.paired_ratio``). Memory: each worker's ``ru_maxrss`` (peak RSS) and its
increase over the high-water mark after the model, optimizer, EMA and batch were built (tracemalloc
would miss torch's allocations). Then one more step of each under ``torch.utils.flop_counter``
(FLOPs per sample, and per CPU second of the timed steps) and one under ``torch.profiler``: the
operators with the most self CPU time. The ratio is also computed from each step's CPU seconds,
steadier than wall time when other jobs share the cores.

The two sides' models are built in ``peers_models.py``; the tables and the sweep's plot are
``peers_report.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import common
import torch
from peers_models import LIBS, SETUPS, build_dalle2, build_unclip
from peers_report import plot_sweep, precision_label, report, report_sweep

STAGES = ("prior", "decoder", "upsampler")


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ------------------------------------------------------------------------------------------ worker
def worker(lib: str, stage: str, spec: dict) -> int:
    """One library, one stage: build, then answer the parent's commands (one JSON line each)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries' prints go to the log, not into the protocol
    warnings.filterwarnings("ignore")
    torch.set_num_threads(spec["threads"])

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    rss_start = _maxrss_mb()
    workdir = tempfile.mkdtemp(prefix="bench-peers-")
    try:
        t0 = time.perf_counter()
        built = (build_unclip if lib == "unclip" else build_dalle2)(stage, spec, workdir)
        rss_built = _maxrss_mb()
        send(
            {
                "params": built["params"],
                "config": built["config"],
                "versions": built["versions"],
                "shared": built["shared"],
                "build_s": time.perf_counter() - t0,
                "rss_start_mb": rss_start,
                "rss_built_mb": rss_built,
            }
        )
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "step":
                c0, t0 = time.process_time(), time.perf_counter()
                loss = built["step"]()
                dt = time.perf_counter() - t0
                send(
                    {
                        "s": dt,
                        "cpu_share": (time.process_time() - c0) / dt / spec["threads"],
                        "text_encode_s": built["text_encode_s"](),
                        "loss": float(loss),
                    }
                )
            elif cmd["cmd"] == "memory":
                peak = _maxrss_mb()
                send({"rss_peak_mb": peak, "rss_step_increase_mb": peak - rss_built})
            elif cmd["cmd"] == "profile":
                send(common.profile_top(built["step"], cmd["top"]))
            elif cmd["cmd"] == "flops":  # one more step under the FLOP counter (fwd + bwd)
                with common.flop_counter() as fc:
                    built["step"]()
                ops = fc.get_flop_counts().get("Global", {})
                send({"total": fc.get_total_flops(), "by_op": {str(k): v for k, v in ops.items()}})
            else:
                break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


class Worker:
    def __init__(self, python: str, lib: str, stage: str, spec: dict, log_dir: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        env["MKL_NUM_THREADS"] = str(spec["threads"])
        if lib == "unclip":  # this checkout's unclip, not an installed one
            env["PYTHONPATH"] = os.pathsep.join(
                [str(common.ROOT), *filter(None, [env.get("PYTHONPATH")])]
            )
        self.log = log_dir / f"{stage}-{lib}.log"
        args = [python, __file__, "--worker", lib, stage, json.dumps(spec)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
            text=True, env=env, cwd=common.ROOT,
        )  # fmt: skip
        self.name = f"{lib} {stage}"
        self.info = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"the {self.name} worker failed:\n{tail}")
        return json.loads(line)

    def ask(self, cmd: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait()


# ------------------------------------------------------------------------------------------ parent
def run_stage(
    stage: str, spec: dict, pythons: dict, rounds: int, top: int, log_dir: Path, profile=True
) -> dict:
    workers = {}
    try:
        for lib in LIBS:  # built one after the other: each build has the CPU to itself
            common.log(f"[peers] {stage}: building {lib}")
            workers[lib] = Worker(pythons[lib], lib, stage, spec, log_dir)
            spec = {**spec, **workers[lib].info["shared"]}  # unclip's sizes, for DALLE2
        for lib in LIBS:  # warm-up round, untimed
            workers[lib].ask("step")
        steps = {lib: [] for lib in LIBS}
        for i in range(rounds):
            for lib in common.rounds_order(list(LIBS), i):
                steps[lib].append(workers[lib].ask("step"))
            common.log(
                f"[peers] {stage} round {i + 1}/{rounds}: "
                + ", ".join(f"{lib} {steps[lib][-1]['s']:.3f} s" for lib in LIBS)
            )
        memory = {lib: workers[lib].ask("memory") for lib in LIBS}
        flops = {lib: workers[lib].ask("flops") if profile else None for lib in LIBS}
        profiles = {lib: workers[lib].ask("profile", top=top) if profile else None for lib in LIBS}
    finally:
        for w in workers.values():
            w.close()
    b = spec["batch"]
    out = {"stage": stage, "batch": b, "rounds": rounds}
    if stage == "decoder":
        out["resolution"] = f"{spec['decoder_size']} px"
    elif stage == "upsampler":
        out["resolution"] = "{} → {} px".format(*spec["upsampler_sizes"])
    else:
        out["resolution"] = "-"
    for lib in LIBS:
        s = [x["s"] for x in steps[lib]]
        out[lib] = {
            **workers[lib].info,
            **memory[lib],
            "step_s": s,
            "text_encode_s": [x["text_encode_s"] for x in steps[lib]],
            "cpu_share": [x["cpu_share"] for x in steps[lib]],
            "loss": [x["loss"] for x in steps[lib]],
            "median_step_s": common.median(s),
            "samples_per_s": b / common.median(s),
            "profile": profiles[lib],
            "flops_per_step": flops[lib],
        }
        if flops[lib] is not None:
            cpu_s = common.median(
                [x * c * spec["threads"] for x, c in zip(s, out[lib]["cpu_share"])]
            )
            out[lib]["gflop_per_sample"] = flops[lib]["total"] / b / 1e9
            out[lib]["gflop_per_cpu_s"] = flops[lib]["total"] / cpu_s / 1e9
    u, d = out["unclip"]["step_s"], out["dalle2"]["step_s"]
    u_net = [x - c for x, c in zip(u, out["unclip"]["text_encode_s"])]
    # speed ratio: > 1 means unclip trains faster (DALLE2 seconds ÷ unclip seconds, per round)
    out["speed_ratio"] = common.paired_ratio(d, u)
    out["speed_ratio_of_medians"] = common.median(d) / common.median(u)
    # the same from each step's CPU seconds: steadier than wall time when other jobs share the
    # cores (a step that is descheduled waits without computing)
    cpu = {lib: [x * c for x, c in zip(out[lib]["step_s"], out[lib]["cpu_share"])] for lib in LIBS}
    out["speed_ratio_cpu_time"] = common.paired_ratio(cpu["dalle2"], cpu["unclip"])
    out["speed_ratio_without_text_encoding"] = common.paired_ratio(d, u_net)
    out["unclip_text_encode_share"] = common.median(
        [c / x for x, c in zip(u, out["unclip"]["text_encode_s"])]
    )
    out["param_difference"] = out["dalle2"]["params"] / out["unclip"]["params"] - 1
    return out


def skip_message(python: str, detail: str) -> str:
    return (
        f"bench_peers: skipped — dalle2_pytorch cannot be imported by {python} ({detail}).\n"
        "Create its environment (it pins open-clip-torch<3, so not in the main one) and pass it:\n"
        "    python -m venv venv-peers\n"
        "    python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\" \\\n"
        "        > venv-peers/lib/python3.11/site-packages/_main_env.pth   # reuse torch etc.\n"
        "    venv-peers/bin/pip install dalle2-pytorch\n"
        "    python benchmarks/bench_peers.py --peers-python venv-peers/bin/python [--quick]\n"
        "(see benchmarks/README.md, section Peers)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds (~1 minute)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 5; quick 2)"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--upsampler-size",
        type=int,
        default=None,
        help="the upsampler's output size (default 128 from 64; quick: 32 from 16)",
    )
    parser.add_argument("--top", type=int, default=10, help="profiler rows per library")
    parser.add_argument(
        "--no-text-cache",
        action="store_true",
        help="unclip's prior encodes every caption (train.text_cache_mb=0), as for data whose "
        "captions never repeat",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "auto", "bf16"),
        default="no",
        help="no: both fp32 (DALLE2-pytorch's default; default); bf16: both under bf16 autocast "
        "(unclip's train.mixed_precision bf16, DALLE2's trainers handed "
        "Accelerator(mixed_precision='bf16'); results in bench_peers_bf16.json); auto: unclip's "
        "default (bf16 autocast on a CPU that runs it natively) against DALLE2's fp32 "
        "(bench_peers_auto.json, bench_peers_sweep_auto.json)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results name, NAME or NAME:KEY (default: by --mixed-precision and --sweep, above)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="samples/s vs batch (prior, decoder) and vs resolution (decoder), 3 rounds per "
        "point, no profiles: bench_peers_sweep.json and .png",
    )
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("UNCLIP_PEERS_PYTHON", sys.executable),
        help="interpreter of the environment with dalle2_pytorch (env UNCLIP_PEERS_PYTHON)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    probe = subprocess.run(
        [args.peers_python, "-c", "import dalle2_pytorch; print(dalle2_pytorch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        print(skip_message(args.peers_python, last))
        return 0
    started = time.perf_counter()
    setup = SETUPS["quick" if args.quick else "full"]
    spec = {
        "size": setup["size"],
        "threads": args.threads,
        "upsampler_sizes": [
            setup["upsampler_sizes"][0],
            args.upsampler_size or setup["upsampler_sizes"][1],
        ],
        "unclip_upsampler": setup["unclip_upsampler"],
        "dalle2": setup["dalle2"],
        "no_text_cache": args.no_text_cache,
        "mixed_precision": args.mixed_precision,
    }
    result = {
        "machine": common.machine(),
        "args": vars(args),
        "setup": "quick" if args.quick else "full",
        "rounds": rounds,
        "warmup_rounds": 1,
        "dalle2_pytorch": probe.stdout.strip(),
        "stages": [],
    }
    result["machine"]["threads"] = args.threads
    common.log("machine:", common.machine_line(result["machine"]))
    if args.mixed_precision == "auto":
        from unclip.train.optimizers import auto_mixed_precision

        result["unclip_mixed_precision"] = auto_mixed_precision("auto", gpu=False)
    pythons = {"unclip": sys.executable, "dalle2": args.peers_python}
    if args.sweep:
        return sweep(spec, pythons, args, result, started)
    with tempfile.TemporaryDirectory(prefix="bench-peers-logs-") as logs:
        for stage in args.stages:
            stage_spec = {**spec, "batch": setup["batch"][stage]}
            result["stages"].append(
                run_stage(stage, stage_spec, pythons, rounds, args.top, Path(logs))
            )
    name = "bench_peers" if args.mixed_precision == "no" else f"bench_peers_{args.mixed_precision}"
    return common.finish(args.out or name, result, started, report)


# the --sweep: (stage, batch, decoder resolution or None)
SWEEP = (
    [("prior", b, None) for b in (8, 32, 128)]
    + [("decoder", b, 64) for b in (1, 2, 4, 8)]
    + [("decoder", 2, r) for r in (32, 128)]
)
SWEEP_QUICK = [("prior", b, None) for b in (4, 16)] + [("decoder", 2, r) for r in (16, 32)]


def sweep(spec: dict, pythons: dict, args, result: dict, started: float) -> int:
    """Samples/s of both trainers vs batch and resolution (``--sweep``)."""
    points = SWEEP_QUICK if args.quick else SWEEP
    rounds = args.rounds or (2 if args.quick else 3)
    result["rounds"], result["sweep"] = rounds, []
    with tempfile.TemporaryDirectory(prefix="bench-peers-logs-") as logs:
        for stage, batch, res in points:
            point = {**spec, "batch": batch, "decoder_res": res}
            r = run_stage(stage, point, pythons, rounds, args.top, Path(logs), profile=False)
            result["sweep"].append(
                {
                    "stage": stage,
                    "batch": batch,
                    "resolution": res,
                    "unclip_samples_per_s": r["unclip"]["samples_per_s"],
                    "dalle2_samples_per_s": r["dalle2"]["samples_per_s"],
                    "speed_ratio": r["speed_ratio"],
                    "params": [r["unclip"]["params"], r["dalle2"]["params"]],
                }
            )
    name = "bench_peers_sweep_quick" if args.quick else "bench_peers_sweep"
    if args.mixed_precision != "no":
        name += f"_{args.mixed_precision}"
    result["plot"] = plot_sweep(
        result["sweep"], common.RESULTS / f"{name}.png", precision_label(result)
    )
    return common.finish(args.out or name, result, started, report_sweep)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(worker(sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))
    raise SystemExit(main())
