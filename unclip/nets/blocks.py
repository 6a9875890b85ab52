"""Pre-LayerNorm transformer blocks with the DALL-E Mega options: NormFormer and GLU feed-forwards.

One block is ``x + Attn(LN(x))`` then ``x + FF(LN(x))`` (the layout of GPT-2 and of diffusers'
``BasicTransformerBlock``). Two options change it:

* ``normformer=True`` (Shleifer et al. 2021, "NormFormer: Improved Transformer Pretraining with
  Extra Normalization"): a LayerNorm on the attention output before the residual add,
  ``x + LN(Attn(LN(x)))``; a LayerNorm after the feed-forward's activation,
  ``x + W2 LN(act(W1 LN(x)))``; and a learned scale per attention head applied to each head's output
  before the output projection (initialised to 1). The paper's optional learned residual scaling
  is not included (NormFormer's large models and DALL-E Mega ran without it).
* ``ff_activation`` ``geglu`` / ``swiglu`` (Shazeer 2020, "GLU Variants Improve Transformer"):
  ``W2 (act(W x) ⊙ V x)`` with GELU or SiLU (Swish) as ``act``. The hidden width is 2/3 of the GELU
  feed-forward's (``ff_hidden_width``: ``(2 * ff_mult * dim) // 3``), so the three weight matrices
  hold as many weights as GELU's two (8·dim² at ``ff_mult`` 4).

Both default off, when a block computes what ``BasicTransformerBlock(dim, heads, head_dim,
activation_fn="gelu", attention_bias=True)`` computes (the diffusion prior's block).

Example::

    block = TransformerBlock(256, num_heads=4, head_dim=64, normformer=True, ff_activation="swiglu")
    causal = torch.full((S, S), float("-inf")).triu(1)   # additive mask, or bool (True = attend)
    y = block(x, attention_mask=causal)                  # x, y: [B, S, 256]
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FF_ACTIVATIONS",
    "check_block_options",
    "ff_hidden_width",
    "FeedForward",
    "SelfAttention",
    "TransformerBlock",
]

#: the feed-forward activations a block can use (``ff_activation``)
FF_ACTIVATIONS = ("gelu", "geglu", "swiglu")


def check_block_options(normformer, ff_activation) -> None:
    """``ValueError`` naming the bad value unless ``normformer`` is a bool and ``ff_activation`` one
    of :data:`FF_ACTIVATIONS`."""
    if not isinstance(normformer, bool):
        raise ValueError(f"normformer must be true or false, got {normformer!r}")
    if ff_activation not in FF_ACTIVATIONS:
        raise ValueError(
            f"ff_activation must be one of {', '.join(FF_ACTIVATIONS)}, got {ff_activation!r}"
        )


def ff_hidden_width(dim: int, ff_activation: str = "gelu", ff_mult: int = 4) -> int:
    """The feed-forward's hidden width: ``ff_mult * dim`` for GELU; for a GLU 2/3 of it, rounded
    down, so its three ``dim × hidden`` matrices match GELU's two in size (Shazeer 2020)."""
    check_block_options(False, ff_activation)
    if ff_activation == "gelu":
        return ff_mult * dim
    return (2 * ff_mult * dim) // 3


class FeedForward(nn.Module):
    """``[.., dim] → [.., dim]``: ``proj_out(dropout(norm(act(proj_in(x)))))``; for a GLU
    ``proj_in`` makes the value and the gate (``2 * hidden`` outputs) and ``act`` is
    ``value * gelu/silu(gate)``. ``inner_norm``: NormFormer's LayerNorm over the hidden units."""

    def __init__(
        self,
        dim: int,
        ff_activation: str = "gelu",
        ff_mult: int = 4,
        dropout: float = 0.0,
        inner_norm: bool = False,
        bias: bool = True,
    ):
        super().__init__()
        hidden = ff_hidden_width(dim, ff_activation, ff_mult)
        self.ff_activation = ff_activation
        glu = ff_activation != "gelu"
        self.proj_in = nn.Linear(dim, 2 * hidden if glu else hidden, bias=bias)
        self.inner_norm = nn.LayerNorm(hidden) if inner_norm else None
        self.dropout = nn.Dropout(dropout)
        self.proj_out = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        if self.ff_activation == "gelu":
            h = F.gelu(h)
        else:
            value, gate = h.chunk(2, dim=-1)
            h = value * (F.gelu(gate) if self.ff_activation == "geglu" else F.silu(gate))
        if self.inner_norm is not None:
            h = self.inner_norm(h)
        return self.proj_out(self.dropout(h))


class SelfAttention(nn.Module):
    """Multi-head self-attention ``[B, S, dim] → [B, S, dim]`` (PyTorch's fused
    ``scaled_dot_product_attention``). ``head_scale``: NormFormer's learned per-head output scale.

    ``attention_mask``: additive float (``-inf``/large negative = blocked) or bool (``True`` =
    attend), broadcastable to ``[B, heads, S, S]``; a 3-D mask is ``[B, S, S]`` or, as diffusers'
    ``PriorTransformer`` passes it, ``[B * heads, S, S]``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        bias: bool = True,
        head_scale: bool = False,
    ):
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.head_scale = nn.Parameter(torch.ones(num_heads)) if head_scale else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x [B, S, dim]``, each ``[B, heads, S, head_dim]``."""
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        return heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The output ``[B, S_q, dim]`` for projected queries against keys and values, which may
        hold more positions than the queries (the prior's cached text prefix)."""
        b, _, s, _ = q.shape
        if attention_mask is not None:
            if attention_mask.dim() == 3:  # [B, S, S] or diffusers' [B * heads, S, S]
                attention_mask = attention_mask.view(b, -1, *attention_mask.shape[-2:])
            if attention_mask.dtype != torch.bool:
                attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # [B, H, S, Dh]
        if self.head_scale is not None:
            out = out * self.head_scale.to(out.dtype).view(1, -1, 1, 1)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.dropout(self.to_out(out))

    def forward(
        self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.attend(*self.project(x), attention_mask)


class TransformerBlock(nn.Module):
    """One pre-LayerNorm block ``[B, S, dim] → [B, S, dim]`` (see the module doc).

    Args:
        dim: the residual stream's width.
        num_heads, head_dim: attention heads and their width (``num_heads * head_dim`` need not
            equal ``dim``).
        dropout: on the attention output and the feed-forward's hidden units (training only).
        normformer: NormFormer's post-attention and post-activation LayerNorms and head scales.
        ff_activation: ``gelu``, ``geglu`` or ``swiglu`` (:data:`FF_ACTIVATIONS`).
        ff_mult: the GELU feed-forward's hidden width in multiples of ``dim`` (GLUs take 2/3).
        bias: biases in the attention and feed-forward projections.

    ``forward(hidden_states, attention_mask=None)``: the mask as :class:`SelfAttention` takes it.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        *,
        dropout: float = 0.0,
        normformer: bool = False,
        ff_activation: str = "gelu",
        ff_mult: int = 4,
        bias: bool = True,
    ):
        super().__init__()
        check_block_options(normformer, ff_activation)
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, head_dim, dropout, bias, head_scale=normformer)
        self.attn_out_norm = nn.LayerNorm(dim) if normformer else None
        self.ff_norm = nn.LayerNorm(dim)
        self.ff = FeedForward(
            dim, ff_activation, ff_mult, dropout, inner_norm=normformer, bias=bias
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        h = self.attn(self.attn_norm(hidden_states), attention_mask)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        hidden_states = hidden_states + h
        return hidden_states + self.ff(self.ff_norm(hidden_states))
