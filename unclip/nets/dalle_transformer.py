""":class:`DalleTransformer` (Ramesh et al. 2021, "Zero-Shot Text-to-Image Generation", §2.2 and
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

Its sampling interface: :mod:`unclip.nets.token_common`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from unclip.nets.blocks import TransformerBlock
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

__all__ = [
    "MASK_KINDS",
    "dalle_attention_mask",
    "dalle_layer_kinds",
    "DalleConfig",
    "DalleTransformer",
    "DalleLoss",
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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Sizes within stated bounds (a degenerate or absurd one is a config error, not a crash
        deep inside or an allocation past any memory), weights finite."""
        check_sizes(
            "dalle",
            self,
            {
                "num_layers": (1, 1024),
                "width": (1, 65536),
                "num_heads": (1, 1024),
                "text_len": (1, 4096),
                "grid": (1, MAX_GRID),
                "text_vocab_size": (1, 2**20),
                "image_vocab_size": (2, MAX_CODES),
                "conv_kernel": (1, 2 * MAX_GRID - 1),
            },
        )
        if self.width % self.num_heads:
            raise ValueError(
                f"dalle: width {self.width} is not divisible by num_heads {self.num_heads}"
            )
        check_weights("dalle", self, ("text_loss_weight", "image_loss_weight"))
        check_weights("dalle", self, ("init_std",), positive=True)
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"dalle.dropout must be in [0, 1), got {self.dropout!r}")

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


class DalleBlock(TransformerBlock):
    """A :class:`~unclip.nets.blocks.TransformerBlock` (built without NormFormer, so there is no
    attention output norm) whose forward runs the attention through a key/value cache. The
    network calls each block as a module, so a wrapper that hooks the blocks' calls (FSDP2
    gathers a block's sharded weights in its forward) sees every use of its weights."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, mask: torch.Tensor, cache: Optional[dict] = None
    ) -> torch.Tensor:
        """One pre-LN block over ``x`` with the attention through the key/value ``cache``."""
        x = x + attend_cached(self.attn, self.attn_norm(x), mask, cache)
        return x + self.ff(self.ff_norm(x))


class DalleTransformer(nn.Module):
    """DALL-E's decoder-only transformer (see the module doc).

    Input vocabulary of the text slots: ``text_vocab_size`` BPE tokens, then ``text_len`` padding
    tokens (padding token ``p`` = ``text_vocab_size + p``, used only at position ``p``), then the
    start token. The image tokens have their own embedding. Positions: a learned embedding per
    text slot; image slots add a row and a column embedding of the token they hold. Two heads
    after the final LayerNorm: caption slots predict over BPE + padding tokens, image slots over
    the image codes. Blocks are :class:`DalleBlock`s (:class:`unclip.nets.blocks.TransformerBlock`:
    pre-LN, GELU, biases, as GPT-3, which the paper follows)."""

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
            DalleBlock(d, c.num_heads, d // c.num_heads, dropout=c.dropout)
            for _ in range(c.num_layers)
        )
        self.norm_out = nn.LayerNorm(d)
        self.text_head = nn.Linear(d, c.text_vocab_size + c.text_len)
        self.image_head = nn.Linear(d, c.image_vocab_size)
        self.layer_kinds = dalle_layer_kinds(c.num_layers, c.sparse_attention)
        self._masks: dict = {}
        #: recompute each block in backward (``train.gradient_checkpointing``)
        self.gradient_checkpointing = False
        init_weights(self, c.init_std)

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

    def _embed(
        self, padded: Optional[torch.Tensor], image_tokens: torch.Tensor, start: int
    ) -> torch.Tensor:
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
        for i, block in enumerate(self.blocks):
            mask = self.mask(self.layer_kinds[i], x.device)[start : start + t, : start + t]
            cache = None if caches is None else caches[i]
            if self.gradient_checkpointing and self.training and cache is None:
                # keep only each block's input; backward recomputes the block
                x = torch.utils.checkpoint.checkpoint(block, x, mask, None, use_reentrant=False)
            else:
                x = block(x, mask, cache)
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
        check_teacher_forcing("dalle", image_tokens, c.image_len)
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
        caches: list[dict] = [{} for _ in self.blocks]
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
        forward: Optional[Callable] = None,
    ) -> DalleLoss:
        """Weighted cross-entropy (§2.2) of a batch: ``text_ids [B, L']``, ``text_mask``,
        ``image_tokens [B, grid²]`` (or ``[B, grid, grid]``). ``cond_drop_prob``: the share of
        rows whose caption is replaced by the empty one (trains guidance, which the paper did
        not use; 0 by default). ``forward``: what runs the teacher-forced
        forward (default: this network; a distributed wrapper of it in training)."""
        image_tokens = image_tokens.flatten(1)
        text_ids, text_mask = drop_captions(self, text_ids, text_mask, cond_drop_prob, generator)
        text_logits, image_logits = (forward or self)(text_ids, text_mask, image_tokens[:, :-1])
        target = self.pad_text(text_ids, text_mask)
        text = F.cross_entropy(text_logits.flatten(0, 1).float(), target.flatten())
        image = F.cross_entropy(image_logits.flatten(0, 1).float(), image_tokens.flatten())
        c = self.config
        return DalleLoss(c.text_loss_weight * text + c.image_loss_weight * image, text, image)
