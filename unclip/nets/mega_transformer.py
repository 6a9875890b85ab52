""":class:`MegaTransformer` (DALL-E Mega's training journal and model card): a BART encoder over the
caption (≤ 64 tokens) and a causal decoder over the 256 image tokens of a 16 × 16 VQGAN grid with
cross-attention to the encoder; NormFormer LayerNorms (after attention, after the GLU's activation)
without its residual and head scales, GELU-gated GLU feed-forwards, no biases in the projections,
absolute learned positions added at the start of the encoder and the decoder. Super-conditioning
(classifier-free guidance on logits) is trained by replacing a share of the captions with the
empty caption (:meth:`MegaTransformer.loss`, ``cond_drop_prob``).

Its sampling interface: :mod:`unclip.nets.token_common`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from unclip.nets.blocks import FeedForward, SelfAttention
from unclip.nets.token_common import (
    MAX_CODES,
    MAX_GRID,
    attend_cached,
    check_sizes,
    check_teacher_forcing,
    check_weights,
    drop_captions,
    init_weights,
)

__all__ = ["MegaConfig", "MegaLayer", "MegaTransformer"]


@dataclass
class MegaConfig:
    """DALL-E Mega's BART encoder–decoder. Defaults: the trained model (training journal, "Model
    configuration"): 24 + 24 layers of width 2,048 with 16 heads, GLU feed-forwards of 4,096,
    captions of ≤ 64 tokens over BART's 50,264-token vocabulary, 16 × 16 image tokens over the
    VQGAN's 16,384 codes; weights initialised N(0, 0.01)."""

    encoder_layers: int = 24
    decoder_layers: int = 24
    width: int = 2048
    num_heads: int = 16
    glu_width: int = 4096
    text_len: int = 64
    grid: int = 16
    text_vocab_size: int = 50264
    image_vocab_size: int = 16384
    #: BART's special tokens: the empty caption is ``[bos, eos]`` followed by padding
    text_bos_id: int = 0
    text_pad_id: int = 1
    text_eos_id: int = 2
    dropout: float = 0.0
    init_std: float = 0.01

    @property
    def image_len(self) -> int:
        return self.grid * self.grid

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Sizes within stated bounds (see :meth:`DalleConfig.check`), the GLU's width reachable,
        the special tokens inside the caption vocabulary."""
        check_sizes(
            "mega",
            self,
            {
                "encoder_layers": (1, 1024),
                "decoder_layers": (1, 1024),
                "width": (1, 65536),
                "num_heads": (1, 1024),
                "glu_width": (1, 262144),
                "text_len": (2, 4096),
                "grid": (1, MAX_GRID),
                "text_vocab_size": (3, 2**20),
                "image_vocab_size": (2, MAX_CODES),
            },
        )
        top = self.text_vocab_size - 1
        check_sizes(
            "mega", self, {k: (0, top) for k in ("text_bos_id", "text_pad_id", "text_eos_id")}
        )
        check_weights("mega", self, ("init_std",), positive=True)
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"mega.dropout must be in [0, 1), got {self.dropout!r}")
        if self.width % self.num_heads:
            raise ValueError(f"mega: width {self.width} is not divisible by {self.num_heads} heads")
        # FeedForward sizes a GLU as (2 · ff_mult · width) // 3: glu_width must be reachable
        if (3 * self.glu_width) % (2 * self.width):
            raise ValueError(
                f"mega: glu_width {self.glu_width} must be a multiple of 2/3 of width {self.width} "
                "(the GLU's hidden width is (2 · ff_mult · width) / 3)"
            )
        if self.text_len < 2:
            raise ValueError(f"mega: text_len must be >= 2 (bos and eos), got {self.text_len}")

    def build(self) -> MegaTransformer:
        """The network (on the current default device; see :meth:`DalleConfig.build`)."""
        return MegaTransformer(self)


class MegaLayer(nn.Module):
    """One NormFormer layer ``[B, T, d] → [B, T, d]``: ``x + LN(SelfAttn(LN x))``, with
    ``cross`` also ``x + LN(CrossAttn(LN x, encoder))``, then ``x + W_o LN(gelu(W x) ⊙ V x)``
    (GLU, Shazeer 2020); no biases, no residual or head scales (as the journal lists)."""

    def __init__(self, config: MegaConfig, cross: bool):
        super().__init__()
        d, h = config.width, config.num_heads
        self.self_attn_norm = nn.LayerNorm(d)
        self.self_attn = SelfAttention(d, h, d // h, config.dropout, bias=False)
        self.self_attn_out_norm = nn.LayerNorm(d)
        self.cross_attn: Optional[SelfAttention]  # decoder layers only
        if cross:
            self.cross_attn_norm = nn.LayerNorm(d)
            self.cross_attn = SelfAttention(d, h, d // h, config.dropout, bias=False)
            self.cross_attn_out_norm = nn.LayerNorm(d)
        else:
            self.cross_attn = None
        self.ff_norm = nn.LayerNorm(d)
        ff_mult = 3 * config.glu_width // (2 * d)
        self.ff = FeedForward(d, "geglu", ff_mult, config.dropout, inner_norm=True, bias=False)

    def cross_kv(self, encoder_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, heads, L, head_dim]`` of the encoder states (computed once
        per caption and kept for every decoding step)."""
        a = self.cross_attn
        assert a is not None, "cross_kv is for decoder layers (cross=True)"
        b, length, _ = encoder_states.shape

        def heads(t):
            return t.view(b, length, a.num_heads, a.head_dim).transpose(1, 2)

        return heads(a.to_k(encoder_states)), heads(a.to_v(encoder_states))

    def forward(
        self,
        x: torch.Tensor,
        self_mask: Optional[torch.Tensor],
        cache: Optional[dict] = None,
        cross: Optional[tuple] = None,
    ) -> torch.Tensor:
        """``x [B, T, d]``; ``self_mask`` bool, broadcastable to ``[B, heads, T, S]``;
        ``cross``: ``(keys, values, mask [B, 1, 1, L])`` of the encoder states, or
        ``(encoder_states [B, L, d], mask)`` to compute the keys and values here (teacher
        forcing: inside the layer's own call, where FSDP2 has gathered its weights)."""
        x = x + self.self_attn_out_norm(
            attend_cached(self.self_attn, self.self_attn_norm(x), self_mask, cache)
        )
        if self.cross_attn is not None:
            assert cross is not None, "a decoder layer needs the encoder's keys and values"
            if len(cross) == 2:
                cross = (*self.cross_kv(cross[0]), cross[1])
            k, v, mask = cross
            a = self.cross_attn
            h = self.cross_attn_norm(x)
            b, t, _ = h.shape
            q = a.to_q(h).view(b, t, a.num_heads, a.head_dim).transpose(1, 2)
            x = x + self.cross_attn_out_norm(a.attend(q, k, v, mask))
        return x + self.ff(self.ff_norm(x))


