"""Weight dtypes: casting a component to float16/bfloat16 while the tensors whose precision the
numerics depend on stay float32.

    pipe = UnCLIPPipeline.from_pretrained("shapes", torch_dtype=torch.bfloat16)
    pipe.to(torch.float16)            # the same rule
    pipe.prior.transformer.clip_mean.dtype  # torch.float32

Which tensors stay float32, and why:

* the prior's embedding statistics (``clip_mean``/``clip_std``, ``[1, D]`` each): every sampled
  image embedding is ``x_0 * std + mean`` computed in float32, so statistics rounded to bfloat16's
  8 bits of mantissa would add an error of their own to every embedding, which ``2·D`` float32
  numbers avoid.

A component class lists them, as diffusers does, in ``_keep_in_fp32_modules`` (parts of the
parameters' dotted names): diffusers' ``from_pretrained(torch_dtype=...)`` reads the list, and
:class:`KeepFp32Mixin` applies it to ``.to(dtype)``. Casting to float32 or float64 casts every
floating tensor.

Everything else follows the requested dtype; benchmarks/README.md (``bench_dtype.py``) shows what
keeping more in float32 (the CLIP's LayerNorms and embeddings, the sampler's arithmetic) changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

__all__ = ["HALF_DTYPES", "KeepFp32Mixin", "cast_floating", "parse_dtype"]

#: dtypes in which the tensors a component keeps in float32 are not cast
HALF_DTYPES = (torch.float16, torch.bfloat16)
_NAMES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value: Union[str, torch.dtype, None], what: str = "torch_dtype"):
    """``None`` or a floating ``torch.dtype`` from a dtype or its name (``"float16"``, ``"bf16"``,
    ``"float32"``...); anything else is a ``ValueError``/``TypeError`` naming ``what``."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = _NAMES.get(value.strip().lower().removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{what}: unknown dtype {value!r}; use float16, bfloat16 or float32")
    else:
        raise TypeError(f"{what} must be a torch.dtype or its name, got {type(value).__name__}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(
            f"{what} must be a floating dtype (float16, bfloat16, float32), got {dtype}"
        )
    return dtype


def _kept(name: str, keep: Sequence[str]) -> bool:
    # the rule of diffusers' loader (load_model_dict_into_meta): one of the dotted name's parts
    return any(k in name.split(".") for k in keep)


def cast_floating(
    module: torch.nn.Module, dtype: torch.dtype, keep: Optional[Sequence[str]] = None
) -> torch.nn.Module:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place, except that when
    ``dtype`` is float16/bfloat16 those with one of ``keep`` as a part of their dotted name become
    float32.
    Parameters stay the same objects (as ``torch.nn.Module.to`` does), so references to them stay
    valid. Returns ``module``."""
    keep = tuple(keep or ())
    low = dtype in HALF_DTYPES

    def target(name: str, t: torch.Tensor) -> Optional[torch.dtype]:
        if not t.is_floating_point():
            return None
        want = torch.float32 if low and _kept(name, keep) else dtype
        return want if t.dtype != want else None

    with torch.no_grad():
        for name, p in module.named_parameters():
            want = target(name, p)
            if want is not None:
                p.data = p.data.to(want)
                if p.grad is not None:
                    p.grad.data = p.grad.data.to(want)
        for name, b in list(module.named_buffers()):
            want = target(name, b)
            if want is not None:
                owner, _, attr = name.rpartition(".")
                module.get_submodule(owner)._buffers[attr] = b.to(want)
    return module


class KeepFp32Mixin:
    """For diffusers ``ModelMixin`` subclasses (listed before it): ``.to(dtype)`` keeps the
    class's ``_keep_in_fp32_modules`` in float32 when casting to float16/bfloat16.

    diffusers' own ``ModelMixin.to`` casts every tensor and logs "There are modules in X that
    should be kept in float32: [...]" whenever a dtype is given (for an empty list too); here the
    dtype is applied by :func:`cast_floating`, following the list, and only the device and memory
    format go through ``ModelMixin.to``, so nothing is cast against the list and nothing is
    logged."""

    _keep_in_fp32_modules: Optional[list[str]] = None

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None:
            return super().to(*args, **kwargs)
        if not dtype.is_floating_point:
            raise TypeError(
                f"{type(self).__name__}.to: dtype must be a floating dtype, got {dtype}"
            )
        moves = {"device": device, "memory_format": memory_format}
        moves = {k: v for k, v in moves.items() if v is not None}
        if moves:
            super().to(non_blocking=non_blocking, **moves)
        return cast_floating(self, dtype, self._keep_in_fp32_modules)
