"""What DALL-E's and DALL-E Mega's token transformers share: attention over a key/value cache,
caption dropout (the unconditional pass of super-conditioning), initialisation, parameter
counting and the teacher-forcing length check.

Both networks share one interface, which :mod:`unclip.sampling.tokens` samples through:
``image_logits(text_ids, text_mask, image_tokens [B, n]) → [B, n+1, V_image]`` (teacher forcing:
row ``i`` predicts image token ``i``), ``start(text_ids, text_mask) → (logits [B, V_image],
state)`` and ``step(token [B], state) → logits [B, V_image]`` (a key/value cache: each step runs
one position), and ``null_text(batch, length)``, the caption of the unconditional pass.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from unclip.nets.blocks import SelfAttention

__all__ = [
    "attend_cached",
    "init_weights",
    "drop_captions",
    "parameter_count",
    "check_teacher_forcing",
    "check_decoded",
    "check_sizes",
    "check_weights",
    "MAX_CODES",
    "MAX_GRID",
]

#: the largest codebook a tokenizer may have and a transformer may predict over (2^18: beyond any
#: published image tokenizer; DALL-E's dVAE has 8,192 codes, Mega's VQGAN 16,384)
MAX_CODES = 2**18
#: the most image tokens per side: DALL-E's masks are [S, S] with S = grid² + caption, so 128
#: (16,384 image tokens) already takes a few hundred MB per mask kind (DALL-E: 32, Mega: 16)
MAX_GRID = 128


def check_sizes(family: str, cfg, bounds: dict) -> None:
    """Each field ``name`` of ``cfg`` must be an integer in ``bounds[name] = (low, high)``: a
    ``ValueError`` ``"<family>.<name> must be an integer in low … high, got value"`` otherwise.
    Checked when the config is made, so a degenerate size (0 codes: a zero-size convolution deep
    inside) or an absurd one (10⁹ codes: a 256 GB allocation) is a config error, not a crash."""
    for name, (low, high) in bounds.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(
                f"{family}.{name} must be an integer in {low:,} … {high:,}, got {value!r}"
            )


def check_weights(family: str, cfg, names, positive: bool = False) -> None:
    """Each field of ``names`` must be a finite number >= 0 (``positive``: > 0)."""
    for name in names:
        value = getattr(cfg, name)
        ok = (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            and math.isfinite(value)
            and (value > 0 if positive else value >= 0)
        )
        if not ok:
            raise ValueError(
                f"{family}.{name} must be a finite number {'>' if positive else '>='} 0, got "
                f"{value!r}"
            )


def attend_cached(
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


def init_weights(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            bias = getattr(m, "bias", None)  # Embedding has none; Linear may have none
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)


def drop_captions(model, text_ids, text_mask, p: float, generator):
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


def parameter_count(module: nn.Module) -> int:
    """Number of parameters (works on the meta device)."""
    return sum(math.prod(p.shape) for p in module.parameters())


def check_teacher_forcing(family: str, image_tokens: torch.Tensor, image_len: int) -> None:
    """``image_logits`` takes at most ``image_len - 1`` image tokens: its rows predict tokens
    ``0 .. n``, and there is no token ``image_len`` to predict."""
    if image_tokens.shape[1] >= image_len:
        raise ValueError(
            f"{family}: feed at most {image_len - 1} image tokens (the last one is only "
            f"predicted), got {image_tokens.shape[1]}"
        )


def check_decoded(kind: str, images: torch.Tensor, tokenizer: nn.Module) -> torch.Tensor:
    """``images``, a tokenizer's decoding, if every value is finite; else one ``ValueError`` line
    naming the decoder. A NaN pixel would otherwise leave as black (numpy's cast of NaN to
    uint8, with only its warning), as the unCLIP stages' own check
    (:func:`unclip.sampling.utils.check_finite`) prevents there."""
    if torch.isfinite(images).all():
        return images
    if not all(torch.isfinite(p).all() for p in tokenizer.parameters()):
        why = "its weights hold NaN/inf; check the tokenizer folder (or retrain it)"
    else:
        why = "its weights are finite, so the decoder overflowed (try full precision)"
    raise ValueError(f"the tokenizer decoder ({kind}) produced NaN/inf pixels: {why}")
