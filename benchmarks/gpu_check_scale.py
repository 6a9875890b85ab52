"""The full-scale sections of ``benchmarks/gpu_check.py``: every GPU-size network built from the GPU
mode's configs on the meta device; a real step's peak memory against ``unclip plan``'s; the
full-width decoder's bf16 step (seconds per sample, utilisation, days on 8 × A100); FSDP2 on one
GPU process and two. ``unclip plan``'s fake-tensor steps take minutes of CPU at the GPU's sizes, so
one background process computes them all from the run's start (:func:`start_plans`) and the
sections wait for theirs."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from pathlib import Path

from gpu_check_train import (
    CPU_TEXT_ENCODER,
    KILL_AFTER,
    NEEDS_CUDA,
    ROOT,
    SPEC,
    SPECS,
    TINY,
    MiB,
    compare_runs,
    forkserver,
    load_config,
    run_overrides,
    start_child,
)


# --------------------------------------------------------------------- the GPU's configs, built
def section_gpu_configs(check, rec: dict) -> None:
    """Every network the GPU mode trains or samples, built by the library's own builders from the
    GPU mode's configs and overrides on the meta device (shapes only: no memory, no kernels):
    its parameter count. In the smoke mode this is what keeps the GPU's sizes from rotting, since
    every other section there runs the tiny ones; on a GPU it costs seconds."""
    import torch

    from unclip.nets.clip import CLIP
    from unclip.train.decoder import build_image_model
    from unclip.train.prior import build_prior_model

    rows = rec.setdefault("rows", [])

    def count(*modules) -> float:
        return sum(p.numel() for m in modules for p in m.parameters()) / 1e6

    def add(name, build):
        row: dict = {"network": name}
        try:
            with torch.device("meta"):
                row["params_M"] = build()
        except Exception as e:
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)

    work = check.work / "gpu-configs"
    for spec in SPECS:

        def build(spec=spec):
            tok = work / "tokenizer" if spec.tokenizer else None
            cfg = load_config(spec, False, "bf16", work / spec.name, tok)
            if spec.kind == "tokenizer":
                return count(cfg.tokenizer.build())
            if spec.kind == "tokens":
                return count(cfg.transformer.build())
            clip = CLIP.from_config(cfg.clip)
            builder = build_prior_model if spec.kind == "prior" else build_image_model
            return count(builder(cfg, clip))

        add(f"train: {spec.name}", build)

    def full_decoder():
        cfg = full_decoder_config(False, work)
        return count(build_image_model(cfg, CLIP.from_config(cfg.clip)))

    add("full_decoder: decoder_64", full_decoder)
    from gpu_check_sample import karlo_networks, token_configs

    add("sampling: Karlo-size cascade", lambda: count(*karlo_networks()))
    for family in ("dalle", "mega"):
        add(
            f"tokens: {family}",
            lambda family=family: count(*(c.build() for c in token_configs(False, family))),
        )


# --------------------------------------------------------------- unclip plan, in the background
def memory_cases(cpu: bool) -> list[tuple[str, bool]]:
    """(network, gradient checkpointing) of the memory section."""
    cases = [("prior", False), ("decoder", False), ("decoder", True), ("upsampler_1", False)]
    return cases[::2] if cpu else cases  # the same code at two sizes of the smoke budget


def memory_config(cpu: bool, work: Path, name: str, checkpointing: bool):
    from unclip.train.config import load_stage_config

    spec = SPEC[name]
    return load_stage_config(
        TINY / spec.config,
        [
            *(spec.cpu if cpu else spec.gpu),
            *run_overrides(cpu, "no" if cpu else "fp16", work / "memory"),
            "train.grad_accum_steps=2",
            f"train.gradient_checkpointing={str(checkpointing).lower()}",
            # the prior's caption-encoding cache is planned at its whole budget, which a step of
            # repeated captions never fills: off on both sides
            *(["train.text_cache_mb=0"] if name == "prior" else []),
        ],
    )


def full_decoder_config(cpu: bool, work: Path):
    """The 3.5B decoder of ``configs/decoder_64.yaml`` in bf16 with 2 micro-batches (random
    weights: nothing is read or downloaded; the data section is never iterated); the smoke mode's
    tiny decoder with its caption transformer."""
    from unclip.train.config import load_stage_config

    common = [
        "train.mixed_precision=bf16",
        "train.grad_accum_steps=2",
        "train.progress=false",
        "train.trackers=[]",
        f"train.output_dir={work / 'full-decoder'}",
    ]
    if cpu:
        return load_stage_config(
            TINY / "decoder.yaml", [*CPU_TEXT_ENCODER, "data.batch_size=2", *common]
        )
    return load_stage_config(
        ROOT / "configs" / "decoder_64.yaml",
        ["clip.pretrained=null", "data.source=shapes", "data.path=null", *common],
    )


def plan_jobs(cpu: bool, sections) -> list[str]:
    """The plans the selected sections wait for, in the order they wait."""
    jobs = []
    if "memory" in sections:
        jobs += [f"memory-{name}-{ckpt}" for name, ckpt in memory_cases(cpu)]
    if "full_decoder" in sections:
        jobs.append("full_decoder")
    return jobs


def plan_worker(work: str, cpu: bool, jobs: list[str]) -> None:
    """The background process: each job's ``measure_step`` (fake CUDA tensors, the memory
    section's on the smoke mode's CPU as its real step runs there), written as one JSON file per
    job (its error if it fails, so that a section never waits for a plan that will not come)."""
    import torch

    from unclip.train.plan import measure_step

    torch.set_num_threads(1)
    logging.getLogger("unclip").setLevel(logging.WARNING)
    folder = Path(work) / "plans"
    for job in jobs:
        t0 = time.perf_counter()
        try:
            if job == "full_decoder":
                cfg, device_type = full_decoder_config(cpu, Path(work)), "cuda"
            else:
                _, name, ckpt = job.split("-")
                cfg = memory_config(cpu, Path(work), name, ckpt == "True")
                device_type = "cpu" if cpu else "cuda"
            est = measure_step(cfg, device_type=device_type)
            out = {
                "params_total": est.params_total,
                "peak": est.peak,
                "micro_batch": est.micro_batch,
                "train_flops_per_sample": est.train_flops_per_sample,
            }
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}"[:500]}
        out["seconds"] = time.perf_counter() - t0
        tmp = folder / f"{job}.json.tmp"
        tmp.write_text(json.dumps(out))
        tmp.rename(folder / f"{job}.json")  # whole or absent: the waiting section never reads half


def start_plans(check, sections) -> None:
    """Start the background plans of the selected sections (the driver calls this first)."""
    jobs = plan_jobs(check.cpu, sections)
    if not jobs:
        return
    (check.work / "plans").mkdir(parents=True, exist_ok=True)
    check.shared["plans"] = start_child(
        forkserver(), plan_worker, (str(check.work), check.cpu, jobs), keep=True
    )


def plan_result(check, job: str) -> dict:
    """Wait for the background plan of ``job`` (the section's time box bounds the wait)."""
    path = check.work / "plans" / f"{job}.json"
    proc = check.shared.get("plans")
    if proc is None:
        raise RuntimeError("the background plans were not started")
    while not path.exists():
        if not proc.is_alive() and not path.exists():
            raise RuntimeError(f"the plan process ended (exit {proc.exitcode}) without {job}")
        time.sleep(0.1)
    out = json.loads(path.read_text())
    if "error" in out:
        raise RuntimeError(f"unclip plan failed: {out['error']}")
    return out


# ------------------------------------------------------------------------- memory against plan
def real_step_peak(cfg) -> dict:
    """The second real training step of ``cfg`` on this process's device (the first makes
    AdamW's moments), ``train.grad_accum_steps`` micro-batches of the plan's synthetic batch:
    its peak as the plan counts it (live tensor storages, 512-byte rounding) and, on a GPU, as
    the CUDA caching allocator saw it."""
    import tempfile

    import torch

    from unclip.nets.clip import CLIP
    from unclip.train.decoder import clip_device
    from unclip.train.loop import TrainLoop
    from unclip.train.plan import MemoryTracker
    from unclip.train.plan_build import _build, _synthetic_batch

    cfg = copy.deepcopy(cfg)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu-check-peak-") as tmp:
        cfg.train.output_dir = tmp
        loop = TrainLoop(cfg, overwrite=True)
        device = loop.device
        mem = MemoryTracker(device.type)
        base = torch.cuda.memory_allocated() if cuda else 0
        try:
            with mem:
                torch.manual_seed(cfg.train.seed)
                with torch.device(clip_device(cfg, device)):
                    clip = CLIP.from_config(cfg.clip)
                model, task = _build(cfg, clip, device, loop.mixed_precision)
                model = loop.prepare(model)
                model.train()
                batches = [_synthetic_batch(cfg, clip, cfg.data.batch_size)]
                batches *= cfg.train.grad_accum_steps
                loop.run_step(task, batches)
                mem.reset_peak()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                loop.run_step(task, batches)
                if cuda:
                    torch.cuda.synchronize()
        finally:
            loop.accelerator.end_training()
            loop.release_output_dir()
    out = {"tracker_MiB": mem.peak / MiB}
    if cuda:
        out["allocator_MiB"] = (torch.cuda.max_memory_allocated() - base) / MiB
        out["reserved_MiB"] = torch.cuda.max_memory_reserved() / MiB
    return out


def section_memory(check, rec: dict) -> None:
    """``unclip plan``'s one-GPU peak of a step (fake CUDA tensors, fp16 with the scaler) against
    the real step's on the GPU, as the CUDA caching allocator counts it; in the smoke mode the
    plan's CPU estimate against a real CPU step (the comparison of ``benchmarks/bench_plan.py``),
    as the plan's tracker counts it."""
    rows = rec.setdefault("rows", [])
    if check.cpu:
        rec["allocator_peak"] = f"{NEEDS_CUDA} (the CPU rows compare against the tracker's)"
    for name, checkpointing in memory_cases(check.cpu):
        row: dict = {"network": name, "checkpointing": checkpointing}
        rows.append(row)
        try:
            cfg = memory_config(check.cpu, check.work, name, checkpointing)
            real = real_step_peak(cfg)
            est = plan_result(check, f"memory-{name}-{checkpointing}")
            row.update(
                params_M=est["params_total"] / 1e6,
                plan_MiB=est["peak"] / MiB,
                plan_s=est["seconds"],
                **real,
            )
            measured = real.get("allocator_MiB", real["tracker_MiB"])
            row["plan_error_pct"] = 100 * (est["peak"] / MiB - measured) / measured
        except Exception as e:  # the next case still runs; the driver fails the section
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])


