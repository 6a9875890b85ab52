"""The optimizers ``train.optimizer`` names, and their state as a checkpoint holds it.

============== ===================================================================================
``adamw``      ``torch.optim.AdamW``
``adamw8bit``  bitsandbytes' 8-bit AdamW (the moments take a quarter of the memory; GPU only)
``soap``       heavyball's ``SOAP`` (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo
               using Adam"): Adam run in the eigenbasis of Shampoo's Kronecker-factored
               preconditioner, the basis refreshed every ``precondition_frequency`` steps
``kl_shampoo`` heavyball's ``KLShampoo`` (Lin et al. 2025, "Understanding and Improving Shampoo
               and SOAP via Kullback-Leibler Minimization"): Shampoo's Kronecker-factored
               preconditioner applied to the momentum, with the factors estimated by KL
               minimisation. heavyball ships no other Shampoo; DALL-E Mega trained with Google's
               Distributed Shampoo (Anil et al. 2020: grafting, blocked preconditioners), which
               this is not
============== ===================================================================================

``soap`` and ``kl_shampoo`` come from heavyball (``pip install unclip[optim]``), imported only when
asked for. Their hyperparameters are ``train`` settings (:class:`~unclip.train.config.TrainConfig`):
``adam_betas`` (the Adam / momentum betas), ``adam_eps``, ``weight_decay`` (decoupled, per
parameter group, as AdamW), ``precondition_frequency``, ``shampoo_beta`` (the running average of
the Kronecker factors), ``max_precond_dim`` (a dimension larger than this is not preconditioned)
and ``precondition_1d`` (precondition biases and norms too). heavyball's own warmup is off: the
loop's warmup-cosine schedule sets the learning rate, and gradient clipping happens before
``step`` as for AdamW. heavyball compiles its update with ``torch.compile`` by default;
``optimizer_compile=false`` (the default) runs it eagerly instead, since compiling takes tens of
seconds even for a toy model on a CPU. heavyball reads that choice from a module setting, so it
holds for the whole process.

A heavyball state dict nests its per-parameter state and keeps tensors in its parameter groups;
:func:`checkpoint_state` makes it fit the checkpoint files (safetensors and JSON,
:func:`unclip.train.checkpoint.optimizer_files`) by dropping the one entry heavyball pickles (its
preconditioning schedule, rebuilt from the constructor's arguments). Resuming restores every
other tensor and counter, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from unclip.utils.precision import resolve_autocast

__all__ = ["OPTIMIZERS", "PRECONDITIONED", "make_optimizer", "checkpoint_state"]

#: ``train.optimizer`` values
OPTIMIZERS = ("adamw", "adamw8bit", "soap", "kl_shampoo")
#: the Kronecker-factored ones (heavyball), which take the preconditioner settings
PRECONDITIONED = ("soap", "kl_shampoo")


def _heavyball():
    try:
        import heavyball
    except ImportError:
        raise ImportError(
            "train.optimizer=soap and kl_shampoo need heavyball, which is not installed: "
            "pip install 'unclip[optim]' (or pip install heavyball), or use train.optimizer=adamw"
        ) from None
    return heavyball


def make_optimizer(
    name: str,
    groups: list[dict],
    *,
    lr: float,
    betas,
    eps: float,
    precondition_frequency: int = 10,
    shampoo_beta: float = 0.95,
    max_precond_dim: int = 2048,
    precondition_1d: bool = False,
    compile: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over the parameter ``groups`` (each with its
    ``weight_decay``). The preconditioner settings apply to :data:`PRECONDITIONED` only."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ImportError(
                "train.optimizer=adamw8bit needs bitsandbytes, which is not installed: "
                "pip install bitsandbytes (it needs a CUDA GPU), or use train.optimizer=adamw"
            ) from None
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=tuple(betas), eps=eps)
    if name in PRECONDITIONED:
        heavyball = _heavyball()
        heavyball.utils.compile_mode = "max-autotune-no-cudagraphs" if compile else None
        # heavyball notes that the learning rate changed between steps (the loop's schedule sets
        # it every step), which it supports with multi_tensor=True, the setting used here
        warnings.filterwarnings("ignore", message="Learning rate changed between steps")
        extra = {}
        if name == "kl_shampoo":
            # heavyball's KL-Shampoo perturbs the gradients it accumulates into the Kronecker
            # factors with noise from torch's global generator (``dampening``); off, every DDP
            # process computes the same factors from the same all-reduced gradients whatever its
            # random state (the factors start at init_factor * I, so they stay full rank)
            extra["dampening"] = 0.0
        cls = heavyball.SOAP if name == "soap" else heavyball.KLShampoo
        return cls(
            groups,
            **extra,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            shampoo_beta=shampoo_beta,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            precondition_1d=precondition_1d,
            warmup_steps=0,
            multi_tensor=True,
        )
    raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def checkpoint_state(optimizer) -> dict:
    """``optimizer.state_dict()`` without what a checkpoint must not hold: heavyball pickles its
    preconditioning schedule (a function) into ``state_dict()["heavyball"]``; the checkpoint keeps
    that entry's plain values (the schedule's counters among them) and the optimizer, built from
    the same config, already has the schedule."""
    sd = optimizer.state_dict()
    extra = sd.get("heavyball")
    if isinstance(extra, dict):
        sd = dict(sd)
        sd["heavyball"] = {k: v for k, v in extra.items() if k != "precond_schedule"}
    return sd


def warmup_cosine(step: int, *, warmup: int, total: int, base_lr: float, min_lr: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from ``base_lr`` to
    ``min_lr``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    lr = min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))
    return lr / base_lr


def auto_mixed_precision(
    requested: str, gpu: bool | None = None, launched: str | None = None
) -> str:
    """Resolve ``mixed_precision: auto``: the launch's half precision if it names one
    (``launched``: ``accelerate launch``'s ``ACCELERATE_MIXED_PRECISION``, from the Accelerate
    config's ``mixed_precision``: configs/accelerate/*_bf16.yaml ask for bf16), else fp16 (with loss
    scaling) on a GPU, bf16 on a CPU that runs it natively, else ``no`` (fp32): the rule of
    :func:`unclip.utils.precision.resolve_autocast`, which sampling follows too. A launch's ``no``
    is Accelerate's default when a config names nothing, so it leaves ``auto`` to that rule, and so
    does a launch's ``fp16`` without a GPU (Accelerate refuses fp16 on CPUs). ``gpu``: whether the
    training runs on a GPU (default: whether one is available). Other values are returned
    unchanged."""
    if requested != "auto":
        return requested
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if launched == "bf16" or (launched == "fp16" and gpu):
        return launched
    dtype = resolve_autocast("auto", "cuda" if gpu else "cpu")
    return {torch.float16: "fp16", torch.bfloat16: "bf16", None: "no"}[dtype]


def run_mixed_precision(requested: str, gpu: bool | None = None) -> str:
    """The precision a run trains in: ``requested`` (``train.mixed_precision``) resolved by
    :func:`auto_mixed_precision` with this process's launch precision (``accelerate launch
    --mixed_precision``, or its config's, sets ``ACCELERATE_MIXED_PRECISION``), as
    :class:`~unclip.train.loop.TrainLoop` hands it to Accelerate."""
    return auto_mixed_precision(
        requested, gpu, launched=os.environ.get("ACCELERATE_MIXED_PRECISION")
    )
