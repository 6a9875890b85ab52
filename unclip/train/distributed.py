"""How a training run is spread over processes: DDP's PowerSGD hook, FSDP and DeepSpeed, and the
state dicts a checkpoint or an export gathers from them (the optimizers are built by
:mod:`unclip.train.optimizers`).

:class:`~unclip.train.loop.TrainLoop` uses this module for everything that depends on the
strategy Accelerate runs (``accelerate launch --config_file configs/accelerate/<strategy>.yaml``):

============  =================================================================================
strategy      what the loop does differently
============  =================================================================================
``single``    nothing: one process holds everything
``ddp``       ``gradient_as_bucket_view`` (the gradients live in DDP's buckets: one copy fewer);
              PowerSGD through :func:`nonfinite_safe_powersgd_hook` when ``train.powersgd_rank``
``fsdp``      FSDP2 only (``fsdp_version: 2``): parameters, gradients, optimizer moments and the
              EMA shadow are ``DTensor`` shards; checkpoints and exports gather them to full
              tensors (:func:`gather_state`) and resume scatters them back
              (:func:`load_full_state`), so checkpoints have the same files as unsharded ones
``deepspeed`` ZeRO-2/3 through Accelerate: weights are gathered with
              ``Accelerator.get_state_dict``; the ZeRO optimizer partitions are *not* checkpointed
              (DeepSpeed keeps them in pickles, which this project never loads), so a resume
              restarts the AdamW moments (with a warning); the EMA shadow is fp32 though the
              engine casts the weights to fp16/bf16 (:func:`shadow_in_fp32`)
============  =================================================================================

Rank-0-only work (writing files, sample grids) never calls a collective: everything that
gathers runs on every process first.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

# the launch checks and the optimizers live in their own modules; these names are part of this
# module's interface
from unclip.train.fsdp_launch import describe_fsdp, use_fsdp_on_cpu
from unclip.train.optimizers import OPTIMIZERS, make_optimizer

logger = logging.getLogger("unclip.train")

__all__ = [
    "OPTIMIZERS",
    "make_optimizer",
    "strategy_of",
    "use_fsdp_on_cpu",
    "describe_fsdp",
    "PowerSGDGuardState",
    "nonfinite_safe_powersgd_hook",
    "register_powersgd",
    "powersgd_files",
    "load_powersgd",
    "gather_full",
    "gather_state",
    "load_full_state",
    "is_sharded",
    "full_copy",
    "FSDP_BLOCKS",
    "fsdp_block_classes",
    "fsdp_units",
    "shadow_in_fp32",
]


# ------------------------------------------------------------------ strategy


def strategy_of(accelerator) -> str:
    """``single``, ``ddp``, ``fsdp`` or ``deepspeed``: how ``accelerator`` spreads the model."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    return "ddp" if accelerator.num_processes > 1 else "single"


def is_sharded(accelerator) -> bool:
    """Whether each process holds only part of the weights (gathering needs every process)."""
    return strategy_of(accelerator) in ("fsdp", "deepspeed")


#: the blocks FSDP shards as separate groups (gathered one at a time in forward and backward):
#: the prior's transformer blocks (diffusers' or, with DALL-E Mega's options, the project's own
#: :class:`~unclip.nets.blocks.TransformerBlock`) and the token transformers' layers
#: (DALL-E's, Mega's), or else the resnet and attention blocks of a diffusers UNet (the VQGAN's
#: too) and the blocks of the decoder's own caption transformer (``text_encoder: transformer``,
#: 1.31B of the full-scale decoder's 3.56B parameters), or else the dVAE's residual blocks. What
#: no block holds (embeddings, projections, the caption's token embedding) stays in the root
#: group, gathered for the whole step.
FSDP_BLOCKS = (
    ("BasicTransformerBlock", "TransformerBlock", "MegaLayer", "DalleBlock"),
    ("ResnetBlock2D", "Attention", "CaptionBlock"),
    ("DVAEBlock",),
)


