"""Real CPU training steps counted by the dry run's :class:`~unclip.train.plan.MemoryTracker`: what
the plan's method (:func:`~unclip.train.plan.measure_step` and the arithmetic of
:mod:`unclip.train.strategies`) is checked against, for one process and for FSDP2 over several
CPU processes (``torchrun``, gloo)."""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Iterator

import torch

from unclip.train.loop import TrainLoop
from unclip.train.plan import MemoryTracker
from unclip.train.plan_build import _build, _synthetic_batch

__all__ = ["real_cpu_step_peak", "fsdp_storage_resizes"]


@contextlib.contextmanager
def fsdp_storage_resizes(mem: MemoryTracker) -> Iterator[None]:
    """Within the block ``mem`` follows FSDP2's gathered weights: FSDP2 frees a unit's whole
    weights after its forward and backward by resizing their storages to 0 bytes, and gathers them
    again into the same storages, neither of which is an op a dispatch mode sees. Its two helpers
    are wrapped to tell the tracker (they are module globals of FSDP2's parameter code)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_counted(tensor: torch.Tensor) -> None:
        alloc(tensor)
        mem.resized(tensor)

    def free_counted(tensor: torch.Tensor) -> None:
        free(tensor)
        mem.resized(tensor)

    patched = [
        (_fsdp_param, "alloc_storage", alloc_counted),
        (_fsdp_param, "free_storage", free_counted),
        (_fsdp_param_group, "alloc_storage", alloc_counted),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, value in patched:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def real_cpu_step_peak(cfg) -> int:
    """The tracker's peak over a real CPU training step of ``cfg`` (real backward; the second, so
    that the optimizer's moments exist) with ``train.grad_accum_steps`` micro-batches of its
    synthetic batch: what
    :func:`~unclip.train.plan.measure_step` with ``device_type="cpu"`` estimates, to check the
    method against. Under a multi-process FSDP launch (``torchrun`` with an FSDP config's
    environment) it is this process's peak of an FSDP2 step, the gathered weights included."""
    from unclip.nets.clip import CLIP

    cfg = copy.deepcopy(cfg)
    with tempfile.TemporaryDirectory(prefix="unclip-plan-") as tmp:
        cfg.train.output_dir = tmp
        loop = TrainLoop(cfg, overwrite=True)
        mem = MemoryTracker("cpu")
        try:
            with mem, fsdp_storage_resizes(mem):
                torch.manual_seed(cfg.train.seed)
                clip = CLIP.from_config(cfg.clip)
                model, task = _build(cfg, clip, "cpu", loop.mixed_precision)
                model = loop.prepare(model)
                model.train()
                batches = [_synthetic_batch(cfg, clip, cfg.data.batch_size)]
                batches *= cfg.train.grad_accum_steps
                # the first step makes AdamW's moments after its backward; from the second on
                # they are there throughout, as in the plan
                loop.run_step(task, batches)
                mem.reset_peak()
                loop.run_step(task, batches)
        finally:
            loop.accelerator.end_training()
            loop.release_output_dir()
    return mem.peak
