"""Attention memory options, a capability of the pipeline families whose networks use diffusers'
attention layers (:class:`MemoryMixin`)::

    pipe.enable_attention_slicing()        # attention computed a few heads at a time
    pipe.disable_attention_slicing()       # back to PyTorch's scaled-dot-product attention
    pipe.enable_xformers_memory_efficient_attention()   # CUDA + the [xformers] extra

Slicing trades speed for peak memory: the attention matrix of only ``slice_size`` heads exists at
once (``"auto"``: half the heads, ``"max"``: one head). Results equal the unsliced ones to float
rounding. A pipeline's ``to`` turns xformers on by itself when the pipeline moves to a CUDA
device and the ``xformers`` package is installed (``pipe.use_xformers = False`` keeps it off).
"""

from __future__ import annotations

import importlib.util
from typing import Union

import torch

from unclip.pipeline.base import BasePipeline

__all__ = ["MemoryMixin", "xformers_available"]


def xformers_available() -> bool:
    return importlib.util.find_spec("xformers") is not None


def _attention_modules(net: torch.nn.Module):
    from diffusers.models.attention_processor import Attention

    return [m for m in net.modules() if isinstance(m, Attention)]


def _sliced_without_temb(slice_size: int):
    """diffusers' :class:`SlicedAttnProcessor` taking (and dropping) the ``temb`` that the UNets'
    attention blocks pass: ``temb`` feeds only an attention's spatial norm, which these networks
    do not have (checked where it is used), and without the parameter diffusers logs that it is
    ignored once per attention call."""
    from diffusers.models.attention_processor import SlicedAttnProcessor

    class SlicedAttn(SlicedAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     temb=None):  # fmt: skip
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)

    return SlicedAttn(slice_size)


class MemoryMixin(BasePipeline):
    """Attention slicing and xformers for every denoising network (see the module doc)."""

    #: ``"auto"``: enable xformers in :meth:`to` on CUDA when installed; False: never
    use_xformers: Union[str, bool] = "auto"

    def enable_attention_slicing(self, slice_size: Union[str, int] = "auto") -> None:
        """Compute attention ``slice_size`` heads at a time in every denoiser (``"auto"``: half
        of each layer's heads, ``"max"``: one)."""
        if slice_size not in ("auto", "max") and (
            isinstance(slice_size, bool) or not isinstance(slice_size, int) or slice_size < 1
        ):
            raise ValueError(
                f"slice_size must be 'auto', 'max' or an integer >= 1, got {slice_size!r}"
            )
        # the processors to put back: diffusers' own "unsliced" choice is not always the one the
        # layer had (AttnAddedKVProcessor2_0 comes back as the slower AttnAddedKVProcessor)
        saved = self.__dict__.setdefault("_unsliced_processors", {})
        for net in self.denoisers().values():
            for attn in _attention_modules(net):
                saved.setdefault(attn, attn.processor)
                heads = attn.sliceable_head_dim
                if isinstance(slice_size, str):
                    size = {"auto": max(1, heads // 2), "max": 1}[slice_size]
                else:
                    size = slice_size
                attn.set_attention_slice(min(int(size), heads))
                if (
                    type(attn.processor).__name__ == "SlicedAttnProcessor"
                    and attn.spatial_norm is None
                ):
                    attn.set_processor(_sliced_without_temb(min(int(size), heads)))

    def disable_attention_slicing(self) -> None:
        """Full attention again: each layer's processor from before slicing (PyTorch's
        scaled-dot-product attention), so the images are those of a pipeline never sliced."""
        saved = self.__dict__.pop("_unsliced_processors", {})
        for net in self.denoisers().values():
            for attn in _attention_modules(net):
                if attn in saved:
                    attn.set_processor(saved[attn])
                else:
                    attn.set_attention_slice(None)

    def enable_xformers_memory_efficient_attention(self) -> None:
        """xformers' memory-efficient attention in every denoiser; needs a CUDA device and the
        ``xformers`` package (``pip install 'unclip[xformers]'``)."""
        if not xformers_available():
            raise ValueError(
                "xformers is not installed: pip install 'unclip[xformers]' (CUDA only); PyTorch's "
                "scaled-dot-product attention is used without it"
            )
        if self.device.type != "cuda":
            raise ValueError(
                f"xformers attention runs on CUDA only; the pipeline is on {self.device} "
                "(move it with pipe.to('cuda') first)"
            )
        for net in self.denoisers().values():
            for attn in _attention_modules(net):
                attn.set_use_memory_efficient_attention_xformers(True)
        self._xformers_on = True

    def disable_xformers_memory_efficient_attention(self) -> None:
        for net in self.denoisers().values():
            for attn in _attention_modules(net):
                attn.set_use_memory_efficient_attention_xformers(False)
        self._xformers_on = False

    def _device_changed(self) -> None:
        super()._device_changed()
        self._auto_xformers()

    def _auto_xformers(self) -> None:
        """Called when the components move: xformers on when on CUDA, installed, not turned off
        and no attention slicing was asked for; off again when the pipeline leaves CUDA (its
        kernels are CUDA only)."""
        if self.use_xformers != "auto" or not xformers_available():
            return
        if self.device.type != "cuda":
            if getattr(self, "_xformers_on", False):
                self.disable_xformers_memory_efficient_attention()
            return
        sliced = any(
            type(a.processor).__name__.startswith("SlicedAttn")
            for net in self.denoisers().values()
            for a in _attention_modules(net)
        )
        if not sliced:
            self.enable_xformers_memory_efficient_attention()