# --------------------------------------------------------------------- the full-width decoder
def section_full_decoder(check, rec: dict) -> None:
    """The 3.5B decoder of ``configs/decoder_64.yaml`` (random weights, a random ViT-L/14 CLIP)
    in bf16 at its micro-batch of 32 with 2 micro-batches: seconds per sample, model FLOP
    utilisation from the plan's counted FLOPs against the bf16 matmul rate measured here, the days
    its schedule takes on 8 × A100 at the same utilisation (A100 peak scaled), beside the plan's
    assumed 40 %. Every caption is as long as the caption transformer's 256-token context, so the
    step runs the positions the plan counts. Smoke mode: the tiny decoder's real CPU step and its
    fake-CUDA plan; the utilisation and the days, which only a GPU's rate can give, are recorded
    as skipped."""
    import torch

    from unclip.nets.clip import CLIP
    from unclip.train.decoder import DecoderTask, build_image_model, clip_device
    from unclip.train.loop import TrainLoop
    from unclip.train.plan_build import _synthetic_batch
    from unclip.train.strategies import A100_FP16_FLOPS, UTILISATION

    cfg = full_decoder_config(check.cpu, check.work)
    accumulation = cfg.train.grad_accum_steps
    rec["config"] = "configs/tiny/decoder.yaml" if check.cpu else "configs/decoder_64.yaml"
    full_steps, schedule_accumulation = cfg.train.max_steps, 8
    loop = TrainLoop(cfg, overwrite=True)
    try:
        torch.manual_seed(0)
        with torch.device(clip_device(cfg, loop.device)):
            clip = CLIP.from_config(cfg.clip)
        with torch.device(loop.device):
            model = build_image_model(cfg, clip)
        model = loop.prepare(model)
        model.train()
        task = DecoderTask(cfg, clip, loop.device, loop.mixed_precision)
        batch = _synthetic_batch(cfg, clip, cfg.data.batch_size)
        batch["caption"] = [" ".join(["a red circle above a blue square"] * 60)] * len(
            batch["caption"]
        )
        micro = [batch] * accumulation
        times = []
        for i in range(3):  # the first step warms the kernels up and makes AdamW's moments
            if i == 1 and not check.cpu:
                torch.cuda.reset_peak_memory_stats()
            seconds, loss = check.timed(lambda: loop.run_step(task, micro))
            times.append(seconds)
            rec["loss"] = loss
        step = min(times[1:])
        samples = cfg.data.batch_size * accumulation
        rate = samples / step
        rec.update(step_seconds=times, s_per_sample=step / samples, samples_per_s=rate)
        rec["real_peak_GiB"] = (
            torch.cuda.max_memory_allocated() / 2**30 if not check.cpu else NEEDS_CUDA
        )
    finally:
        loop.accelerator.end_training()
        loop.release_output_dir()
    plan = plan_result(check, "full_decoder")
    flops = plan["train_flops_per_sample"]
    rec.update(
        params_B=plan["params_total"] / 1e9,
        micro_batch=plan["micro_batch"],
        plan_seconds=plan["seconds"],
        plan_peak_GiB=plan["peak"] / 2**30,
        plan_tflop_per_sample=flops / 1e12,
    )
    peak = check.shared.get("peak_flops")
    if peak is None:  # the env section did not run: the datasheet's dense bf16 figure
        peak = 989e12
        rec["peak_source"] = "H200 datasheet"
    global_batch = cfg.data.batch_size * schedule_accumulation * 8
    a100_rate = rate * A100_FP16_FLOPS / peak  # the same utilisation on an A100's peak
    measured = {
        "mfu": flops * rate / peak,
        "days_8xA100_measured": full_steps * global_batch / (8 * a100_rate) / 86400,
    }
    if not all(math.isfinite(v) and v > 0 for v in measured.values()):
        raise RuntimeError(f"utilisation arithmetic gave {measured}")
    # a CPU's rate over a CPU's matmul rate says nothing of a GPU's: the arithmetic runs, the
    # figures are not reported
    rec.update({k: NEEDS_CUDA for k in measured} if check.cpu else measured)
    planned_rate = UTILISATION * A100_FP16_FLOPS / flops
    rec["days_8xA100_plan_at_40pct"] = full_steps * global_batch / (8 * planned_rate) / 86400


