"""From one process's dry-run measurement (:class:`~unclip.train.plan.StepMeasure`) to a per-GPU
memory plan for ``N`` GPUs under DDP, ZeRO-2/FSDP ``SHARD_GRAD_OP``, ZeRO-3/FSDP ``FULL_SHARD`` and
``FULL_SHARD`` with the optimizer offloaded to the CPU: exact arithmetic on the measured parts."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from unclip.train.plan import StepMeasure
from unclip.utils.config import load_yaml_file

__all__ = [
    "Strategy",
    "STRATEGIES",
    "PlanRow",
    "Launch",
    "per_sample_bytes",
    "plan_row",
    "fsdp2_parts",
    "memory_plan",
    "parse_memory",
    "read_accelerate_config",
    "format_plan",
    "throughput_line",
    "GiB",
    "CUDA_CONTEXT",
    "FRAGMENTATION",
]

GiB = 2**30
#: per-GPU memory that is not the model's: the CUDA context and kernels, plus allocator
#: fragmentation as a share of the rest (a common observation for training workloads)
CUDA_CONTEXT = 1.5 * GiB
FRAGMENTATION = 0.10
#: an A100's dense fp16/bf16 tensor-core peak, and the share of it a well-fed diffusion UNet step
#: reaches (an assumption the throughput line states, not a measurement)
A100_FP16_FLOPS = 312e12
UTILISATION = 0.40


def parse_memory(text: str) -> int:
    """``"80GiB"``, ``"80GB"`` (read as GiB: an "80 GB" card holds 80 GiB), ``"40960MiB"`` or a
    number of bytes → bytes."""
    low = str(text).strip().lower()
    units = {"tib": 2**40, "tb": 2**40, "gib": GiB, "gb": GiB, "mib": 2**20, "mb": 2**20}
    unit = next((u for u in units if low.endswith(u)), "")
    number, scale = low[: len(low) - len(unit)].strip(), units.get(unit, 1)
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"cannot read the memory size {text!r}; write e.g. 80GiB, 40GB or 24576MiB"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value * scale)


# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the training state is spread over the GPUs. ``shard_*``: that part is divided by the
    number of GPUs sharing it (under FSDP2 the EMA follows each rank's shard; under DeepSpeed
    ZeRO-2 it is whole); ``offload_optimizer``: the optimizer state lives in CPU memory;
    ``offload_weights``: FSDP's CPU offload, which keeps the weight, gradient and optimizer shards
    (and so the EMA shard) in CPU memory, the GPU holding the units being computed;
    ``ddp_buckets``: DDP's all-reduce buckets, a second copy of the gradients unless
    ``gradient_as_bucket_view`` (the training loop sets it); ``refuses_ema``: the training loop
    refuses ``train.ema`` under it (DeepSpeed ZeRO-3); ``fsdp2``: planned by what FSDP2 holds
    (:func:`fsdp2_parts`)."""

    name: str
    launch: str  # the shipped Accelerate config file that launches it
    shard_weights: bool = False
    shard_grads: bool = False
    shard_optimizer: bool = False
    shard_ema: bool = False
    offload_optimizer: bool = False
    offload_weights: bool = False
    ddp_buckets: bool = False
    refuses_ema: bool = False
    fsdp2: bool = False


_ZERO2 = dict(shard_grads=True, shard_optimizer=True)
_ZERO3 = dict(shard_weights=True, shard_grads=True, shard_optimizer=True, shard_ema=True)

#: what the plan suggests, in this order (DeepSpeed is planned when its config file is given)
STRATEGIES = {
    "ddp": Strategy("DDP", "configs/accelerate/ddp_8gpu.yaml"),
    "zero2": Strategy(
        "FSDP SHARD_GRAD_OP",
        "configs/accelerate/fsdp_grad_op_8gpu.yaml",
        shard_ema=True,
        fsdp2=True,
        **_ZERO2,
    ),
    "zero3": Strategy("FSDP FULL_SHARD", "configs/accelerate/fsdp_8gpu.yaml", fsdp2=True, **_ZERO3),
    "zero3_offload": Strategy(
        "FSDP FULL_SHARD + CPU offload",
        "configs/accelerate/fsdp_offload_8gpu.yaml",
        offload_optimizer=True,
        offload_weights=True,
        fsdp2=True,
        **_ZERO3,
    ),
}


