"""Where and in what arithmetic an :class:`~unclip.pipeline.pipeline.UnCLIPPipeline` runs: device
and dtype, autocast, memory format, and compiled denoisers."""

from __future__ import annotations

import logging
from typing import Optional, Self

import torch

from unclip.pipeline.base import PipelineBase
from unclip.utils.precision import parse_autocast, parse_dtype, resolve_autocast

_log = logging.getLogger(__name__)


class DevicesMixin(PipelineBase):
    """Where and in what arithmetic a pipeline runs: device and dtype, autocast, memory format,
    and compiled denoisers."""

    @property
    def device(self) -> torch.device:
        """Where sampling runs: the components' device, or the execution device of
        :meth:`enable_model_cpu_offload` (the components then wait on the CPU)."""
        if self._offloader is not None:
            return self._offloader.device
        sequential = getattr(self, "_sequential_device", None)
        if sequential is not None:  # the weights wait on the CPU (or the meta device)
            return sequential
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def to(self, device=None, dtype=None, memory_format=None) -> Self:
        """Move every component: ``pipe.to("cuda")``, ``pipe.to(torch.float16)``,
        ``pipe.to("cuda", torch.bfloat16)``. Casting to float16/bfloat16 keeps the tensors the
        numerics need in float32 (:mod:`unclip.precision`). ``memory_format=torch.channels_last``
        stores the image networks' conv weights NHWC, which makes their activations NHWC too
        (faster convolutions on CPUs with oneDNN, same results to float rounding; see
        benchmarks/README.md). With model offload on, a device ends it (every component then
        moves there); a dtype alone casts the waiting components and keeps it."""
        if isinstance(device, torch.dtype):  # pipe.to(torch.float16), as diffusers' pipelines
            device, dtype = None, device if dtype is None else dtype
        if self._offloader is not None:
            if device is not None:
                self.disable_model_cpu_offload()
            else:
                self._offloader.offload_all()  # cast the CPU copies, not a device copy
        dtype = parse_dtype(dtype, "dtype")
        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        for m in self.modules().values():
            m.to(**kwargs)
        if memory_format is not None:
            for m in [self.decoder, *self.upsamplers]:
                # diffusers types ModelMixin.to through functools.wraps, as an unbound call
                m.to(memory_format=memory_format)  # type: ignore[call-arg]
        self._null_text = None
        self._auto_xformers()
        return self

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype every denoising network call runs in under ``torch.autocast`` on the
        pipeline's device, or ``None`` (full precision). Weights, latents, guidance and the
        scheduler stay in the pipeline's dtype.

        Set it to ``None``, ``torch.bfloat16``/``torch.float16`` (or their names) or ``"auto"``:
        float16 on a GPU, bfloat16 on a CPU that runs it natively (AVX512-BF16/AMX), else
        ``None``, and ``None`` with float16/bfloat16 weights
        (:func:`unclip.precision.resolve_autocast`); ``"auto"`` follows the pipeline when it moves
        or is cast. A constructed pipeline starts at ``None``; :meth:`from_pretrained` and
        :meth:`from_components` start at ``"auto"``. Reduced precision is faster and changes
        images slightly (benchmarks/README.md measures both, docs/shapes_model.md the shapes
        evaluator's figures); :attr:`autocast_setting` is what was set."""
        return resolve_autocast(self._autocast_dtype, self.device, self.dtype)

    @autocast_dtype.setter
    def autocast_dtype(self, dtype) -> None:
        self._autocast_dtype = parse_autocast(dtype)

    @property
    def autocast_setting(self):
        """What :attr:`autocast_dtype` was set to: ``None``, ``"auto"`` or a dtype."""
        return self._autocast_dtype

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks of every sampling step (prior transformer, decoder UNet, upsampler UNets),
        which the speed and memory options act on. The prior's sampler runs its transformer's
        blocks itself, over the text positions once and three positions per step
        (:meth:`~unclip.prior.UnCLIPPrior.conditioned`), unless the transformer is compiled."""
        nets = {}
        if self.prior is not None:
            nets["prior"] = self.prior.transformer
        nets["decoder"] = self.decoder.unet
        for name, up in zip(self.upsampler_names, self.upsamplers):
            nets[name] = up.unet
            if up.final_unet is not None:
                nets[f"{name}.final"] = up.final_unet
        return nets

    def compile(self, **kwargs) -> Self:
        """``torch.compile`` every network in :meth:`denoisers` in place (``kwargs`` go to
        ``torch.compile``, e.g. ``mode="max-autotune"``); weights and state-dict names are
        unchanged. The first call of each stage compiles (minutes for a mid-size UNet on a CPU); see
        benchmarks/README.md for when it pays. A one-line notice says so when it is asked for."""
        nets = self.denoisers()
        _log.warning(
            "compiling %s with torch.compile: the first call of each stage compiles it, which "
            "takes minutes on a CPU (later calls and shapes already seen are fast)",
            ", ".join(nets),
        )
        for net in nets.values():
            net.compile(**kwargs)
        return self
