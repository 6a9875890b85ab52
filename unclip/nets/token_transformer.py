"""The token transformers of the two other seed families: DALL-E's decoder-only transformer over
text and image tokens, and DALL-E Mega's BART-style encoder–decoder.

:class:`DalleTransformer` (Ramesh et al. 2021, "Zero-Shot Text-to-Image Generation", §2.2 and
appendix B.1) models one stream ``[caption BPE tokens ; image tokens]`` autoregressively. The
caption is padded to ``text_len`` positions with a *distinct* padding token per position (the
paper found masking the padding out generalised worse to out-of-distribution captions). The stream
this implementation feeds is::

    slot 0          start token (so the first caption token is predicted too)
    slots 1…L       caption tokens, padded position-wise
    slots L+1…      image tokens 0 … N-2 (raster order on the ``grid × grid`` token grid)

so the state at slot ``s`` predicts the token at slot ``s + 1``: slots ``0…L-1`` the caption,
slots ``L…L+N-1`` the ``N = grid²`` image tokens. Text tokens attend causally to text; every image
token attends to every text slot, and to earlier image tokens through one of the paper's masks
(:func:`dalle_attention_mask`): ``row``, ``column``, ``conv`` or ``dense`` (plain causal). The
paper's 64 layers use ``column`` when ``(i - 2) mod 4 = 0`` (1-based layer ``i`` below 64),
``row`` otherwise, and ``conv`` in the last layer (:func:`dalle_layer_kinds`). The loss weighs the
text and image cross-entropies 1/8 and 7/8, each averaged over its own tokens (§2.2).

:class:`MegaTransformer` (DALL-E Mega's training journal and model card): a BART encoder over the
caption (≤ 64 tokens) and a causal decoder over the 256 image tokens of a 16 × 16 VQGAN grid with
cross-attention to the encoder; NormFormer LayerNorms (after attention, after the GLU's activation)
without its residual and head scales, GELU-gated GLU feed-forwards, no biases in the projections,
absolute learned positions added at the start of the encoder and the decoder. Super-conditioning
(classifier-free guidance on logits) is trained by replacing a share of the captions with the
empty caption (:meth:`MegaTransformer.loss`, ``cond_drop_prob``).

Both networks share one interface, which :mod:`unclip.sampling.tokens` samples through:
``image_logits(text_ids, text_mask, image_tokens [B, n]) → [B, n+1, V_image]`` (teacher forcing:
row ``i`` predicts image token ``i``), ``start(text_ids, text_mask) → (logits [B, V_image],
state)`` and ``step(token [B], state) → logits [B, V_image]`` (a key/value cache: each step runs
one position), and ``null_text(batch, length)``, the caption of the unconditional pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from unclip.nets.blocks import FeedForward, SelfAttention, TransformerBlock

__all__ = [
    "MASK_KINDS",
    "dalle_attention_mask",
    "dalle_layer_kinds",
    "DalleConfig",
    "DalleTransformer",
    "DalleLoss",
    "MegaConfig",
    "MegaTransformer",
    "parameter_count",
]

#: the image-to-image attention patterns of :func:`dalle_attention_mask`
MASK_KINDS = ("dense", "row", "column", "conv")


def dalle_layer_kinds(num_layers: int, sparse: bool = True) -> list[str]:
    """The mask kind of each layer: the paper's schedule (appendix B.1: ``column`` when
    ``(i - 2) mod 4 = 0`` for 1-based ``i < num_layers``, else ``row``; ``conv`` last), or
    ``dense`` everywhere when ``sparse`` is false."""
    if not sparse:
        return ["dense"] * num_layers
    kinds = ["column" if (i - 2) % 4 == 0 else "row" for i in range(1, num_layers)]
    return kinds + ["conv"]


def dalle_attention_mask(
    kind: str, text_len: int, grid: int, conv_kernel: int = 11, device=None
) -> torch.Tensor:
    """Boolean mask ``[S, S]`` (``True``: the query may attend to the key) over DALL-E's input
    stream of ``S = text_len + grid²`` slots (start token, ``text_len`` caption slots, image
    tokens ``0 … grid²-2``; see the module doc).

    Text queries (slots ``0 … text_len``) attend causally. An image query holding the token at
    raster index ``i`` (row ``r_i = i // grid``, column ``c_i = i % grid``) attends to all text
    slots and to the image key holding token ``j <= i`` when

    * ``dense``: always (plain causal);
    * ``row``: ``i - grid <= j`` — the previous ``grid`` positions, the Sparse Transformer's local
      pattern (Child et al. 2019) that DALL-E's Figure 11 draws: the rest of the current row and
      the end of the row above;
    * ``column``: ``(i - j) mod grid == 0`` — the same column in earlier rows;
    * ``conv``: ``|r_i - r_j| <= conv_kernel // 2`` and ``|c_i - c_j| <= conv_kernel // 2`` — the
      causal part of a ``conv_kernel × conv_kernel`` neighbourhood. The paper's figure draws a
      small neighbourhood on a toy grid; ``conv_kernel`` sets its size.

    Built dense: at DALL-E's size (1,280 slots) it is 1.6 MB, and PyTorch's attention takes it as
    is (no block-sparse kernel)."""
    if kind not in MASK_KINDS:
        raise ValueError(f"mask kind must be one of {', '.join(MASK_KINDS)}, got {kind!r}")
    if conv_kernel < 1 or conv_kernel % 2 == 0:
        raise ValueError(f"conv_kernel must be an odd integer >= 1, got {conv_kernel!r}")
    s = text_len + grid * grid
    idx = torch.arange(s, device=device)
    mask = idx[None, :] <= idx[:, None]  # causal
    first_image = text_len + 1
    if kind == "dense" or s <= first_image:
        return mask
    i = (idx[first_image:] - first_image)[:, None]  # image queries' token indices
    j = (idx[first_image:] - first_image)[None, :]
    if kind == "row":
        allowed = j >= i - grid
    elif kind == "column":
        allowed = (i - j) % grid == 0
    else:
        half = conv_kernel // 2
        allowed = ((i // grid - j // grid).abs() <= half) & ((i % grid - j % grid).abs() <= half)
    mask[first_image:, first_image:] &= allowed
    return mask


def _attend_cached(
    attn: SelfAttention, x: torch.Tensor, mask: Optional[torch.Tensor], cache: Optional[dict]
) -> torch.Tensor:
    """Self-attention of ``x [B, T, dim]`` (the last ``T`` positions) over the cached keys and
    values of earlier positions and its own; ``mask [T, S]`` (``S`` = cached + ``T``). The cache
    (a dict) is extended with this call's keys and values."""
    q, k, v = attn.project(x)
    if cache is not None:
        if "k" in cache:
            k = torch.cat([cache["k"], k], dim=2)
            v = torch.cat([cache["v"], v], dim=2)
        cache["k"], cache["v"] = k, v
    return attn.attend(q, k, v, mask)


def _init_weights(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


# ------------------------------------------------------------------------------------- DALL-E


@dataclass
class DalleConfig:
    """DALL-E's transformer. Defaults: the paper's 12-billion-parameter model (§2.2, appendix B.1):
    64 layers of width 3,968 with 62 heads of 64, 256 caption tokens over a 16,384-token BPE
    vocabulary, 32 × 32 image tokens over the dVAE's 8,192 codes."""

    num_layers: int = 64
    width: int = 3968
    num_heads: int = 62
    text_len: int = 256
    grid: int = 32
    text_vocab_size: int = 16384
    image_vocab_size: int = 8192
    #: the paper's row/column/conv schedule; false: dense causal attention in every layer
    sparse_attention: bool = True
    #: side of the last layer's causal convolutional neighbourhood (the paper's Figure 11 draws
    #: it on a toy grid; the full-scale side here is a choice)
    conv_kernel: int = 11
    #: the weights of the text and image cross-entropies (§2.2: 1/8 and 7/8)
    text_loss_weight: float = 1 / 8
    image_loss_weight: float = 7 / 8
    dropout: float = 0.0
    init_std: float = 0.02

    @property
    def image_len(self) -> int:
        return self.grid * self.grid

    def check(self) -> None:
        if self.width % self.num_heads:
            raise ValueError(
                f"dalle: width {self.width} is not divisible by num_heads {self.num_heads}"
            )
        for name in ("num_layers", "text_len", "grid", "text_vocab_size", "image_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"dalle: {name} must be >= 1, got {getattr(self, name)!r}")

    def build(self) -> DalleTransformer:
        """The network (on the current default device: ``with torch.device("meta"):`` builds it
        without memory, e.g. to count parameters)."""
        return DalleTransformer(self)


class DalleLoss(NamedTuple):
    """``loss = text_loss_weight · text + image_loss_weight · image`` (scalars); ``text`` and
    ``image`` are mean cross-entropies (nats) over the batch's caption and image tokens."""

    loss: torch.Tensor
    text: torch.Tensor
    image: torch.Tensor


class DalleTransformer(nn.Module):
    """DALL-E's decoder-only transformer (see the module doc).

    Input vocabulary of the text slots: ``text_vocab_size`` BPE tokens, then ``text_len`` padding
    tokens (padding token ``p`` = ``text_vocab_size + p``, used only at position ``p``), then the
    start token. The image tokens have their own embedding. Positions: a learned embedding per
    text slot; image slots add a row and a column embedding of the token they hold. Two heads
    after the final LayerNorm: caption slots predict over BPE + padding tokens, image slots over
    the image codes. Blocks are :class:`unclip.transformer_blocks.TransformerBlock` (pre-LN,
    GELU, biases, as GPT-3, which the paper follows)."""

    def __init__(self, config: DalleConfig):
        super().__init__()
        config.check()
        self.config = c = config
        d = c.width
        self.text_embedding = nn.Embedding(c.text_vocab_size + c.text_len + 1, d)
        self.text_position = nn.Embedding(c.text_len + 1, d)
        self.image_embedding = nn.Embedding(c.image_vocab_size, d)
        self.image_row = nn.Embedding(c.grid, d)
        self.image_col = nn.Embedding(c.grid, d)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, c.num_heads, d // c.num_heads, dropout=c.dropout)
            for _ in range(c.num_layers)
        )
        self.norm_out = nn.LayerNorm(d)
        self.text_head = nn.Linear(d, c.text_vocab_size + c.text_len)
        self.image_head = nn.Linear(d, c.image_vocab_size)
        self.layer_kinds = dalle_layer_kinds(c.num_layers, c.sparse_attention)
        self._masks: dict = {}
        _init_weights(self, c.init_std)

    @property
    def grid(self) -> int:
        return self.config.grid

    @property
    def start_token(self) -> int:
        return self.config.text_vocab_size + self.config.text_len

    def mask(self, kind: str, device) -> torch.Tensor:
        """The full ``[S, S]`` mask of one kind (built once per device)."""
        key = (kind, str(device))
        if key not in self._masks:
            c = self.config
            self._masks[key] = dalle_attention_mask(kind, c.text_len, c.grid, c.conv_kernel, device)
        return self._masks[key]

    def pad_text(
        self, text_ids: torch.Tensor, text_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Caption ids ``[B, L']`` (``L' <= text_len``) and their mask (``True``: a token; ``None``:
        all tokens) → ``[B, text_len]`` with every non-token position ``p`` holding padding
        token ``p``."""
        c = self.config
        b, length = text_ids.shape
        if length > c.text_len:
            raise ValueError(
                f"dalle: captions hold at most {c.text_len} tokens, got {length}; truncate them"
            )
        pads = c.text_vocab_size + torch.arange(c.text_len, device=text_ids.device)
        out = pads.expand(b, -1).clone()
        keep = (
            torch.ones_like(text_ids, dtype=torch.bool) if text_mask is None else text_mask.bool()
        )
        out[:, :length] = torch.where(keep, text_ids, out[:, :length])
        return out

    def null_text(self, batch: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional caption: no tokens (every position its padding token)."""
        ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        return ids, torch.zeros(batch, length, dtype=torch.bool, device=device)

    def _embed(self, padded: torch.Tensor, image_tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Input embeddings ``[B, T, d]`` of the slots ``start … start+T-1``; ``padded [B, L]``
        (or ``None`` when only image slots are embedded) and ``image_tokens [B, n]`` are the
        tokens those slots hold."""
        c = self.config
        parts = []
        if padded is not None:
            b = padded.shape[0]
            ids = torch.cat([padded.new_full((b, 1), self.start_token), padded], dim=1)
            pos = torch.arange(ids.shape[1], device=ids.device)
            parts.append(self.text_embedding(ids) + self.text_position(pos))
        n = image_tokens.shape[1]
        if n:
            # slot s >= text_len + 1 holds image token s - text_len - 1
            first = 0 if padded is not None else start - (c.text_len + 1)
            k = torch.arange(first, first + n, device=image_tokens.device)
            pos = self.image_row(k // c.grid) + self.image_col(k % c.grid)
            parts.append(self.image_embedding(image_tokens) + pos)
        return torch.cat(parts, dim=1)

    def _run(self, x: torch.Tensor, start: int, caches: Optional[list]) -> torch.Tensor:
        """Blocks and the final norm over the slots ``start … start+T-1`` of ``x [B, T, d]``,
        attending to the cached slots before them."""
        t = x.shape[1]
        # TransformerBlock.forward, step by step, so the attention can use the cache (the blocks
        # are built without NormFormer, so there is no attention output norm to apply)
        for i, block in enumerate(self.blocks):
            mask = self.mask(self.layer_kinds[i], x.device)[start : start + t, : start + t]
            h = _attend_cached(
                block.attn, block.attn_norm(x), mask, None if caches is None else caches[i]
            )
            x = x + h
            x = x + block.ff(block.ff_norm(x))
        return self.norm_out(x)

    def forward(
        self,
        text_ids: torch.Tensor,
        text_mask: Optional[torch.Tensor],
        image_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing. ``text_ids [B, L']`` with ``text_mask`` (see :meth:`pad_text`),
        ``image_tokens [B, n]`` (``n < grid²``; long, raster order) → ``(text_logits
        [B, text_len, text_vocab_size + text_len], image_logits [B, n+1, image_vocab_size])``:
        text row ``p`` predicts caption slot ``p`` (padding included) from the ones before it;
        image row ``i`` predicts image token ``i`` from the caption and image tokens ``< i``."""
        c = self.config
        if image_tokens.shape[1] >= c.image_len:
            raise ValueError(
                f"dalle: feed at most {c.image_len - 1} image tokens (the last one is only "
                f"predicted), got {image_tokens.shape[1]}"
            )
        x = self._embed(self.pad_text(text_ids, text_mask), image_tokens, 0)
        h = self._run(x, 0, None)
        return self.text_head(h[:, : c.text_len]), self.image_head(h[:, c.text_len :])

    def image_logits(
        self, text_ids: torch.Tensor, text_mask: Optional[torch.Tensor], image_tokens: torch.Tensor
    ) -> torch.Tensor:
        """``[B, n+1, image_vocab_size]``: :meth:`forward`'s image logits."""
        return self(text_ids, text_mask, image_tokens)[1]

    def start(
        self, text_ids: torch.Tensor, text_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, dict]:
        """Run the start token and the caption: logits ``[B, image_vocab_size]`` of image token
        0 and the decoding state (each layer's key/value cache)."""
        padded = self.pad_text(text_ids, text_mask)
        x = self._embed(padded, padded.new_zeros(padded.shape[0], 0), 0)
        caches = [{} for _ in self.blocks]
        h = self._run(x, 0, caches)
        return self.image_head(h[:, -1]), {"caches": caches, "slot": x.shape[1]}

    def step(self, token: torch.Tensor, state: dict) -> torch.Tensor:
        """Feed image ``token [B]`` (the last one sampled): logits ``[B, image_vocab_size]`` of
        the next image token, computed for that one slot against the cache."""
        slot = state["slot"]
        x = self._embed(None, token[:, None], slot)
        h = self._run(x, slot, state["caches"])
        state["slot"] = slot + 1
        return self.image_head(h[:, -1])

    def loss(
        self,
        text_ids: torch.Tensor,
        text_mask: Optional[torch.Tensor],
        image_tokens: torch.Tensor,
        cond_drop_prob: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> DalleLoss:
        """Weighted cross-entropy (§2.2) of a batch: ``text_ids [B, L']``, ``text_mask``,
        ``image_tokens [B, grid²]`` (or ``[B, grid, grid]``). ``cond_drop_prob``: the share of
        rows whose caption is replaced by the empty one (trains guidance, which the paper did
        not use; 0 by default)."""
        image_tokens = image_tokens.flatten(1)
        text_ids, text_mask = _drop_captions(self, text_ids, text_mask, cond_drop_prob, generator)
        text_logits, image_logits = self(text_ids, text_mask, image_tokens[:, :-1])
        target = self.pad_text(text_ids, text_mask)
        text = F.cross_entropy(text_logits.flatten(0, 1).float(), target.flatten())
        image = F.cross_entropy(image_logits.flatten(0, 1).float(), image_tokens.flatten())
        c = self.config
        return DalleLoss(c.text_loss_weight * text + c.image_loss_weight * image, text, image)


def _drop_captions(model, text_ids, text_mask, p: float, generator):
    """Replace a ``p`` share of the rows (drawn per row) by ``model.null_text``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"cond_drop_prob must be in [0, 1], got {p!r}")
    if text_mask is None:
        text_mask = torch.ones_like(text_ids, dtype=torch.bool)
    if p == 0.0:
        return text_ids, text_mask
    b, length = text_ids.shape
    gen_device = generator.device if generator is not None else "cpu"
    drop = (torch.rand(b, generator=generator, device=gen_device) < p).to(text_ids.device)
    null_ids, null_mask = model.null_text(b, length, text_ids.device)
    return (
        torch.where(drop[:, None], null_ids, text_ids),
        torch.where(drop[:, None], null_mask, text_mask.bool()),
    )


# ------------------------------------------------------------------------------- DALL-E Mega


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

    def check(self) -> None:
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
        ``cross``: ``(keys, values, mask [B, 1, 1, L])`` of the encoder states."""
        x = x + self.self_attn_out_norm(
            _attend_cached(self.self_attn, self.self_attn_norm(x), self_mask, cache)
        )
        if self.cross_attn is not None:
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
        _init_weights(self, c.init_std)

    @property
    def grid(self) -> int:
        return self.config.grid

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
            x = layer(x, key_mask)
        return self.encoder_norm(x), key_mask

    def _decode(self, tokens, start, encoded, caches, cross_kv):
        """Decoder over the inputs ``tokens [B, T]`` at positions ``start … start+T-1``."""
        t = tokens.shape[1]
        pos = torch.arange(start, start + t, device=tokens.device)
        x = self.decoder_embed_norm(self.image_embedding(tokens) + self.image_position(pos))
        q = pos[:, None]
        mask = torch.arange(start + t, device=tokens.device)[None, :] <= q  # causal [T, S]
        for i, layer in enumerate(self.decoder):
            k, v = cross_kv[i] if cross_kv is not None else layer.cross_kv(encoded[0])
            x = layer(x, mask, None if caches is None else caches[i], (k, v, encoded[1]))
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
        if image_tokens.shape[1] >= c.image_len:
            raise ValueError(
                f"mega: feed at most {c.image_len - 1} image tokens, got {image_tokens.shape[1]}"
            )
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
        cross_kv = [layer.cross_kv(encoded[0]) for layer in self.decoder]
        caches = [{} for _ in self.decoder]
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
    ) -> torch.Tensor:
        """Mean cross-entropy (nats) over the image tokens ``[B, grid²]`` (or ``[B, grid,
        grid]``). ``cond_drop_prob``: the share of rows whose caption becomes the empty caption,
        which trains the unconditional logits super-conditioning needs."""
        image_tokens = image_tokens.flatten(1)
        text_ids, text_mask = _drop_captions(self, text_ids, text_mask, cond_drop_prob, generator)
        logits = self(text_ids, text_mask, image_tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), image_tokens.flatten())


def parameter_count(module: nn.Module) -> int:
    """Number of parameters (works on the meta device)."""
    return sum(math.prod(p.shape) for p in module.parameters())