# ------------------------------------------------------------------------------------ FSDP2
def launch_env(config_file: Path, processes: int) -> dict:
    """The FSDP/Accelerate part of the environment ``accelerate launch --config_file FILE
    --num_processes N`` gives each process, from Accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(config_file), "--num_processes", str(processes), "x.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_"))}


def section_fsdp(check, rec: dict) -> None:
    """FSDP2 with the environment ``accelerate launch`` derives from
    ``configs/accelerate/fsdp_8gpu_bf16.yaml``, set in each process as ``torchrun`` sets it: one
    GPU process (the sharded code path, its CUDA streams, NCCL on one rank), then two processes
    on the one GPU (NCCL may refuse two ranks on one device: the row then records its error).
    Each trains the decoder with its caption transformer 4 steps, stops at 2 and resumes; the
    resumed weights must equal the uninterrupted run's. Smoke mode: two gloo CPU processes under
    ``fsdp_8gpu.yaml`` in fp32, the CPU stand-in for NCCL (one CPU process does not shard). The
    processes fork from the training section's server, so no launch pays the imports again."""
    import socket

    ctx = forkserver()
    rows = rec.setdefault("runs", [])
    name = "fsdp_8gpu.yaml" if check.cpu else "fsdp_8gpu_bf16.yaml"
    if check.cpu:
        rows.append({"processes": 1, "skipped": f"{NEEDS_CUDA} (one CPU process does not shard)"})
        rec["nccl"] = f"{NEEDS_CUDA} (gloo on CPU processes stands in)"
    for n in [2] if check.cpu else [1, 2]:
        out = check.work / f"fsdp-{n}"
        out.mkdir(parents=True, exist_ok=True)
        env = launch_env(ROOT / "configs" / "accelerate" / name, n)
        if check.cpu:
            env["ACCELERATE_MIXED_PRECISION"] = "no"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
        )
        row: dict = {"processes": n, "accelerate_config": name}
        rows.append(row)
        t0 = time.perf_counter()
        procs = [start_child(ctx, fsdp_worker, (out, check.cpu, rank, env)) for rank in range(n)]
        for p in procs:
            p.join(timeout=max(check.left() - 5, 5))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        row["seconds"] = time.perf_counter() - t0
        row["exit_codes"] = [p.exitcode for p in procs]
        result = out / "fsdp_result.json"
        if result.exists():
            row.update(json.loads(result.read_text()))
            if not row["sharded"]:  # a launch Accelerate ran unsharded tested nothing of FSDP2
                row.update(
                    status="error", error="no FSDP2 line in the log: the run was not sharded"
                )
        else:
            errors = sorted(out.glob("error_*.txt"))
            row.update(
                status="error",
                error=errors[0].read_text()[-800:] if errors else "no result, no error written",
            )


