"""Helpers of :mod:`unclip.pipeline`: argument checks, generator expansion, slerp, stage names."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from unclip.diffusion import Generator


def slerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    """Spherical interpolation between ``a`` and ``b`` (``[..., D]``) at weight ``w ∈ [0, 1]``."""
    an, bn = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    omega = torch.acos((an * bn).sum(-1, keepdim=True).clamp(-1 + 1e-7, 1 - 1e-7))
    so = torch.sin(omega)
    out = torch.sin((1 - w) * omega) / so * a.float() + torch.sin(w * omega) / so * b.float()
    small = omega.abs() < 1e-4
    return torch.where(small, (1 - w) * a.float() + w * b.float(), out)


def expand_generator(generator: Generator, batch: int, repeat: int, what: str) -> Generator:
    """One generator per final batch element (or a single shared one)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    gens = list(generator)
    if len(gens) == batch:
        return [g for g in gens for _ in range(repeat)]
    if len(gens) == batch * repeat:
        return gens
    raise ValueError(
        f"{what}: got {len(gens)} generators for {batch} prompts × {repeat} images; pass one "
        f"generator, one per prompt, or one per image"
    )


def check_count(n, what="num_images_per_prompt") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
    return n


def check_output_type(output_type: str) -> None:
    if output_type not in ("pil", "np", "pt"):
        raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")


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


def stage_kind(name: str) -> str:
    return "upsampler" if name.startswith("sr") else name


def sample_seed(seed: int, *key: int) -> int:
    """A 63-bit seed for one sample, from a run's ``seed`` and the sample's ``key`` (e.g. rank and
    sample number): independent of how samples are batched, so results do not depend on batch size
    and a resumed run draws what an uninterrupted one would."""
    digest = hashlib.blake2b(":".join(str(int(k)) for k in (seed, *key)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)