def _recommended(launch: str) -> str:
    """The shipped file to launch a suggested strategy with: its bf16 twin, which
    docs/full_scale.md recommends on A100s (no loss scaling), naming the fp16 file for GPUs without
    bf16; a file the user gave stays as given."""
    if launch not in {s.launch for s in STRATEGIES.values()}:
        return launch
    twin = launch.replace(".yaml", "_bf16.yaml")
    return f"{twin} (fp16, for GPUs without bf16: {launch})"


@dataclasses.dataclass(frozen=True)
class Launch:
    """What an Accelerate config file launches: the strategy, the GPUs each share of the state is
    divided over (``shard_gpus``: a node under hybrid sharding) and all processes (``gpus``, for
    the global batch)."""

    strategy: Strategy
    shard_gpus: int
    gpus: int


def read_accelerate_config(path) -> Launch:
    """The :class:`Launch` an Accelerate config file describes."""
    data = load_yaml_file(path, "--accelerate-config")
    kind = str(data.get("distributed_type", "NO")).upper()
    gpus = int(data.get("num_processes", 1) or 1)
    launch = str(path)
    if kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        offload = bool(fsdp.get("fsdp_offload_params", False))
        # FSDP2 names the strategy by whether weights are resharded after the forward; FSDP1 by
        # its sharding strategy
        if "fsdp_reshard_after_forward" in fsdp and "fsdp_sharding_strategy" not in fsdp:
            full = str(fsdp["fsdp_reshard_after_forward"]).lower() in ("true", "1")
            sharding = "FULL_SHARD" if full else "SHARD_GRAD_OP"
        else:
            sharding = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        # hybrid sharding: each GPU's share is that of the group it shards over
        shard = (data.get("parallelism_config") or {}).get("parallelism_config_dp_shard_size")
        if shard:
            shard_gpus = int(shard)
        elif sharding in ("HYBRID_SHARD", "4", "_HYBRID_SHARD_ZERO2", "5"):
            shard_gpus = max(1, gpus // int(data.get("num_machines", 1) or 1))
        else:
            shard_gpus = gpus
        if sharding in ("NO_SHARD", "3"):
            strategy = dataclasses.replace(STRATEGIES["ddp"], name="FSDP NO_SHARD", launch=launch)
        elif offload:
            strategy = dataclasses.replace(STRATEGIES["zero3_offload"], launch=launch)
        elif sharding in ("SHARD_GRAD_OP", "2", "_HYBRID_SHARD_ZERO2", "5"):
            strategy = dataclasses.replace(STRATEGIES["zero2"], launch=launch)
        else:
            strategy = dataclasses.replace(STRATEGIES["zero3"], launch=launch)
        return Launch(strategy, shard_gpus, gpus)
    if kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 2))
        off_opt = str(ds.get("offload_optimizer_device", "none")).lower() not in ("none", "")
        off_par = str(ds.get("offload_param_device", "none")).lower() not in ("none", "")
        if stage >= 3:
            strategy = Strategy(
                "DeepSpeed ZeRO-3",
                launch,
                offload_optimizer=off_opt or off_par,
                offload_weights=off_par,
                refuses_ema=True,
                **_ZERO3,
            )
        elif stage >= 1:
            # ZeRO-2 shards gradients and optimizer state; the EMA of the whole weights is whole
            strategy = Strategy(
                f"DeepSpeed ZeRO-{stage}",
                launch,
                shard_grads=stage >= 2,
                shard_optimizer=True,
                offload_optimizer=off_opt,
            )
        else:
            strategy = Strategy("DeepSpeed ZeRO-0", launch)
        return Launch(strategy, gpus, gpus)
    if kind in ("MULTI_GPU", "NO"):
        return Launch(dataclasses.replace(STRATEGIES["ddp"], launch=launch), gpus, gpus)
    raise ValueError(
        f"{path}: distributed_type {kind} is not one the plan knows; use MULTI_GPU, FSDP or "
        "DEEPSPEED"
    )


@dataclasses.dataclass
class PlanRow:
    strategy: Strategy
    micro_batch: int
    grad_accum_steps: int
    gpus: int
    parts: dict  # name → bytes per GPU
    peak: int
    budget: int
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget and not self.note


