"""The decoder's and the diffusion prior's own caption encoder: a transformer over the caption's
BPE tokens, trained with the network it belongs to.

DALL-E 2's decoder is GLIDE's 3.5B model (Ramesh et al. 2022, §2.1 and Appendix C; Nichol et al.
2021, §4): the caption is encoded by a transformer of width 2048 with 24 residual blocks over a
256-token context, trained jointly with the UNet. Its final token's state is projected and added to
the timestep embedding, and all its token states are projected into the context of every attention
layer (:class:`~unclip.nets.decoder.UnCLIPDecoder` does both). The paper's diffusion prior likewise
encodes the caption with its own transformer over 256 tokens (Appendix C); there the token states
are the prior transformer's text tokens (:class:`~unclip.nets.prior.UnCLIPPrior`). The small
models instead condition on frozen CLIP token states (``text_encoder: clip``).

Captions are tokenized with open_clip's own BPE (:class:`open_clip.tokenizer.SimpleTokenizer`,
shipped inside the package, so nothing is downloaded), padded to the configured context length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Union

import torch
import torch.nn.functional as F
from open_clip.tokenizer import SimpleTokenizer

from unclip.utils.devices import lengths_may_follow_values

__all__ = [
    "CaptionBlock",
    "CaptionTokenizer",
    "CaptionTransformer",
    "TOKENIZERS",
    "caption_tokenizer",
]

#: caption tokenizers by the name a decoder config gives (``text_tokenizer``): vocabulary size and
#: end-of-text id, known without reading the BPE file so a network can be built on the meta device
TOKENIZERS = {"open_clip_bpe": {"vocab_size": 49408, "eot_token_id": 49407}}


def check_tokenizer(name: str) -> dict:
    """Vocabulary facts of tokenizer ``name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in TOKENIZERS:
        raise ValueError(
            f"unknown caption tokenizer {name!r}; text_tokenizer must be one of {list(TOKENIZERS)}"
        )
    return TOKENIZERS[name]


class CaptionTokenizer:
    """Captions → token ids ``[B, context_length]``: start, at most ``context_length - 2`` BPE
    tokens (longer captions are cut), end, then zeros (positions past the end token are masked)."""

    def __init__(self, name: str = "open_clip_bpe", context_length: int = 256):
        facts = check_tokenizer(name)
        if context_length < 2:
            raise ValueError(
                f"text_context_length must be at least 2 (start and end tokens), got "
                f"{context_length}"
            )
        self.name, self.context_length = name, int(context_length)
        self.bpe = SimpleTokenizer(context_length=self.context_length)
        assert self.bpe.vocab_size == facts["vocab_size"]
        assert self.bpe.eot_token_id == facts["eot_token_id"]

    def __call__(self, prompts: Union[str, Sequence[str]]) -> torch.LongTensor:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.bpe(prompts, context_length=self.context_length)


@functools.lru_cache(maxsize=4)
def caption_tokenizer(name: str, context_length: int) -> CaptionTokenizer:
    """A shared :class:`CaptionTokenizer` (reading the BPE merges takes a moment)."""
    return CaptionTokenizer(name, context_length)


class CaptionBlock(torch.nn.Module):
    """Pre-norm transformer block: self-attention (SDPA) over the caption, then a 4× GELU MLP.

    Public because FSDP shards the decoder by block class name
    (:data:`unclip.train.distributed.FSDP_BLOCKS`): each block is its own group, gathered only
    while it runs, instead of the whole caption transformer staying gathered in the root group."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, w))
        return x + self.mlp(self.norm2(x))


class CaptionTransformer(torch.nn.Module):
    """``forward(ids [B, L]) → (states [B, K, W], mask [B, K], final [B, W])``.

    Bidirectional over the real tokens (start to end token; padding is masked out as a key), so
    ``final``, the end token's state, summarises the whole caption. ``states`` are after the final
    LayerNorm. Supports diffusers-style gradient checkpointing (``gradient_checkpointing`` and
    ``_gradient_checkpointing_func`` are set by the decoder's ``enable_gradient_checkpointing``).

    ``K`` is the batch's longest caption, start and end tokens included: the positions after it
    are padding in every row, which no real token attends to, so the real tokens' states are the
    same without them (to float rounding) while the work shrinks with the captions (a 256-token
    context holds captions of a few dozen tokens). Every consumer reads the states with ``mask``.
    ``K = L`` where the length must not depend on the data (a graph being compiled or traced, fake
    or meta tensors) or with ``trim_padding`` off.
    """

    #: run only up to the batch's longest caption (see above); an attribute, not a config setting
    trim_padding: bool = True

    # declared for the checker: set on the instance by the decoder's enable_gradient_checkpointing
    _gradient_checkpointing_func: Callable[..., torch.Tensor]

    def __init__(
        self,
        vocab_size: int,
        eot_token_id: int,
        context_length: int,
        width: int,
        layers: int,
        heads: int,
    ):
        super().__init__()
        if width % heads:
            raise ValueError(
                f"text_encoder_width ({width}) must be divisible by text_encoder_heads ({heads})"
            )
        self.eot_token_id = eot_token_id
        self.token_embedding = torch.nn.Embedding(vocab_size, width)
        self.positional_embedding = torch.nn.Parameter(torch.empty(context_length, width))
        torch.nn.init.normal_(self.token_embedding.weight, std=0.02)
        torch.nn.init.normal_(self.positional_embedding, std=0.01)
        self.blocks = torch.nn.ModuleList(CaptionBlock(width, heads) for _ in range(layers))
        self.final_norm = torch.nn.LayerNorm(width)
        self.gradient_checkpointing = False

    @classmethod
    def for_tokenizer(
        cls, tokenizer: str, context_length: int, width: int, layers: int, heads: int
    ) -> CaptionTransformer:
        """The transformer over the ids of caption tokenizer ``tokenizer`` (its vocabulary and end
        token; ``ValueError`` for an unknown name)."""
        vocab = check_tokenizer(tokenizer)
        return cls(vocab["vocab_size"], vocab["eot_token_id"], context_length, width, layers, heads)

    def forward(self, ids: torch.Tensor):
        b, n = ids.shape
        if n != self.positional_embedding.shape[0]:
            raise ValueError(
                f"caption token ids have length {n} but this caption transformer takes "
                f"{self.positional_embedding.shape[0]} (text_context_length); tokenize with the "
                "tokenizer of the model it belongs to"
            )
        is_eot = ids == self.eot_token_id
        last = torch.where(is_eot.any(1), is_eot.int().argmax(1), n - 1)
        keep = self._kept_positions(last, n)
        ids = ids[:, :keep]
        mask = torch.arange(keep, device=ids.device)[None] <= last[:, None]  # [B, K]
        positions = self.positional_embedding[:keep]
        x = self.token_embedding(ids) + positions.to(self.token_embedding.weight)
        attn_mask = mask[:, None, None, :]  # keys only: every position attends to the caption
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, attn_mask)
            else:
                x = block(x, attn_mask)
        x = self.final_norm(x)
        return x, mask, x[torch.arange(b, device=x.device), last]

    def _kept_positions(self, last: torch.Tensor, n: int) -> int:
        """The positions up to the batch's last end token (one device sync), or all ``n``."""
        if not self.trim_padding or not lengths_may_follow_values(last):
            return n
        return int(last.max()) + 1
