"""Sampling the autoregressive prior (:class:`~unclip.nets.ar_prior.UnCLIPARPrior`): codes one at a
time with temperature, top-k, top-p and classifier-free guidance on the logits, then best-of-N.

Its settings are an :class:`~unclip.sampling.settings.ARPriorSampling` (``guidance_scale``,
``best_of``, ``temperature``, ``top_k``, ``top_p``, ``dot_product_quantile``); it has no
``scheduler`` or ``steps``. Guidance mixes the logits
of the conditional and the caption-dropped pass, ``l_u + s · (l_c − l_u)``; scale 1 skips the
unconditional pass, as in the diffusion stages.

Each code is drawn by inverse CDF from one uniform number per row, taken from that row's generator
(one generator per candidate, as :func:`unclip.sampling.sample_prior`), so a row's sample does not
depend on the rows batched with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from unclip.diffusion.loop import Generator, is_guided
from unclip.nets.text_encoding import TextEncoding
from unclip.sampling.settings import ARPriorSampling, SamplingConfig, sampling_as
from unclip.sampling.utils import check_finite

__all__ = ["filter_logits", "sample_ar_prior", "row_uniforms", "draw_tokens"]


def filter_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> torch.Tensor:
    """``logits [N, K]`` divided by ``temperature``, with everything outside the ``top_k`` most
    likely codes and outside the smallest set of codes holding ``top_p`` of the probability (the
    nucleus; the most likely code always stays) set to -inf."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        srt, idx = logits.sort(dim=-1, descending=True)
        probs = srt.softmax(-1)
        # drop a code when the codes more likely than it already hold top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return logits


def row_uniforms(generator: Generator, n: int, device) -> torch.Tensor:
    """``[n]`` uniforms in [0, 1): one per row from its own generator, or all from one (every
    autoregressive sampler draws its codes from these)."""
    if isinstance(generator, (list, tuple)):
        u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generator])
    elif isinstance(generator, torch.Generator):
        u = torch.rand(n, generator=generator, device=generator.device)
    else:
        u = torch.rand(n)
    return u.to(device)


def draw_tokens(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N]`` from ``logits [N, V]`` (``-inf``: excluded) by inverse CDF: the first token
    whose cumulative probability exceeds ``u [N]`` (uniforms in [0, 1))."""
    cdf = logits.float().softmax(-1).cumsum(-1)
    token = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)
    return token.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def sample_ar_prior(
    prior,
    text: TextEncoding,
    null_text: Callable[[int], TextEncoding],
    settings: Union[ARPriorSampling, SamplingConfig],
    *,
    generator: Generator = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[Callable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AR prior: ``text [B]`` → ``(best [B, D], candidates [B, N, D])`` CLIP image embeddings.

    ``N = settings.best_of`` candidates per row; the one with the highest dot product with the
    row's text embedding is kept (paper §2.2, as the diffusion prior). ``null_text(n)``: the
    unconditional caption repeated ``n`` times (called only when guided). ``generator``: one, or
    one per candidate (``B·N``, row-major). ``callback(i, i, codes)`` runs after code ``i`` with
    the codes so far ``[B·N, i+1]``; they cannot be replaced (returning a tensor is an error).
    """
    s = sampling_as(ARPriorSampling, "prior", settings)
    prior._check_fitted()
    n_best, b = s.best_of, len(text)
    batch, device = b * n_best, prior.device
    if isinstance(generator, (list, tuple)) and len(generator) != batch:
        raise ValueError(
            f"prior: {len(generator)} generators for {b} rows × {n_best} candidates; pass one, or "
            f"one per candidate ({batch})"
        )
    cond = text.repeat_interleave(n_best).to(device=device)
    if s.dot_product_quantile is None:  # the paper: a dot product from the top half
        quantile = 0.5 + 0.5 * row_uniforms(generator, batch, device)
    else:
        quantile = torch.full((batch,), float(s.dot_product_quantile), device=device)
    dot = prior.dot_token_at(quantile)
    guided = is_guided(s.guidance_scale)
    if guided:
        cond = TextEncoding.cat([null_text(batch).to(device=device), cond])
        dot = torch.cat([torch.full_like(dot, prior.null_dot), dot])
    temperature = 1.0 if s.temperature is None else float(s.temperature)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast(device.type, enabled=False)
    )
    net = prior.transformer
    p = prior.pca_dims
    codes = torch.empty(batch, p, dtype=torch.long, device=device)
    state = None
    for i in tqdm(range(p), desc="prior", disable=not progress, leave=False):
        with autocast:
            if state is None:
                logits, state = net.start(cond, dot)
            else:
                prev = codes[:, i - 1]
                logits = net.step(torch.cat([prev, prev]) if guided else prev, state)
        logits = check_finite("prior", logits.float(), autocast_dtype)
        if guided:
            uncond, logits = logits.chunk(2)
            logits = uncond + s.guidance_scale * (logits - uncond)
        logits = filter_logits(logits, temperature, s.top_k, s.top_p)
        codes[:, i] = draw_tokens(logits, row_uniforms(generator, batch, device))
        if callback is not None and callback(i, torch.tensor(i), codes[:, : i + 1]) is not None:
            raise ValueError(
                "prior: callback_on_step_end returned latents, but the autoregressive prior's "
                "codes cannot be replaced; return None for stage 'prior'"
            )
    cands = prior.decode(codes).view(b, n_best, -1)
    text_embed = text.text_embed.to(cands)
    scores = (F.normalize(cands, dim=-1) * text_embed[:, None]).sum(-1)
    best = cands[torch.arange(b), scores.argmax(dim=1)]
    return best, cands
