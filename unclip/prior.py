"""The diffusion prior: CLIP text → CLIP image embedding (Ramesh et al. 2022, §2.2).

:class:`UnCLIPPrior` wraps diffusers' ``PriorTransformer`` (a causal transformer over
``[text tokens (L), text_embed, time, x_t, prediction token]``) with the unCLIP glue:

* embedding normalisation: the diffusion runs on ``(image_embed − mean) / std`` with per-dimension
  statistics stored with the weights (``set_embedding_stats``), as in Karlo;
* a projection of the text token states ``[B, L, W]`` to the embedding width ``D`` when ``W != D``;
* ``x_0`` prediction (the transformer predicts the clean normalised embedding);
* optionally DALL-E Mega's transformer recipe (``normformer``, ``ff_activation``): the
  transformer's blocks are then :class:`~unclip.transformer_blocks.TransformerBlock` instead of
  diffusers' ``BasicTransformerBlock`` (embeddings, masks and output head stay diffusers'). With
  both options at their defaults the network is diffusers' ``PriorTransformer`` unchanged, so
  existing weights load and export as before; a prior with either option cannot be exported to
  diffusers (:func:`unclip.interop.diffusers.export_problems` says so).

The unconditional input for classifier-free guidance is the CLIP encoding of the empty caption (as
in Karlo and diffusers), so exported weights sample identically elsewhere.
"""

from __future__ import annotations

import torch
from diffusers import ModelMixin, PriorTransformer
from diffusers.configuration_utils import ConfigMixin, register_to_config

from unclip.clip import TextEncoding
from unclip.precision import KeepFp32Mixin
from unclip.transformer_blocks import TransformerBlock, check_block_options

__all__ = ["UnCLIPPrior"]


class PriorLoading:
    """Building and loading shared by both priors (diffusion and autoregressive): sized from a
    CLIP, loaded from safetensors only."""

    @classmethod
    def from_clip(cls, clip, **kwargs):
        """A prior sized for ``clip`` (a :class:`~unclip.clip.CLIP`)."""
        return cls(
            embed_dim=clip.embed_dim,
            text_width=clip.text_width,
            context_length=clip.context_length,
            **kwargs,
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader restricted to safetensors weights (pickles can run code: refused)."""
        from unclip.io import safe_model_from_pretrained

        return safe_model_from_pretrained(
            super().from_pretrained, pretrained_model_name_or_path, "prior", **kwargs
        )


class UnCLIPPrior(PriorLoading, KeepFp32Mixin, ModelMixin, ConfigMixin):
    """Prior network. ``forward(x_t [B,D], t [B], text) → x_0 prediction [B,D]`` (normalised
    space). ``normformer`` / ``ff_activation``: see :mod:`unclip.transformer_blocks`."""

    # the embedding statistics stay float32 in a float16/bfloat16 prior (unclip.precision)
    _keep_in_fp32_modules = ["clip_mean", "clip_std"]

    @register_to_config
    def __init__(
        self,
        embed_dim: int = 768,
        text_width: int = 768,
        context_length: int = 77,
        num_layers: int = 24,
        num_attention_heads: int = 32,
        attention_head_dim: int = 64,
        dropout: float = 0.0,
        normformer: bool = False,
        ff_activation: str = "gelu",
    ):
        super().__init__()
        check_block_options(normformer, ff_activation)
        self.transformer = PriorTransformer(
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            num_layers=num_layers,
            embedding_dim=embed_dim,
            num_embeddings=context_length,
            additional_embeddings=4,
            dropout=dropout,
        )
        if normformer or ff_activation != "gelu":
            # diffusers' PriorTransformer runs whatever sits in transformer_blocks as
            # block(hidden_states, attention_mask=[B * heads, S, S] additive mask)
            self.transformer.transformer_blocks = torch.nn.ModuleList(
                TransformerBlock(
                    num_attention_heads * attention_head_dim,
                    num_attention_heads,
                    attention_head_dim,
                    dropout=dropout,
                    normformer=normformer,
                    ff_activation=ff_activation,
                )
                for _ in range(num_layers)
            )
        self.text_token_proj = (
            torch.nn.Linear(text_width, embed_dim)
            if text_width != embed_dim
            else torch.nn.Identity()
        )
        with torch.no_grad():  # identity statistics until set from data
            self.transformer.clip_std.fill_(1.0)

    # ------------------------------------------------------------------ statistics
    def set_embedding_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Store the per-dimension mean/std ``[D]`` of the training image embeddings."""
        d = self.config.embed_dim
        if mean.shape[-1] != d or std.shape[-1] != d:
            raise ValueError(
                f"embedding statistics must have {d} dims, got {tuple(mean.shape)} and "
                f"{tuple(std.shape)}"
            )
        if not torch.isfinite(mean).all() or not torch.isfinite(std).all() or (std <= 0).any():
            raise ValueError("embedding statistics must be finite with std > 0")
        with torch.no_grad():
            self.transformer.clip_mean.copy_(mean.reshape(1, d))
            self.transformer.clip_std.copy_(std.reshape(1, d))

    def normalize(self, image_embed: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` CLIP image embeddings → the diffusion's normalised space."""
        tr = self.transformer
        return (image_embed - tr.clip_mean.to(image_embed)) / tr.clip_std.to(image_embed)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize`."""
        tr = self.transformer
        return x * tr.clip_std.to(x) + tr.clip_mean.to(x)

    # ------------------------------------------------------------------ network
    def forward(self, x_t: torch.Tensor, t: torch.Tensor, text: TextEncoding) -> torch.Tensor:
        """``x_t [B, D]``, ``t [B]`` or scalar, ``text`` with ``B`` rows → predicted
        ``x_0 [B, D]``."""
        tokens = self.text_token_proj(text.text_tokens.to(self.dtype))
        out = self.transformer(
            x_t.to(self.dtype),
            timestep=t,
            proj_embedding=text.text_embed.to(self.dtype),
            encoder_hidden_states=tokens,
            attention_mask=text.text_mask,
            return_dict=False,
        )[0]
        return out