def fsdp_worker(out: Path, cpu: bool, rank: int, env: dict) -> None:
    """One process of :func:`section_fsdp`'s launch: ``torchrun``'s variables and the
    Accelerate launcher's, then three decoder runs; rank 0 compares and writes the result, every
    rank writes its error if it fails."""
    import traceback

    # two ranks on the one GPU: each would take cuda:<local rank>, and there is only cuda:0
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(0 if not cpu else rank))
    try:
        _fsdp_runs(out, cpu, rank)
    except BaseException:
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise


def _fsdp_runs(out: Path, cpu: bool, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from accelerate.state import PartialState

    from unclip.train.config import load_stage_config
    from unclip.train.decoder import train_decoder

    if cpu:
        torch.set_num_threads(1)
    # each run ends with end_training, which destroys the process group; the next run keeps it
    PartialState.destroy_process_group = lambda self, group=None: None
    lines: list[str] = []

    class Layout(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith(("FSDP2: ", "strategy: ")):
                lines.append(message)

    logging.getLogger("unclip.train").addHandler(Layout(logging.INFO))
    logging.getLogger("unclip.train").setLevel(logging.INFO)
    spec = SPEC["decoder"]
    precision = "no" if cpu else "auto"  # auto: the Accelerate file's bf16

    def cfg(run):
        return load_stage_config(
            TINY / spec.config,
            [
                *(spec.cpu if cpu else spec.gpu),
                *run_overrides(cpu, precision, out / run),
                "train.grad_accum_steps=2",
            ],
        )

    t0 = time.perf_counter()
    train_decoder(cfg("full"), overwrite=True)
    full_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / MiB if not cpu else NEEDS_CUDA
    backend = dist.get_backend() if dist.is_initialized() else "none"
    train_decoder(cfg("split"), max_steps_this_run=KILL_AFTER, overwrite=True)
    train_decoder(cfg("split"), resume="latest")
    if rank == 0:
        same = compare_runs(out / "full", out / "split")
        result = {
            "backend": backend,
            "log": sorted(set(lines)),
            "sharded": any(line.startswith("FSDP2: ") for line in lines),
            "full_run_s": full_s,
            "peak_MiB": peak,
            **{f"resumed_{k}": v for k, v in same.items()},
            "bit_identical": same["unequal"] == 0,
        }
        (out / "fsdp_result.json").write_text(json.dumps(result, indent=2))