def plan_row(
    m: StepMeasure,
    strategy: Strategy,
    gpus: int,
    gpu_memory: int,
    micro_batch: Optional[int] = None,
    grad_accum_steps: Optional[int] = None,
) -> PlanRow:
    """Bytes per GPU of each part of the training state for ``strategy`` sharded over ``gpus``
    GPUs, with the batch-dependent activations scaled to ``micro_batch`` (autocast's weight copies
    do not depend on it)."""
    b = micro_batch or m.micro_batch
    scale = b / m.micro_batch
    n = max(1, gpus)
    accum = grad_accum_steps or m.grad_accum_steps
    note = "refuses train.ema" if strategy.refuses_ema and m.ema else ""
    budget = int((gpu_memory - CUDA_CONTEXT) / (1 + FRAGMENTATION))
    if strategy.fsdp2:
        parts = fsdp2_parts(m, strategy, n, scale, accum)
        return PlanRow(strategy, b, accum, n, parts, int(sum(parts.values())), budget, note)

    def share(x, on):
        return x / n if on else x

    if strategy.offload_weights:
        weights = 0.0
    else:
        weights = share(m.weights, strategy.shard_weights)
    if strategy.shard_weights:
        # gathered for compute: the root group for the whole step, and the unit being computed
        # with the next one prefetched
        weights += m.root_weights + 2 * m.block_weights
    parts = {
        "weights": weights,
        "gradients": 0 if strategy.offload_weights else share(m.grads, strategy.shard_grads),
        "DDP buckets": m.grads if strategy.ddp_buckets else 0,
        "optimizer": (
            0 if strategy.offload_optimizer else share(m.optimizer, strategy.shard_optimizer)
        ),
        "EMA": 0 if strategy.offload_weights else share(m.ema, strategy.shard_ema),
        "frozen CLIP": m.clip,
        "caption cache": m.text_cache,
        "autocast copies": m.autocast_copies,
        "activations": (m.activations - m.autocast_copies) * scale,
        "recompute": m.recompute * scale,
        "transient": m.transient * scale,
    }
    peak = int(sum(parts.values()))
    return PlanRow(strategy, b, accum, n, parts, peak, budget, note)


def fsdp2_parts(m: StepMeasure, strategy: Strategy, n: int, scale: float, accum: int) -> dict:
    """Bytes per GPU of what FSDP2 (``fully_shard`` as Accelerate applies it) holds at the step's
    peak, sharded over ``n`` GPUs, activations scaled by ``scale``, ``accum`` micro-batches:

    * ``weights``: the fp32 shards (the optimizer's parameters), ``W / n``;
    * ``gathered weights``: whole copies in the compute dtype (FSDP's ``param_dtype``: fp16/bf16
      under mixed precision, so autocast finds nothing left to copy): the root group for the whole
      step plus the unit computed and the one prefetched; without resharding after the forward
      (``SHARD_GRAD_OP``) every unit stays gathered from its forward to its backward: all of them
      at the backward's start;
    * ``gradients``: the fp32 shards ``G / n``, held through the backward from the second
      micro-batch on: the loop reduce-scatters every micro-batch's gradients (in fp32,
      :func:`unclip.train.distributed.reduce_in_fp32`) into them, so no whole gradients are kept
      through the accumulation; with one micro-batch they fill in as the backward ends (the
      ``end of step``);
    * ``optimizer`` and ``EMA``: the shards of AdamW's moments and of the EMA shadow;
    * ``end of step``: what the end of the step adds beyond the backward's peak, when it does
      (after the activations are freed): the root group's reduce-scatter, which FSDP2 runs last
      (its gathered weights and whole gradients in the compute dtype and their fp32 flat copy for
      the collective, beside the other groups' gradient shards), or the optimizer step (the
      gradient shards and foreach AdamW's temporary: one moment-sized copy of the shard, its
      ``exp_avg_sq`` square root).

    With CPU offload the shards (weights, gradients, moments, EMA) and the step are in CPU
    memory; the gathered weights and accumulated gradients are on the GPU."""
    low = 0.5 if m.mixed_precision in ("fp16", "bf16") else 1.0  # compute-dtype bytes per fp32
    on_gpu = not strategy.offload_weights
    if strategy.shard_weights:
        gathered = (m.root_weights + 2 * m.block_weights) * low
    else:
        gathered = m.weights * low
    grad_shards = m.grads / n if on_gpu else 0.0
    gradients = grad_shards if accum > 1 else 0.0
    activations = (m.activations - m.autocast_copies) * scale
    # the last micro-batch's backward, then the end of the step (activations freed)
    backward = gathered + gradients + activations + (m.recompute + m.transient) * scale
    reduce = m.root_weights * (2 * low + 1) + grad_shards * (1 - m.root_weights / max(1, m.weights))
    step = grad_shards + (m.optimizer / 2 / n if on_gpu else 0.0)
    return {
        "weights": m.weights / n if on_gpu else 0,
        "gathered weights": gathered,
        "gradients": gradients,
        "DDP buckets": 0,
        "optimizer": m.optimizer / n if on_gpu else 0,
        "EMA": m.ema / n if on_gpu else 0,
        "frozen CLIP": m.clip,
        "caption cache": m.text_cache,
        "autocast copies": 0,
        "activations": activations,
        "recompute": m.recompute * scale,
        "transient": m.transient * scale,
        "end of step": max(0.0, reduce - backward, step - backward),
    }


