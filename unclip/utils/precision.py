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

Autocast (the arithmetic, not the weights): :func:`resolve_autocast` turns a pipeline's
``autocast_dtype`` setting into the dtype its denoising networks run in on a device. ``"auto"``
(the default of a loaded pipeline) is float16 on a GPU, bfloat16 on a CPU that runs it natively
(:func:`native_cpu_bf16`) and full precision elsewhere, where emulated bfloat16 would be slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union, overload

import torch

__all__ = [
    "HALF_DTYPES",
    "KeepFp32Mixin",
    "cast_floating",
    "dtype_name",
    "native_cpu_bf16",
    "parse_autocast",
    "parse_dtype",
    "resolve_autocast",
]

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


def native_cpu_bf16() -> bool:
    """True iff oneDNN runs bf16 natively on this CPU (AVX-512 with bf16 support or AMX). Without
    it, bf16 autocast is emulated and much slower than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


#: the names :func:`parse_autocast` reads for "no autocast"
_NO_AUTOCAST = ("none", "no", "off", "fp32", "float32")


def parse_autocast(value, what: str = "autocast_dtype"):
    """A pipeline's autocast setting: ``None`` (full precision), ``"auto"``, ``torch.bfloat16``
    or ``torch.float16``, from those or their names (``"bf16"``, ``"fp16"``, ``"none"``/``"fp32"``
    for None). Anything else is a ``ValueError``/``TypeError`` naming ``what``."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name == "auto":
            return "auto"
        if name in _NO_AUTOCAST:
            return None
        try:
            value = parse_dtype(name, what)
        except ValueError:
            raise ValueError(
                f"{what}: unknown setting {value!r}; use auto, bf16, fp16 or none"
            ) from None
    elif value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{what} must be None, 'auto' or a torch.dtype, got {type(value).__name__}")
    if value == torch.float32:
        return None
    if value not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"{what} must be None, 'auto', torch.bfloat16 or torch.float16, got {value}"
        )
    return value


@overload
def dtype_name(dtype: torch.dtype) -> str: ...
@overload
def dtype_name(dtype: None) -> None: ...
def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """``"bfloat16"`` for ``torch.bfloat16``, None for None: how reports and JSON record a dtype."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def resolve_autocast(
    setting, device: Union[str, torch.device], weights: torch.dtype = torch.float32
) -> Optional[torch.dtype]:
    """The dtype the denoising networks run in under the autocast ``setting`` (as
    :func:`parse_autocast` returns it) on ``device`` with weights of dtype ``weights``:
    ``"auto"`` is float16 on CUDA, bfloat16 on a CPU that runs it natively, else None (full
    precision: emulated bfloat16 is slower than float32, and other devices' autocast support
    varies); with half-precision weights it is None, since the weights already set the
    arithmetic (and CPU autocast would run normalisation layers in float32 against their half
    weights)."""
    if setting != "auto":
        return setting
    if weights in HALF_DTYPES:
        return None
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.float16
    if kind == "cpu" and native_cpu_bf16():
        return torch.bfloat16
    return None


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
