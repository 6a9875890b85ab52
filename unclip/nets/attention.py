"""Attention with the scores materialised, for the decoder's added-KV attention blocks in bf16 on a
CPU.

PyTorch's CPU flash-attention kernel computes bf16 at about its fp32 rate, and its backward is
slow; in the bf16 training step of the decoder, computing ``q kᵀ``, the softmax and ``p v`` as
plain bf16 matrix products is faster (measured in benchmarks/README.md, "What bounds the step").
The cost: the scores of every attention layer are kept for the backward (memory
quadratic in the tokens, where the fused kernel's is linear) and they are rounded to bf16 before
the softmax (about twice the fused kernel's rounding error against fp32). In sampling's forward
pass alone it is not faster, so only the training step uses it.

:func:`explicit_attention` swaps the processors of diffusers' ``AttnAddedKVProcessor2_0`` blocks
for :class:`ExplicitAddedKVProcessor` for the span of a ``with`` block and puts them back after.

Activation checkpointing recomputes a block in backward, after such a block has ended: the training
tasks choose the attention (these processors, or PyTorch's math kernel for SDPA) around the loss
only, and a recompute with another attention saves other tensors, which PyTorch refuses
(``CheckpointError``). :func:`checkpoint` recomputes with the attention its forward ran.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, tokens, heads * dim]`` -> ``[batch, heads, tokens, dim]`` (a view)."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


class ExplicitAddedKVProcessor:
    """The computation of diffusers' ``AttnAddedKVProcessor2_0`` (the image tokens attend to the
    projected conditioning tokens followed by themselves), with the attention as two matrix
    products and a softmax instead of ``scaled_dot_product_attention``."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        b, c = hidden_states.shape[:2]
        x = hidden_states.view(b, c, -1).transpose(1, 2)  # [batch, pixels, channels]
        mask = attn.prepare_attention_mask(attention_mask, x.shape[1], b, out_dim=4)
        if encoder_hidden_states is None:
            context = x
        elif attn.norm_cross:
            context = attn.norm_encoder_hidden_states(encoder_hidden_states)
        else:
            context = encoder_hidden_states
        x = attn.group_norm(x.transpose(1, 2)).transpose(1, 2)
        h = attn.heads
        q = _split_heads(attn.to_q(x), h)
        k = _split_heads(attn.add_k_proj(context), h)
        v = _split_heads(attn.add_v_proj(context), h)
        if not attn.only_cross_attention:
            k = torch.cat([k, _split_heads(attn.to_k(x), h)], dim=2)
            v = torch.cat([v, _split_heads(attn.to_v(x), h)], dim=2)
        # the scale SDPA uses by default (the processor this one stands in for passes none)
        scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.to(scores.dtype)
        out = torch.matmul(scores.softmax(dim=-1), v)
        out = out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[-1])
        out = attn.to_out[1](attn.to_out[0](out))
        return out.transpose(-1, -2).reshape(residual.shape) + residual


#: one stateless instance for every block and step: a compiled model's guards see the same object
_EXPLICIT = ExplicitAddedKVProcessor()


@contextlib.contextmanager
def explicit_attention(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Run ``model``'s added-KV attention blocks with :class:`ExplicitAddedKVProcessor` inside the
    block (yields how many were swapped; 0 when ``enabled`` is false), their own processors
    after."""
    from diffusers.models.attention_processor import Attention, AttnAddedKVProcessor2_0

    swapped: list[tuple[Attention, Any]] = []
    if enabled:
        for m in model.modules():
            if isinstance(m, Attention) and type(m.processor) is AttnAddedKVProcessor2_0:
                swapped.append((m, m.processor))
                m.processor = _EXPLICIT
    try:
        yield len(swapped)
    finally:
        for m, processor in swapped:
            m.processor = processor


def recompute_as_forward(
    module: Optional[torch.nn.Module] = None,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (called when the forward runs):
    nothing around the forward, and around the recompute the SDPA kernels enabled now and the
    attention processors ``module``'s layers (diffusers' ``Attention``) have now."""
    backends = _cur_sdpa_kernel_backends()
    processors = (
        []
        if module is None
        else [(m, m.processor) for m in module.modules() if hasattr(m, "processor")]
    )
    return contextlib.nullcontext(), _as_before(backends, processors)


@contextlib.contextmanager
def _as_before(backends: list, processors: list[tuple[torch.nn.Module, Any]]) -> Iterator[None]:
    now = [(m, m.processor) for m, _ in processors]
    kernels = (
        contextlib.nullcontext()
        if set(_cur_sdpa_kernel_backends()) == set(backends)
        else sdpa_kernel(backends)
    )
    try:
        for m, processor in processors:
            m.processor = processor
        with kernels:
            yield
    finally:
        for m, processor in now:
            m.processor = processor


def checkpoint(function: Callable, *args, module: Optional[torch.nn.Module] = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` (non-reentrant) whose
    recompute runs the attention this forward ran (:func:`recompute_as_forward`; ``module``: the
    module whose attention layers' processors to keep, ``function`` itself if it is a module)."""
    if module is None and isinstance(function, torch.nn.Module):
        module = function
    context = functools.partial(recompute_as_forward, module)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=context, **kwargs
    )
