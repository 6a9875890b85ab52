"""A device named by the user (``--device``, ``device=``), checked before anything loads."""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["check_device"]


def check_device(device: Union[str, torch.device], option: str = "--device") -> torch.device:
    """``device`` as a ``torch.device`` if this machine has it; else a one-line ``ValueError``
    naming ``option`` and what to use instead (an unknown name, a CUDA device without a GPU or a
    driver, a GPU index past the last one)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"{option} {device} is not a torch device ({first}); use e.g. cpu, cuda or cuda:1"
        ) from None
    if dev.type == "cuda":
        # is_available() is False without a GPU, without a driver and on a CPU-only build of torch
        if not torch.cuda.is_available():
            raise ValueError(
                f"{option} {device}: no CUDA GPU is usable here (no GPU, no driver or a CPU-only "
                "build of torch); use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{option} {device}: this machine has {count} CUDA GPU(s), cuda:0 to "
                f"cuda:{count - 1}"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{option} {device}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps", "meta"):
        # xpu, hpu, ...: usable only where torch has the backend
        module = getattr(torch, dev.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ValueError(f"{option} {device}: no {dev.type} backend here; use --device cpu")
    return dev


def under_fake_tensors() -> bool:
    """Whether a :class:`~torch._subclasses.fake_tensor.FakeTensorMode` is active: the fake-CUDA
    dry runs (``unclip plan``) place components on a CUDA device no driver backs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def lengths_may_follow_values(t: torch.Tensor) -> bool:
    """Whether a length read off ``t``'s values may set the shapes that follow: not while a graph
    is compiled or traced (one graph serves every batch), nor on fake or meta tensors (they hold
    no values: the ``unclip plan`` dry runs)."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return not (is_fake(t) or under_fake_tensors() or t.device.type == "meta")