class MegaTransformer(nn.Module):
    """DALL-E Mega's encoder–decoder (see the module doc). The decoder reads ``[bos, image tokens
    0 … 254]`` (``bos`` = ``image_vocab_size``) and predicts image tokens ``0 … 255``; its head
    covers the image codes only (``bos`` is never a target). Token and position embeddings are
    summed and normalised by a LayerNorm (BART's embedding norm) before the first layer of the
    encoder and of the decoder; each stack ends with a LayerNorm."""

    def __init__(self, config: MegaConfig):
        super().__init__()
        config.check()
        self.config = c = config
        d = c.width
        self.text_embedding = nn.Embedding(c.text_vocab_size, d)
        self.text_position = nn.Embedding(c.text_len, d)
        self.encoder_embed_norm = nn.LayerNorm(d)
        self.encoder = nn.ModuleList(MegaLayer(c, cross=False) for _ in range(c.encoder_layers))
        self.encoder_norm = nn.LayerNorm(d)
        self.image_embedding = nn.Embedding(c.image_vocab_size + 1, d)  # + bos
        self.image_position = nn.Embedding(c.image_len, d)
        self.decoder_embed_norm = nn.LayerNorm(d)
        self.decoder = nn.ModuleList(MegaLayer(c, cross=True) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, c.image_vocab_size, bias=False)
        #: recompute each layer in backward (``train.gradient_checkpointing``)
        self.gradient_checkpointing = False
        init_weights(self, c.init_std)

    @property
    def grid(self) -> int:
        return self.config.grid

    def _layer(self, layer, x, mask, cache=None, cross=None):
        if self.gradient_checkpointing and self.training and cache is None:
            # keep only each layer's input; backward recomputes the layer
            return torch.utils.checkpoint.checkpoint(
                layer, x, mask, None, cross, use_reentrant=False
            )
        return layer(x, mask, cache, cross)

    def null_text(self, batch: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption (what BART's tokenizer gives for ``""``): ``[bos, eos, pad …]``
        ``[batch, length]`` and its mask."""
        c = self.config
        ids = torch.full((batch, length), c.text_pad_id, dtype=torch.long, device=device)
        ids[:, 0], ids[:, 1] = c.text_bos_id, c.text_eos_id
        mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
        mask[:, :2] = True
        return ids, mask

    def encode(
        self, text_ids: torch.Tensor, text_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Caption ids ``[B, L]`` (``L <= text_len``) → encoder states ``[B, L, d]`` and the key
        mask ``[B, 1, 1, L]`` (padding is never attended to)."""
        c = self.config
        b, length = text_ids.shape
        if length > c.text_len:
            raise ValueError(
                f"mega: captions hold at most {c.text_len} tokens, got {length}; truncate them"
            )
        if text_mask is None:
            text_mask = torch.ones_like(text_ids, dtype=torch.bool)
        key_mask = text_mask.bool()[:, None, None, :]
        pos = torch.arange(length, device=text_ids.device)
        x = self.encoder_embed_norm(self.text_embedding(text_ids) + self.text_position(pos))
        for layer in self.encoder:
            x = self._layer(layer, x, key_mask)
        return self.encoder_norm(x), key_mask

    def _decode(self, tokens, start, encoded, caches, cross_kv):
        """Decoder over the inputs ``tokens [B, T]`` at positions ``start … start+T-1``."""
        t = tokens.shape[1]
        pos = torch.arange(start, start + t, device=tokens.device)
        x = self.decoder_embed_norm(self.image_embedding(tokens) + self.image_position(pos))
        q = pos[:, None]
        mask = torch.arange(start + t, device=tokens.device)[None, :] <= q  # causal [T, S]
        for i, layer in enumerate(self.decoder):
            # without precomputed keys and values the layer computes them in its own call
            cross = encoded if cross_kv is None else (*cross_kv[i], encoded[1])
            x = self._layer(layer, x, mask, None if caches is None else caches[i], cross)
        return self.lm_head(self.decoder_norm(x))

    def forward(
        self,
        text_ids: torch.Tensor,
        text_mask: Optional[torch.Tensor],
        image_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Teacher forcing: ``text_ids [B, L]``, ``text_mask [B, L]`` (``None``: all tokens),
        ``image_tokens [B, n]`` (``n < grid²``) → logits ``[B, n+1, image_vocab_size]``; row
        ``i`` predicts image token ``i`` from the caption and image tokens ``< i``."""
        c = self.config
        check_teacher_forcing("mega", image_tokens, c.image_len)
        bos = image_tokens.new_full((image_tokens.shape[0], 1), c.image_vocab_size)
        return self._decode(
            torch.cat([bos, image_tokens], 1), 0, self.encode(text_ids, text_mask), None, None
        )

    image_logits = forward

    def start(
        self, text_ids: torch.Tensor, text_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, dict]:
        """Encode the caption and run ``bos``: logits ``[B, image_vocab_size]`` of image token 0
        and the decoding state (self-attention caches, the encoder's keys and values)."""
        encoded = self.encode(text_ids, text_mask)
        # self.decoder holds MegaLayers (a ModuleList yields plain Modules to the checker)
        cross_kv = [cast(MegaLayer, layer).cross_kv(encoded[0]) for layer in self.decoder]
        caches: list[dict] = [{} for _ in self.decoder]
        bos = text_ids.new_full((text_ids.shape[0], 1), self.config.image_vocab_size)
        logits = self._decode(bos, 0, encoded, caches, cross_kv)[:, -1]
        return logits, {"encoded": encoded, "cross_kv": cross_kv, "caches": caches, "pos": 1}

    def step(self, token: torch.Tensor, state: dict) -> torch.Tensor:
        """Feed image ``token [B]``: logits ``[B, image_vocab_size]`` of the next one."""
        pos = state["pos"]
        logits = self._decode(
            token[:, None], pos, state["encoded"], state["caches"], state["cross_kv"]
        )
        state["pos"] = pos + 1
        return logits[:, -1]

    def loss(
        self,
        text_ids: torch.Tensor,
        text_mask: Optional[torch.Tensor],
        image_tokens: torch.Tensor,
        cond_drop_prob: float = 0.0,
        generator: Optional[torch.Generator] = None,
        forward: Optional[Callable] = None,
    ) -> torch.Tensor:
        """Mean cross-entropy (nats) over the image tokens ``[B, grid²]`` (or ``[B, grid,
        grid]``). ``cond_drop_prob``: the share of rows whose caption becomes the empty caption,
        which trains the unconditional logits super-conditioning needs. ``forward``: what runs
        the teacher-forced forward (default: this network; a distributed wrapper of it in
        training)."""
        image_tokens = image_tokens.flatten(1)
        text_ids, text_mask = drop_captions(self, text_ids, text_mask, cond_drop_prob, generator)
        logits = (forward or self)(text_ids, text_mask, image_tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), image_tokens.flatten())
