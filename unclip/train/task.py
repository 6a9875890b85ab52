"""What a training stage gives the loop (:class:`Task`: its model, batches, loss and samples) and
how many samples a batch holds."""

from __future__ import annotations

from typing import Protocol

import torch


class Task(Protocol):
    """What a stage supplies to :class:`TrainLoop`.

    ``name``: the component this stage trains (``prior``, ``decoder``, ``sr64``, ``clip``).
    ``loss(model, batch, generators)``: the scalar loss of one micro-batch; ``model`` is the
    prepared (possibly DDP-wrapped) model, ``generators`` one ``torch.Generator`` per sample of
    ``batch``.

    Optional methods: ``sample_grid(model, batch) -> PIL.Image`` (called on the main process with
    the EMA weights in place, in eval mode, every ``train.sample_every`` steps; ``batch`` is the
    first micro-batch of the run), ``after_optimizer_step(model)`` (after each optimizer step
    that was taken, before the EMA update) and ``log_metrics() -> dict`` (the task's own figures
    since the last log, e.g. one term of its loss, logged beside the loss every
    ``train.log_every`` steps).
    """

    name: str

    def loss(self, model: torch.nn.Module, batch: dict, generators: list) -> torch.Tensor: ...


def batch_size_of(batch: dict) -> int:
    """Number of samples in a collated batch (every batch carries its captions)."""
    return len(batch["caption"])