def fit_fsdp_wrapping(accelerator, model: torch.nn.Module) -> None:
    """Under FSDP with ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`` and no class names in the
    Accelerate config, shard the blocks of :data:`FSDP_BLOCKS` this model holds, so one config
    fits every stage (Accelerate insists that each named class exists in the model, and a
    prior has no UNet blocks). Accelerate's size-based policy is no alternative for FSDP2: it
    counts all parameters below a module and so also picks ``ModuleList`` containers, which
    ``fully_shard`` refuses."""
    if strategy_of(accelerator) != "fsdp":
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy is not transformer_auto_wrap_policy or plugin.transformer_cls_names_to_wrap:
        return
    plugin.transformer_cls_names_to_wrap = fsdp_block_classes(model)
    logger.info(
        "FSDP shards %d blocks (%s) as their own groups",
        len(fsdp_units(model)),
        ", ".join(plugin.transformer_cls_names_to_wrap),
    )


#: a caption transformer's blocks, in either family's network: the decoder's and the diffusion
#: prior's own (``text_encoder: transformer``, 1.31B at full scale in each)
CAPTION_BLOCKS = ("CaptionBlock",)


def fsdp_block_classes(model: torch.nn.Module) -> list[str]:
    """The class names of :data:`FSDP_BLOCKS` that ``model`` holds (the first set found), and
    :data:`CAPTION_BLOCKS` wherever they are."""
    present = {type(m).__name__ for m in model.modules()}
    for names in FSDP_BLOCKS:
        found = [n for n in names if n in present]
        if found:
            return found + [n for n in CAPTION_BLOCKS if n in present and n not in found]
    return [n for n in CAPTION_BLOCKS if n in present]


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that FSDP shards as their own groups (instances of
    :func:`fsdp_block_classes`), in ``model.modules()`` order. The parameters under none of them
    form the root group, which stays gathered for the whole step."""
    names = set(fsdp_block_classes(model))
    return [m for m in model.modules() if type(m).__name__ in names]


def reduce_in_fp32(accelerator) -> None:
    """Under FSDP2 with fp16/bf16 compute, reduce-scatter the gradients in fp32 (FSDP's
    ``reduce_dtype``; Accelerate sets it to the compute dtype): a half-precision sum over the
    GPUs loses the small gradients' bits and, in fp16, can overflow where no single GPU's
    gradient did. It doubles the bytes of the reduce-scatter, which runs beside the backward of
    the next unit; the fp32 shards the optimizer reads are unchanged."""
    import dataclasses

    if strategy_of(accelerator) != "fsdp":
        return
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    half = (torch.float16, torch.bfloat16)
    if policy is None or getattr(policy, "reduce_dtype", None) not in half:
        return
    plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
    logger.info(
        "FSDP: compute in %s, gradients reduce-scattered in float32 every micro-batch",
        str(policy.param_dtype).removeprefix("torch."),
    )


def check_strategy(accelerator) -> None:
    """Refuse FSDP1: its flat parameters are not ``DTensor`` shards, which the checkpoints and the
    EMA of this project gather (FSDP2, ``fsdp_version: 2``, shards each parameter)."""
    if strategy_of(accelerator) == "fsdp" and not accelerator.is_fsdp2:
        raise ValueError(
            "FSDP1 is not supported: set fsdp_version: 2 in the Accelerate config (the shipped "
            "configs/accelerate/fsdp_*.yaml do)"
        )


# ------------------------------------------------------------------ EMA
def shadow_in_fp32(ema):
    """Make the shadow of diffusers' ``EMAModel`` ``ema`` fp32 (in place, on the same devices);
    returns ``ema``.

    ``EMAModel`` clones the parameters as they are; built after ``accelerator.prepare`` those may
    be half precision (DeepSpeed's fp16/bf16 engines cast the module itself). A half-precision
    shadow loses the EMA: with decay 0.9999 each update moves it by 1e-4 of its distance to the
    weights, which rounds away unless that distance exceeds about 5 times the value itself
    (fp16's half step is 2**-11 of it; bf16's 2**-8, so 40 times). An fp32 shadow takes every
    update; ``step`` mixes dtypes by type promotion and ``copy_to`` casts back to the
    parameters' dtype. FSDP2 shadows are fp32 ``DTensor`` shards already (its parameters stay
    fp32; mixed precision casts only the gathered copies)."""
    ema.shadow_params = [
        s.float() if s.is_floating_point() and s.dtype != torch.float32 else s
        for s in ema.shadow_params
    ]
    return ema


# ------------------------------------------------------------------ PowerSGD
class PowerSGDGuardState:
    """State of :func:`nonfinite_safe_powersgd_hook`: torch's ``PowerSGDState`` plus the loss scale
    each bucket's error feedback was measured at, and a count of the buckets whose PowerSGD
    update was rolled back because it was non-finite. ``scale()``: the current loss scale (a
    1-element tensor) or ``None`` without loss scaling."""

    def __init__(
        self,
        powersgd_state,
        scale: Callable[[], Optional[torch.Tensor]],
        params: Optional[list[torch.nn.Parameter]] = None,
    ):
        self.powersgd = powersgd_state
        self.scale = scale
        self.error_scale: dict[int, torch.Tensor] = {}
        self.rolled_back = 0
        # for checkpoints: the model's parameters (their positions name the saved pieces), the
        # parameter positions each bucket held when its memory was written, and per-parameter
        # pieces read from a checkpoint, put into buckets as they are met (see fit_layout)
        self.params = list(params or [])
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.layouts: dict[int, list[int]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}


def nonfinite_safe_powersgd_hook(state: PowerSGDGuardState, bucket):
    """torch's ``powerSGD_hook`` whose memory survives a loss-scale overflow.

    PowerSGD keeps, per bucket, the compression error of the last step (error feedback, added to
    the next step's gradient) and the low-rank factors P and Q (warm start). A step whose
    gradient holds inf/NaN (an fp16 overflow, which the grad scaler then skips) writes NaN into
    both, and every later step's gradient becomes NaN: the run stops after
    ``train.max_consecutive_nonfinite``. Here, when the reduced bucket is non-finite, the memory
    is put back as it was before the step (the gradient stays non-finite, so the step is still
    skipped). The check needs no extra communication: P, Q and the uncompressed tensors are
    all-reduced, so a non-finite value on any process makes the result non-finite on all.

    With loss scaling the error feedback is measured in scaled units; it is rescaled when the
    scale changes (the scaler halves it after an overflow, doubles it after a run of good
    steps), so a residual is never fed back at the wrong magnitude."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    ps = state.powersgd
    if ps.iter < ps.start_powerSGD_iter:  # plain all-reduce: no memory to protect
        return psgd.powerSGD_hook(ps, bucket)
    fit_layout(state, bucket)
    index = bucket.index()
    scale = state.scale()
    error = ps.error_dict.get(index)
    if error is not None and scale is not None:
        if index in state.error_scale:
            error.mul_(scale / state.error_scale[index])
        state.error_scale[index] = scale.detach().clone()
    # the hook replaces error_dict[index] with a new tensor but writes P and Q in place
    saved_p = ps.p_memory_dict.get(index)
    saved_q = ps.q_memory_dict.get(index)
    saved_p = saved_p.clone() if saved_p is not None else None
    saved_q = saved_q.clone() if saved_q is not None else None

    def check(fut):
        out = fut.value()
        if bool(torch.isfinite(out).all()):
            if scale is not None:  # the scale the new error feedback is measured at
                state.error_scale[index] = scale.detach().clone()
            return out
        state.rolled_back += 1
        if error is None:
            ps.error_dict.pop(index, None)
        else:
            ps.error_dict[index] = error
        if saved_p is None:  # the first compressed step: start afresh next time
            ps.p_memory_dict.pop(index, None)
            ps.q_memory_dict.pop(index, None)
        else:
            ps.p_memory_dict[index] = saved_p
            ps.q_memory_dict[index] = saved_q
        return out

    return psgd.powerSGD_hook(ps, bucket).then(check)


def register_powersgd(ddp_model, accelerator, rank: int, start_step: int) -> PowerSGDGuardState:
    """PowerSGD of ``rank`` on ``ddp_model`` after ``start_step`` plain all-reduce steps (at least
    2: DDP rebuilds its buckets after the first step), through
    :func:`nonfinite_safe_powersgd_hook`. Returns the hook's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    ps = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=max(2, start_step),
    )

    def scale():
        scaler = accelerator.scaler
        return getattr(scaler, "_scale", None) if scaler is not None else None

    state = PowerSGDGuardState(ps, scale, list(ddp_model.parameters()))
    ddp_model.register_comm_hook(state, nonfinite_safe_powersgd_hook)
    return state


# PowerSGD's memory in checkpoints. Its per-bucket tensors (error feedback: the bucket's flat
# gradient layout; Q: one [m, r] factor per compressed gradient, grouped by shape) are saved cut
# into per-parameter pieces, because a resumed process meets other buckets at first: DDP lays out
# its buckets in parameter order and rebuilds them in gradient order after the first step, which
# the run saved from had long done. P needs no saving: each step overwrites it from Q.
def _q_slices(shapes: list[torch.Size], rank: int, min_rate: float) -> tuple[dict, int, int]:
    """``({position in bucket: (offset, size)}, Q length, P length)`` of the compressed gradients
    of a bucket holding gradients of ``shapes``, laid out as torch's ``powerSGD_hook`` does."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for j, shape in enumerate(shapes):
        n = shape[0]
        m = max(1, torch.Size(shape).numel() // max(1, n))
        r = min(n, m, rank)
        if psgd._should_compress(n, m, r, min_rate)[0]:
            groups.setdefault((n, m), []).append((j, m * r, n * r))
    slices, q_len, p_len = {}, 0, 0
    for items in groups.values():
        for j, q_size, p_size in items:
            slices[j] = (q_len, q_size)
            q_len += q_size
            p_len += p_size
    return slices, q_len, p_len


def _split_bucket(state: PowerSGDGuardState, index: int) -> None:
    """Move bucket ``index``'s memory into per-parameter pieces (``state.pending``)."""
    ps, layout = state.powersgd, state.layouts.pop(index)
    shapes = [state.params[i].shape for i in layout]
    error = ps.error_dict.pop(index, None)
    q = ps.q_memory_dict.pop(index, None)
    ps.p_memory_dict.pop(index, None)
    scale = state.error_scale.pop(index, None)
    slices, _, _ = _q_slices(shapes, ps.matrix_approximation_rank, ps.min_compression_rate)
    offset = 0
    for j, pos in enumerate(layout):
        piece = state.pending.setdefault(pos, {})
        size = shapes[j].numel()
        if error is not None:
            piece["error"] = error[offset : offset + size].clone()
        offset += size
        if q is not None and j in slices:
            start, length = slices[j]
            piece["q"] = q[start : start + length].clone()
        if scale is not None:
            piece["scale"] = scale.detach().clone()


def fit_layout(state: PowerSGDGuardState, bucket) -> None:
    """Before the hook runs on ``bucket``: if the memory kept under its index was laid out for
    other parameters (DDP rebuilt its buckets), cut every bucket's memory into per-parameter
    pieces; then assemble this bucket's memory from the pieces it needs."""
    ps, index = state.powersgd, bucket.index()
    layout = [state.position[id(p)] for p in bucket.parameters()]
    if state.layouts.get(index, layout) != layout:
        for other in list(state.layouts):
            _split_bucket(state, other)
    state.layouts[index] = layout
    pieces = [state.pending.get(pos, {}) for pos in layout]
    if not any(pieces):
        return
    grads = bucket.gradients()
    like = grads[0]
    if all("error" in piece for piece in pieces):
        ps.error_dict[index] = torch.cat([p["error"] for p in pieces]).to(like.device, like.dtype)
    slices, q_len, p_len = _q_slices(
        [g.shape for g in grads], ps.matrix_approximation_rank, ps.min_compression_rate
    )
    if slices and all("q" in pieces[j] for j in slices):
        q = torch.cat([pieces[j]["q"] for j in sorted(slices, key=lambda j: slices[j][0])])
        assert q.numel() == q_len
        ps.q_memory_dict[index] = q.to(like.device, like.dtype)
        ps.p_memory_dict[index] = torch.empty(p_len, device=like.device, dtype=like.dtype)
    if "scale" in pieces[0]:
        state.error_scale[index] = pieces[0]["scale"].to(like.device)
    for pos in layout:
        state.pending.pop(pos, None)


def powersgd_files(state: PowerSGDGuardState) -> tuple[dict[str, torch.Tensor], dict]:
    """This process's PowerSGD memory as per-parameter tensors (``error.<i>``, ``q.<i>``,
    ``scale.<i>``: ``i`` a parameter's position in ``model.parameters()``) and JSON counters."""
    for index in list(state.layouts):
        _split_bucket(state, index)
    tensors = {
        f"{name}.{pos}": t for pos, piece in state.pending.items() for name, t in piece.items()
    }
    ps = state.powersgd
    kind, keys, pos, has_gauss, cached = ps.rng.get_state()
    meta = {
        "iter": ps.iter,
        "rng": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "numel": [ps.total_numel_before_compression, ps.total_numel_after_compression],
        "next_stats_report": ps.next_stats_report,
        "rolled_back": state.rolled_back,
    }
    return tensors, meta


def load_powersgd(state: PowerSGDGuardState, tensors: dict, meta: dict, device) -> None:
    """Restore what :func:`powersgd_files` saved; the pieces enter the buckets as the hook meets
    them (:func:`fit_layout`)."""
    import numpy as np

    ps = state.powersgd
    ps.iter = int(meta["iter"])
    kind, keys, pos, has_gauss, cached = meta["rng"]
    ps.rng.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    ps.total_numel_before_compression, ps.total_numel_after_compression = meta["numel"]
    ps.next_stats_report = meta["next_stats_report"]
    state.rolled_back = int(meta["rolled_back"])
    ps.error_dict.clear()
    ps.p_memory_dict.clear()
    ps.q_memory_dict.clear()
    state.error_scale.clear()
    state.layouts.clear()
    state.pending.clear()
    for key, value in tensors.items():
        name, pos = key.rsplit(".", 1)
        if int(pos) >= len(state.params):
            raise ValueError(f"PowerSGD state names parameter {pos}; the model has fewer")
        state.pending.setdefault(int(pos), {})[name] = value.to(device)


@contextlib.contextmanager
def root_unsharded(model: torch.nn.Module):
    """Within the block an FSDP2 model's own (root-group) parameters are whole tensors, so code
    that calls its methods other than ``forward`` (samplers call ``condition``) works; the block
    groups still gather themselves in their forward. Every process must enter it."""
    unshard = getattr(model, "unshard", None)
    if unshard is None:
        yield
        return
    fsdp: Any = model  # an FSDP2 module (it has unshard), so it has reshard too
    unshard()
    try:
        yield
    finally:
        fsdp.reshard()


# ------------------------------------------------------------------ sharded tensors
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return ()
    return DTensor


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every process calls it, in the same
    order); other tensors as they are."""
    dt = _dtensor_type()
    if dt and isinstance(t, dt):
        return t.full_tensor()
    return t


def gather_state(state: dict, main: bool) -> dict:
    """``{name: tensor}`` with every shard gathered, on CPU, on the main process (``{}``
    elsewhere). Every process must call it; the tensors are gathered one at a time so no
    process holds more than one whole tensor beyond its shard."""
    out = {}
    for key, value in state.items():
        full = gather_full(value)
        if main:
            out[key] = full.detach().to("cpu", copy=True)
    return out


def load_full_state(live: dict, full: dict) -> None:
    """Copy the whole tensors ``full`` into ``live`` (same names): an FSDP2 shard takes its own
    slice (each process reads the files itself: no communication), other tensors the whole."""
    dt = _dtensor_type()
    with torch.no_grad():
        for key, target in live.items():
            value = full[key]
            if dt and isinstance(target, dt):
                from torch.distributed.tensor import distribute_tensor

                value = value.to(target.device, target.dtype)
                shard = distribute_tensor(
                    value, target.device_mesh, target.placements, src_data_rank=None
                )
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value.to(target.device, target.dtype))


def optimizer_state_full(optimizer, main: bool) -> dict:
    """The optimizer's state dict with each moment gathered to a whole tensor on the main process
    (the same layout an unsharded run saves); ``{}`` on the others. Every process calls it."""
    sd = optimizer.state_dict()
    state = {}
    for idx in sorted(sd["state"]):
        per = {}
        for name, value in sd["state"][idx].items():
            if isinstance(value, torch.Tensor):
                full = gather_full(value)
                value = full.detach().to("cpu", copy=True) if main else None
            per[name] = value
        state[idx] = per
    return {"state": state, "param_groups": sd["param_groups"]} if main else {}


def optimizer_state_sharded(optimizer, full: dict) -> dict:
    """``full`` (whole moments, as :func:`optimizer_state_full` saves them) with each tensor that
    belongs to an FSDP2-sharded parameter cut to this process's shard, for
    ``optimizer.load_state_dict``."""
    dt = _dtensor_type()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not dt or not any(isinstance(p, dt) for p in params):
        return full
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for idx, per in full["state"].items():
        param = params[int(idx)]
        new = {}
        for name, value in per.items():
            if isinstance(param, dt) and isinstance(value, torch.Tensor):
                if tuple(value.shape) == tuple(param.shape):
                    value = distribute_tensor(
                        value.to(param.device),
                        param.device_mesh,
                        param.placements,
                        src_data_rank=None,
                    )
            new[name] = value
        state[idx] = new
    return {"state": state, "param_groups": full["param_groups"]}


# ------------------------------------------------------------------ export
def remember_build(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> None:
    """Keep ``build`` (a zero-argument function building ``model``'s architecture) on a network
    that is no diffusers ``ModelMixin``, for :func:`full_copy` under sharding."""
    object.__setattr__(model, "rebuild", build)  # a plain attribute, not a submodule


def full_copy(model: torch.nn.Module, state: dict) -> torch.nn.Module:
    """A plain (unsharded, CPU) copy of ``model`` holding the whole weights ``state``, for writing
    a component folder under sharding. Built from the model's config (diffusers ``ModelMixin``)
    or, for a network that is no ``ModelMixin`` (the token families'), by the zero-argument
    function its trainer stored (:func:`remember_build`), on the meta device, then given the
    tensors, so no second random initialisation runs. (``type(model)`` of an FSDP2 module is
    FSDP's subclass, whose constructor cannot rebuild it.)"""
    build = getattr(model, "rebuild", None)
    if build is None:
        if not (hasattr(model, "config") and hasattr(type(model), "from_config")):
            raise TypeError(
                f"exporting a sharded {type(model).__name__} needs a diffusers ModelMixin (built "
                "from its config); train this component without FSDP/DeepSpeed"
            )
        mixin: Any = model  # a diffusers ModelMixin (checked above): config and from_config

        def build():
            return type(mixin).from_config(dict(mixin.config))

    with torch.device("meta"):
        copy = build()
    copy.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:  # non-persistent buffers are not in a state dict: build them for real
        copy = build()
        copy.load_state_dict(state, strict=True)
    return copy.eval()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"
