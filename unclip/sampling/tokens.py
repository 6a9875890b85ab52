"""Sampling image tokens from DALL-E's and DALL-E Mega's transformers
(:mod:`unclip.nets.token_transformer`): one token at a time in raster order, with temperature,
top-k, top-p and, optionally, guidance on the logits.

Guidance is DALL-E Mega's *super-conditioning* (classifier-free guidance on logits, Ho & Salimans
2021): each step runs the caption and the empty caption (the model's ``null_text``) and samples
from ``logits = uncond + α · (cond − uncond)``. Mega is trained for it by dropping captions
(``loss(..., cond_drop_prob=...)``); DALL-E did not use it, but the same option applies to a
DALL-E transformer trained with dropped captions. ``guidance_scale=None`` or ``1`` runs the
conditional pass only (at α = 1 the mix is the conditional logits), as the AR prior and the
diffusion stages read a scale of 1; any other number runs both passes.

With ``use_cache`` (the default) each step runs only the newest position against each layer's
key/value cache; without it each step reruns the whole sequence so far. Both compute the same
logits (to float rounding) and so draw the same tokens from the same generator.

Each token is drawn by inverse CDF from one uniform number per row, taken from that row's
generator when a list of ``B`` generators is given, so a row's sample does not depend on the
rows batched with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch

from unclip.diffusion.loop import is_guided
from unclip.sampling.ar import draw_tokens, filter_logits, row_uniforms

__all__ = [
    "guided_logits",
    "sample_image_tokens",
    "draw_tokens",
    "check_logits",
    "check_token_settings",
    "TokenSampling",
    "MIN_TEMPERATURE",
    "MAX_CANDIDATES",
]

Generator = Union[None, torch.Generator, list[torch.Generator]]

#: the smallest temperature taken: the logits are divided by it in float32, and below this a
#: trained model's logits (|l| up to ~1e3) stay far from overflowing to inf (which would make
#: every probability NaN and every token 0); top_k=1 is the way to sample greedily
MIN_TEMPERATURE = 1e-6

#: the most candidates per requested image: each is a whole image sampled token by token and
#: decoded before the reranker scores them all, so memory and time grow with the count (DALL-E
#: reranked 512 for its paper's figures; the web demo stops at 32)
MAX_CANDIDATES = 512


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_token_settings(
    where: str,
    temperature,
    top_k=None,
    top_p=None,
    guidance_scale=None,
) -> None:
    """Refuse, in one ``ValueError`` line naming ``where`` (``sampling`` or the argument list),
    settings that would draw every token from NaN probabilities: a temperature that is not a
    finite number of at least :data:`MIN_TEMPERATURE`, a top-p outside (0, 1], a non-integer
    top-k, a guidance scale (super-conditioning's α) that is not finite. Unchecked, each of them
    samples token 0 everywhere: one flat picture for every prompt, with no error."""
    t = temperature
    if not (_number(t) and math.isfinite(t) and t >= MIN_TEMPERATURE):
        raise ValueError(
            f"{where}.temperature must be a finite number >= {MIN_TEMPERATURE:g} (for greedy "
            f"sampling use top_k=1), got {t!r}"
        )
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"{where}.top_k must be an integer >= 1 or null, got {top_k!r}")
    if top_p is not None and not (_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"{where}.top_p must be in (0, 1] or null, got {top_p!r}")
    g = guidance_scale
    if g is not None and not (_number(g) and math.isfinite(g)):
        raise ValueError(
            f"{where}.guidance_scale (super-conditioning's alpha) must be a finite number or "
            f"null (off), got {g!r}"
        )


def check_logits(logits: torch.Tensor, stage: str, index: int, model=None) -> None:
    """Stop with one ``ValueError`` line naming ``stage`` when the logits that token ``index`` is
    drawn from hold NaN or +inf (-inf only excludes a token): every probability would be NaN
    and the token 0, so the image would silently be one flat colour. The message blames the
    weights when they hold NaN/inf (checked only then), else the settings."""
    bad = torch.isnan(logits) | (logits == float("inf"))
    if not bad.any():
        return
    where = f"{stage} produced NaN/inf logits at image token {index}"
    if model is not None and not all(torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError(f"{where}: its weights hold NaN/inf; check the transformer folder")
    raise ValueError(
        f"{where}: its weights are finite, so the settings overflowed float32 (lower "
        "guidance_scale, raise temperature) or the captions' inputs hold NaN/inf"
    )


def guided_logits(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Super-conditioning: ``uncond + scale · (cond − uncond)``, logits ``[B, V]``."""
    return uncond + scale * (cond - uncond)


@torch.no_grad()
def sample_image_tokens(
    model,
    text_ids: torch.Tensor,
    text_mask: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    guidance_scale: Optional[float] = None,
    generator: Generator = None,
    use_cache: bool = True,
    return_logits: bool = False,
    on_token: Optional[Callable[[int, torch.Tensor], None]] = None,
):
    """Sample ``grid²`` image tokens per caption.

    Args:
        model: a :class:`~unclip.nets.token_transformer.DalleTransformer` or
            :class:`~unclip.nets.token_transformer.MegaTransformer` (anything with their
            ``start``/``step``/``image_logits``/``null_text`` interface and a ``grid``).
        text_ids, text_mask: captions ``[B, L]`` and their mask (``None``: all tokens).
        temperature, top_k, top_p: applied to the (guided) logits in that order
            (:func:`unclip.sampling.ar.filter_logits`); ``None`` switches top-k / top-p off.
        guidance_scale: ``α`` of super-conditioning, or ``None`` (or 1) for none (see the module
            doc).
        generator: one generator, one per row (a list of ``B``), or ``None`` (global RNG).
        use_cache: decode with the key/value cache (else rerun the prefix every step).
        return_logits: also return the logits each token was drawn from, after guidance and
            before temperature and filtering, ``[B, grid², V]`` (float32).
        on_token: called after each token as ``on_token(i, tokens [B, i + 1])`` (the tokens
            drawn so far, raster order), e.g. to report progress.

    Returns:
        image tokens ``[B, grid, grid]`` (long), and the logits when ``return_logits``.
    """
    check_token_settings("sample_image_tokens", temperature, top_k, top_p, guidance_scale)
    b, length = text_ids.shape
    if isinstance(generator, (list, tuple)) and len(generator) != b:
        raise ValueError(f"{len(generator)} generators for {b} captions; pass one, or one per row")
    device = text_ids.device
    if text_mask is None:
        text_mask = torch.ones_like(text_ids, dtype=torch.bool)
    # α = 1 is the conditional logits: one pass, as the AR prior and the diffusion stages do
    alpha = None if guidance_scale is None or not is_guided(guidance_scale) else guidance_scale
    guided = alpha is not None
    if guided:
        null_ids, null_mask = model.null_text(b, length, device)
        text_ids = torch.cat([null_ids, text_ids])
        text_mask = torch.cat([null_mask, text_mask.bool()])
    n = model.grid * model.grid
    tokens = torch.empty(b, n, dtype=torch.long, device=device)
    all_logits: Optional[list[torch.Tensor]] = [] if return_logits else None
    state = None
    for i in range(n):
        if not use_cache:
            prev = tokens[:, :i]
            logits = model.image_logits(
                text_ids, text_mask, torch.cat([prev, prev]) if guided else prev
            )[:, -1]
        elif state is None:
            logits, state = model.start(text_ids, text_mask)
        else:
            prev = tokens[:, i - 1]
            logits = model.step(torch.cat([prev, prev]) if guided else prev, state)
        logits = logits.float()
        if alpha is not None:
            uncond, cond = logits.chunk(2)
            logits = guided_logits(uncond, cond, float(alpha))
        check_logits(logits, "the token transformer", i, model)
        if all_logits is not None:
            all_logits.append(logits)
        filtered = filter_logits(logits, float(temperature), top_k, top_p)
        # the guided logits were finite: only the temperature can have overflowed them
        check_logits(filtered, "the token transformer (after temperature)", i)
        tokens[:, i] = draw_tokens(filtered, row_uniforms(generator, b, device))
        if on_token is not None:
            on_token(i, tokens[:, : i + 1])
    tokens = tokens.view(b, model.grid, model.grid)
    if all_logits is not None:  # return_logits
        return tokens, torch.stack(all_logits, dim=1)
    return tokens


@dataclass
class TokenSampling:
    """Sampling settings of a token pipeline (DALL-E, DALL-E Mega): ``temperature``, ``top_k``,
    ``top_p`` and ``guidance_scale`` (super-conditioning's ``α``; ``None``: the conditional pass
    only) as :func:`sample_image_tokens` takes them; ``candidates``: images sampled per requested
    image, the best kept by the CLIP reranker (DALL-E's reranking; 1: no reranking);
    ``use_cache``: the key/value cache."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    guidance_scale: Optional[float] = None
    candidates: int = 1
    use_cache: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every setting checked where the type is made (a config, ``unclip.json``, an API
        override, the web form, an export all build one): :func:`check_token_settings`, and
        ``candidates`` an integer in 1 … :data:`MAX_CANDIDATES`."""
        check_token_settings(
            "sampling", self.temperature, self.top_k, self.top_p, self.guidance_scale
        )
        c = self.candidates
        if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_CANDIDATES:
            raise ValueError(
                f"sampling.candidates must be an integer in 1 … {MAX_CANDIDATES} (each candidate "
                f"is a whole image sampled and decoded before the reranker picks one), got {c!r}"
            )
        if not isinstance(self.use_cache, bool):
            raise ValueError(f"sampling.use_cache must be true or false, got {self.use_cache!r}")