def per_sample_bytes(m: StepMeasure) -> float:
    """The bytes of one GPU's peak that grow with each sample of the micro-batch."""
    return (m.activations - m.autocast_copies + m.recompute + m.transient) / m.micro_batch


def memory_plan(
    m: StepMeasure,
    gpus: int,
    gpu_memory: int,
    strategy: Optional[Strategy] = None,
    grad_accum_steps: int = 1,
) -> tuple[list[PlanRow], Optional[PlanRow]]:
    """Rows for every strategy of :data:`STRATEGIES` (or only ``strategy``) at the measured
    micro-batch, and the first that fits: DDP, SHARD_GRAD_OP, FULL_SHARD at the measured
    micro-batch, then at each smaller divisor of it with accumulation raised to keep the global
    batch; CPU offload, the slowest, only after all of those."""
    if gpu_memory <= CUDA_CONTEXT:
        raise ValueError(
            f"GPU memory of {gpu_memory / GiB:.2f} GiB leaves nothing beside the CUDA context "
            f"({CUDA_CONTEXT / GiB:.1f} GiB); give the card's size, e.g. --gpu-memory 80GiB"
        )
    options = [strategy] if strategy else list(STRATEGIES.values())
    rows = [plan_row(m, s, gpus, gpu_memory, None, grad_accum_steps) for s in options]
    b0 = m.micro_batch
    sizes = [b for b in range(b0, 0, -1) if b0 % b == 0]
    tiers = [
        [s for s in options if not s.offload_weights],
        [s for s in options if s.offload_weights],
    ]
    for tier in tiers:
        for b in sizes:
            for s in tier:
                row = plan_row(m, s, gpus, gpu_memory, b, grad_accum_steps * (b0 // b))
                if row.fits:
                    return rows, row
    return rows, None


def _in(unit: str, x) -> str:
    """Bytes in ``unit`` (GiB, or MiB for plans of small models)."""
    return f"{x / (GiB if unit == 'GiB' else 2**20):.1f}"


def throughput_line(m: StepMeasure, gpus: int, global_batch: int, max_steps: int) -> str:
    """Expected speed from the counted FLOPs at :data:`UTILISATION` of an A100's fp16 peak."""
    per_sample = m.train_flops_per_sample
    if per_sample <= 0:
        return "throughput: no FLOPs counted"
    rate = UTILISATION * A100_FP16_FLOPS / per_sample  # samples/s per GPU
    days = max_steps * global_batch / (rate * gpus) / 86400
    return (
        f"throughput: {per_sample / 1e12:.2f} TFLOP per training sample (forward counted per op, "
        "the trained network's x3 for backward"
        f"{', the recomputes of checkpointed blocks' if m.recompute_flops else ''}, "
        "the frozen CLIP's once); at "
        f"{UTILISATION:.0%} of an "
        f"A100's {A100_FP16_FLOPS / 1e12:.0f} TFLOP/s fp16: {rate:.1f} samples/s per GPU, "
        f"{max_steps} steps of {global_batch} samples on {gpus} GPUs in {days:.1f} days"
        + (
            f"; every caption counted at its whole {m.trimmed_text_positions}-token context, where "
            "training runs a batch to its longest caption (an upper bound; docs/full_scale.md)"
            if m.trimmed_text_positions
            else ""
        )
    )


def format_plan(
    m: StepMeasure,
    rows: list[PlanRow],
    choice: Optional[PlanRow],
    gpus: int,
    gpu_memory: int,
    max_steps: Optional[int] = None,
    total_gpus: Optional[int] = None,
):
    """The plan as text: the dry run's checks, the measured parts and a per-strategy table.
    ``gpus``: the GPUs the state is sharded over; ``total_gpus``: all of them (hybrid sharding
    replicates the sharded state across nodes), for the global batch and the training time."""
    total_gpus = total_gpus or gpus
    unit = "GiB" if max(r.peak for r in rows) >= GiB else "MiB"

    def _gib(x) -> str:
        return _in(unit, x)

    out = [
        f"{m.stage} ({m.component}): fake-CUDA training step passed — model build, prepare, "
        f"{m.grad_accum_steps} micro-batches of {m.mixed_precision} autocast forward, loss "
        f"({m.loss_dtype}) and backward through the autograd graph (every trained parameter got "
        f"a gradient), clipping, AdamW ({m.optimizer_path or 'default path'}), EMA, checkpoint "
        f"write ({_in('GiB', m.checkpoint_bytes)} GiB of tensors in "
        f"{len(m.checkpoint_files)} files, counted, not written); training state on cuda:0, no "
        "device or dtype mismatch",
        f"parameters: {m.params_total / 1e9:.3f}B in the network ({m.params_trainable / 1e9:.3f}B "
        f"trained), frozen CLIP {m.clip_params / 1e9:.3f}B; weights in "
        f"{', '.join(m.param_dtypes)}",
        f"measured on one GPU at micro-batch {m.micro_batch} (gradient checkpointing "
        f"{'on' if m.gradient_checkpointing else 'off'}), {unit}: weights {_gib(m.weights)}, "
        f"gradients "
        f"{_gib(m.grads)}, AdamW state {_gib(m.optimizer)}, EMA {_gib(m.ema)}, frozen CLIP "
        f"{_gib(m.clip)}, caption cache {_gib(m.text_cache)} (train.text_cache_mb), activations "
        f"{_gib(m.activations)} (of which autocast weight copies "
        f"{_gib(m.autocast_copies)}), recomputed block {_gib(m.recompute)}, transient "
        f"{_gib(m.transient)}; measured peak of a micro-batch's backward with AdamW's moments "
        f"{_gib(m.backward_peak + m.optimizer)}",
        "",
        f"per-GPU plan, state sharded over {gpus} GPUs of {gpu_memory / GiB:.1f} GiB (usable after "
        "the CUDA context "
        f"and {FRAGMENTATION:.0%} fragmentation: {rows[0].budget / GiB:.1f} GiB), in {unit}:",
    ]
    names = list(dict.fromkeys(k for r in rows for k in r.parts))  # FSDP2 rows have parts more
    head = ["strategy", "micro-batch"] + names + ["peak", "fits"]
    table = [head]
    for r in rows:
        table.append(
            [r.strategy.name, str(r.micro_batch)]
            + [_gib(r.parts.get(k, 0)) for k in names]
            + [_gib(r.peak), "yes" if r.fits else (f"no: {r.note}" if r.note else "no")]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    out.append("")
    if choice is None:
        out.append(
            "does not fit at micro-batch 1 with any strategy: turn on "
            "train.gradient_checkpointing, use more GPUs or a smaller model"
        )
    else:
        launch = ""
        if choice.strategy.launch:
            launch = f" — accelerate launch --config_file {_recommended(choice.strategy.launch)}"
        out.append(
            f"fits: {choice.strategy.name}, micro-batch {choice.micro_batch}, gradient "
            f"accumulation {choice.grad_accum_steps}, predicted peak {_gib(choice.peak)} {unit}"
            f"{launch}"
        )
        per_sample = per_sample_bytes(m)
        if per_sample > 0:
            fixed = choice.peak - per_sample * choice.micro_batch
            largest = int((choice.budget - fixed) // per_sample)
            out.append(f"the largest micro-batch that fits with it: {largest}")
        if max_steps:
            global_batch = choice.micro_batch * choice.grad_accum_steps * total_gpus
            out.append(throughput_line(m, total_gpus, global_batch, max_steps))
    return "\n".join(out)
