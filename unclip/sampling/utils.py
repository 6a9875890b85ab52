"""Helpers of :mod:`unclip.pipeline`: argument and component checks, generator expansion, slerp,
per-sample seeds."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from unclip.diffusion.loop import (
    Generator,
)
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior

if TYPE_CHECKING:
    from unclip.nets.clip import CLIP
    from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
    from unclip.nets.prior import UnCLIPPrior


def slerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    """Spherical interpolation between ``a`` and ``b`` (``[..., D]``) at weight ``w ∈ [0, 1]``."""
    an, bn = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    omega = torch.acos((an * bn).sum(-1, keepdim=True).clamp(-1 + 1e-7, 1 - 1e-7))
    so = torch.sin(omega)
    out = torch.sin((1 - w) * omega) / so * a.float() + torch.sin(w * omega) / so * b.float()
    small = omega.abs() < 1e-4
    return torch.where(small, (1 - w) * a.float() + w * b.float(), out)


def expand_generator(
    generator: Generator, batch: int, repeat: int, what: str, candidates: int = 1
) -> Generator:
    """One generator per row of ``batch × repeat`` (or a single shared one), from one generator,
    one per prompt (``batch``), or one per row. ``candidates``: rows per output image within
    ``repeat`` (the decoder's candidates), so that one generator per image is also taken (each
    image's candidates draw from its own)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    gens = list(generator)
    if len(gens) == batch:
        return [g for g in gens for _ in range(repeat)]
    if len(gens) == batch * repeat:
        return gens
    images = repeat // candidates
    if candidates > 1 and len(gens) == batch * images:
        return [g for g in gens for _ in range(candidates)]
    per_image = f" ({candidates} candidates per image)" if candidates > 1 else ""
    raise ValueError(
        f"{what}: got {len(gens)} generators for {batch} prompts × {images} images{per_image}; "
        "pass one generator, one per prompt, or one per image"
    )


def rows_of(embeds: Optional[torch.Tensor], prompts: list[int], n: int):
    """The rows of ``embeds`` (``n`` per prompt, prompt-major; or None) of these prompts."""
    if embeds is None:
        return None
    return torch.cat([embeds[i * n : (i + 1) * n] for i in prompts])


def check_count(n, what="num_images_per_prompt") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
    return n


#: what a pipeline call may return its images as (:func:`unclip.utils.images.to_output`)
OUTPUT_TYPES = ("pil", "np", "pt", "latent", "uint8")


def check_output_type(output_type: str) -> None:
    if output_type not in OUTPUT_TYPES:
        raise ValueError(
            f"output_type must be one of {', '.join(repr(t) for t in OUTPUT_TYPES)}, got "
            f"{output_type!r} ('np': float32 [N, H, W, 3] in [0, 1], as diffusers; 'uint8': the "
            "0-255 pixels)"
        )


def check_embeds(image_embed, dim: int) -> torch.Tensor:
    if (
        not isinstance(image_embed, torch.Tensor)
        or image_embed.ndim != 2
        or image_embed.shape[1] != dim
    ):
        shape = (
            tuple(image_embed.shape)
            if isinstance(image_embed, torch.Tensor)
            else type(image_embed).__name__
        )
        raise ValueError(f"image_embed must be a tensor [B, {dim}], got {shape}")
    if not torch.isfinite(image_embed).all():
        raise ValueError("image_embed contains NaN or inf")
    return image_embed


def check_components(
    clip: CLIP,
    prior: Optional[UnCLIPPrior],
    decoder: UnCLIPDecoder,
    upsamplers: Mapping[str, UnCLIPUpsampler],
    reranker: Optional[CLIP],
) -> None:
    """Raise ``ValueError`` naming the mismatch unless the components fit together: the prior's and
    decoder's embedding and text sizes match ``clip``, the reranker has an image tower, and each
    upsampler (by stage name, in order) takes the previous stage's image size."""
    d, w, L = clip.embed_dim, clip.text_width, clip.context_length
    if prior is not None:
        pc = prior.config
        if pc.embed_dim != d:
            raise ValueError(
                f"prior embed_dim {pc.embed_dim} != CLIP embed_dim {d} (clip: {clip.model_name})"
            )
        # a prior with its own caption transformer reads caption ids, not the CLIP's token states
        own = getattr(pc, "text_encoder", "clip") == "transformer"
        if pc.text_width != w and not own:
            raise ValueError(f"prior text_width {pc.text_width} != CLIP text width {w}")
        if pc.context_length != L and not own:
            raise ValueError(f"prior context_length {pc.context_length} != CLIP context length {L}")
    if reranker is not None and not reranker.has_vision:
        raise ValueError(
            f"reranker CLIP {reranker.model_name!r} has no image tower, so it cannot "
            "score candidates; use a CLIP with image-tower weights"
        )
    dc = decoder.config
    if dc.embed_dim != d:
        raise ValueError(
            f"decoder embed_dim {dc.embed_dim} != CLIP embed_dim {d} (clip: {clip.model_name})"
        )
    # a decoder with its own text encoder reads caption tokens, not the CLIP's token states
    if dc.use_text_tokens and dc.text_encoder == "clip" and dc.text_width != w:
        raise ValueError(f"decoder text_width {dc.text_width} != CLIP text width {w}")
    size = dc.sample_size
    for name, up in upsamplers.items():
        if up.config.low_res_size != size:
            raise ValueError(
                f"upsampler {name} expects {up.config.low_res_size}px input but the previous "
                f"stage makes {size}px images"
            )
        size = up.config.sample_size


def stages_until(upsampler_names: list[str], last_stage: Optional[str]) -> list[str]:
    """The upsamplers to run when stopping after ``last_stage`` (None: every upsampler)."""
    if last_stage is None:
        return upsampler_names
    if last_stage == "decoder":
        return []
    if last_stage not in upsampler_names:
        raise ValueError(
            f"last_stage must be 'decoder' or one of this pipeline's upsamplers "
            f"{upsampler_names}, got {last_stage!r}"
        )
    return upsampler_names[: upsampler_names.index(last_stage) + 1]


def sample_seed(seed: int, *key: int) -> int:
    """A 63-bit seed for one sample, from a run's ``seed`` and the sample's ``key`` (e.g. rank and
    sample number): independent of how samples are batched, so results do not depend on batch size
    and a resumed run draws what an uninterrupted one would."""
    digest = hashlib.blake2b(":".join(str(int(k)) for k in (seed, *key)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def check_finite(
    stage: str,
    x: torch.Tensor,
    autocast_dtype: Optional[torch.dtype] = None,
    *,
    module: Optional[torch.nn.Module] = None,
    settings=None,
):
    """``x``, a stage's sampled result, if every value is finite; else a one-line ``ValueError``
    naming the stage. NaN weights (a corrupt or diverged checkpoint) otherwise reach the user as
    black images; float16 can also overflow to inf, and a sampler can diverge at few steps.

    ``module``: the stage's network; its weights are checked (only on failure) so that the message
    blames the model folder only when they hold NaN/inf. ``settings``: the stage's sampling
    settings, named in the message when the weights are finite."""
    if torch.isfinite(x).all():
        return x
    if module is not None and not all(torch.isfinite(p).all() for p in module.parameters()):
        hint = "its weights hold NaN/inf; check the model folder"
    elif module is not None:
        used = ""
        if settings is not None:
            name = getattr(settings, "scheduler", None)
            name = name if isinstance(name, str) else type(name).__name__
            used = f" ({name}, {getattr(settings, 'steps', '?')} steps)"
        hint = (
            f"its weights are finite, so the sampler{used} diverged or the inputs hold NaN/inf: "
            "try another sampler or more steps"
        )
    else:
        hint = (
            "its weights or inputs hold NaN/inf (check the model folder), or the sampler diverged"
        )
    if autocast_dtype == torch.float16 or x.dtype == torch.float16:
        hint += (
            " (or float16 overflowed: try bfloat16 or full precision, autocast_dtype=None / "
            "--autocast none)"
        )
    raise ValueError(f"{stage} produced NaN/inf values: {hint}")


def stage_kind(name: str) -> str:
    """``"prior"``, ``"decoder"`` or ``"upsampler"`` for a stage name (``sr64`` is an upsampler)."""
    return "upsampler" if name.startswith("sr") else name
