"""The pieces the pipeline's edits are built from (:mod:`unclip.pipeline.editing`): reading images
and masks, resizing them to a stage's size, one deterministic DDIM step forward and its inverse,
and the outputs of the edits (:class:`EditOutput`, :class:`Inversion`).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.stages import Denoiser
from unclip.sampling.utils import check_count, slerp
from unclip.utils.images import (
    open_image_file,
    pil_to_tensor,
    resize_crop_box,
    resize_crop_tensor,
)

#: samplers whose step keeps no history, so a step may be taken again (RePaint's resampling)
RESAMPLING_SCHEDULERS = ("ddim", "ddpm", "unclip")


#: how far each fixed-point iteration of an inversion step moves towards its new solution: the
#: undamped iteration (1.0) oscillates away on some images (docs/editing.md), half a step converges
FIXED_POINT_DAMPING = 0.5


@dataclass
class EditOutput(UnCLIPOutput):
    """:class:`~unclip.pipeline.output.UnCLIPOutput` of an edit, plus ``latents`` (the decoder's
    starting ``x_T`` when it came from an inversion) and ``info`` (per-image values such as
    ``theta`` or
    ``strength``, and the inversion's round-trip ``inversion_error``)."""

    latents: Optional[torch.Tensor] = None
    info: dict = field(default_factory=dict)


@dataclass
class Inversion:
    """Result of :func:`unclip.pipeline.editing.invert` (``pipe.invert``): ``latents [B,
    *decoder.sample_shape]`` (the decoder's ``x_T``: pixels, or a latent decoder's latents), the
    ``image_embeds [B, D]`` and caption it was inverted with, the
    ``image`` at the decoder's resolution in [-1, 1], its ``reconstruction`` (decoded back from
    ``latents``, when asked) and ``error``, the root-mean-square difference of the two in [-1, 1]
    units (None without a reconstruction), and the ``fixed_point`` iterations of each inverted
    step."""

    latents: torch.Tensor
    image_embeds: torch.Tensor
    image: torch.Tensor
    steps: int
    guidance_scale: float
    caption: Optional[str] = None
    reconstruction: Optional[torch.Tensor] = None
    error: Optional[float] = None
    fixed_point: int = 0


# ------------------------------------------------------------------------------------ inputs
def read_image(image, what: str = "image") -> torch.Tensor:
    """A PIL image, an image file, a uint8 array ``[H, W, 3]`` or a float tensor ``[3, H, W]`` /
    ``[B, 3, H, W]`` in [-1, 1] → a float tensor ``[B, 3, H, W]`` in [-1, 1]; a file that cannot
    be read is a ``ValueError`` naming it."""
    if isinstance(image, (str, os.PathLike)):
        image = open_image_file(image, what)
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"{what}: an array must be [H, W, 3] uint8, got {image.shape}")
        image = Image.fromarray(image.astype(np.uint8))
    if isinstance(image, Image.Image):
        return pil_to_tensor(image)[None]
    if isinstance(image, torch.Tensor):
        x = image[None] if image.ndim == 3 else image
        if x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
            raise ValueError(
                f"{what}: a tensor must be float [3, H, W] or [B, 3, H, W] in [-1, 1], got "
                f"{x.dtype} {tuple(image.shape)}"
            )
        return x.float().clamp(-1, 1)
    raise TypeError(
        f"{what} must be a PIL image, a file path, a uint8 array [H, W, 3] or a tensor in "
        f"[-1, 1], got {type(image).__name__}"
    )


def read_mask(mask, height: int, width: int) -> torch.Tensor:
    """An inpainting mask → bool ``[1, 1, H, W]``, True where the image is regenerated. A PIL
    image or file (white = regenerate, as in diffusers), a bool/uint8/float array or tensor
    ``[H, W]`` (nonzero, or above 0.5 for floats, = regenerate). It must have the image's size
    ``height × width`` and select at least one pixel."""
    if isinstance(mask, (str, os.PathLike)):
        mask = open_image_file(mask, "mask", mode="L")
    if isinstance(mask, Image.Image):
        m = torch.from_numpy(np.asarray(mask.convert("L")) > 127)
    elif isinstance(mask, (np.ndarray, torch.Tensor)):
        m = torch.as_tensor(np.asarray(mask) if isinstance(mask, np.ndarray) else mask)
        m = m.squeeze()
        if m.ndim == 3 and m.shape[-1] in (1, 3):  # [H, W, C] image array
            m = m[..., 0]
        if m.dtype == torch.bool:
            pass
        elif m.is_floating_point():
            m = m > 0.5
        else:
            m = m > (127 if m.dtype == torch.uint8 and int(m.max()) > 1 else 0)
    else:
        raise TypeError(
            f"mask must be a PIL image, a file path, an array or a tensor [H, W], got "
            f"{type(mask).__name__}"
        )
    if m.ndim != 2:
        raise ValueError(f"mask must be one channel [H, W], got shape {tuple(m.shape)}")
    if tuple(m.shape) != (height, width):
        raise ValueError(
            f"mask is {m.shape[1]}x{m.shape[0]} pixels but the image is {width}x{height}; give a "
            "mask of the image's size (white = regenerate)"
        )
    if not bool(m.any()):
        raise ValueError("mask selects no pixel to regenerate (white, 1 or True marks them)")
    return m[None, None].cpu()


def at_size(x: torch.Tensor, size: int) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [-1, 1] at a stage's ``size`` (shorter side, centre crop); the
    image itself when it already is that size."""
    return resize_crop_tensor(x.float(), size).clamp(-1, 1)


def mask_at_size(m: torch.Tensor, size: int) -> torch.Tensor:
    """A bool mask ``[1, 1, H, W]`` at ``size`` with the images' geometry: a pixel is regenerated
    if any part of it was (area resampling, so the kept region never grows into the masked one)."""
    nh, nw, top, left = resize_crop_box(m.shape[-2], m.shape[-1], size)
    x = m.float()
    if (nh, nw) != tuple(m.shape[-2:]):
        x = F.interpolate(x, size=(nh, nw), mode="area")
    return x[..., top : top + size, left : left + size] > 0


# -------------------------------------------------------------------------------- DDIM math
def _affine(out, a_t, a_s, prediction_type: str):
    """``(A, B)`` with ``x_s = A·x_t + B`` for DDIM's deterministic step from level ``a_t`` to
    ``a_s`` (alphas cumprod) given the model output ``out`` (``x̂_0`` not clipped)."""
    st, ss = math.sqrt(a_t), math.sqrt(a_s)
    nt, ns = math.sqrt(1 - a_t), math.sqrt(1 - a_s)
    if prediction_type == "epsilon":  # x0 = (x - nt·eps) / st
        return ss / st, (ns - ss * nt / st) * out
    if prediction_type == "sample":  # eps = (x - st·x0) / nt
        return ns / nt, (ss - ns * st / nt) * out
    if prediction_type == "v_prediction":  # x0 = st·x − nt·v, eps = st·v + nt·x
        return ss * st + ns * nt, (ns * st - ss * nt) * out
    raise ValueError(f"unknown prediction_type {prediction_type!r}")


def ddim_step(out, x_t, a_t: float, a_s: float, prediction_type: str) -> torch.Tensor:
    """DDIM's deterministic (η = 0) step from ``x_t`` at level ``a_t`` to level ``a_s``."""
    a, b = _affine(out, a_t, a_s, prediction_type)
    return a * x_t + b


def ddim_invert_step(out, x_s, a_t: float, a_s: float, prediction_type: str) -> torch.Tensor:
    """The ``x_t`` that :func:`ddim_step` takes to ``x_s`` with model output ``out``."""
    a, b = _affine(out, a_t, a_s, prediction_type)
    return (x_s - b) / a


def _check_fixed_point(value) -> int:
    """``value`` as the number of fixed-point iterations, or a ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        count = -1
    if count < 0:
        raise ValueError(f"invert: fixed_point must be an integer >= 0, got {value!r}")
    return count


def _levels(d: Denoiser) -> list[tuple[float, float]]:
    """``(a_t, a_s)`` of each DDIM step of ``d``'s timesteps (:func:`scheduler_levels`)."""
    return scheduler_levels(d.scheduler)


def scheduler_levels(sched, final: Optional[float] = None) -> list[tuple[float, float]]:
    """``(a_t, a_s)`` of each DDIM step of ``sched``'s timesteps: from ``t`` to the next
    timestep, and after the last to the fully denoised level ``final`` (default: the schedule's
    first, ``alphas_cumprod[0]``; a ``DDIMScheduler``'s own is its ``final_alpha_cumprod``)."""
    ac = sched.alphas_cumprod.double()
    ts = [int(t) for t in sched.timesteps]
    final = float(ac[0]) if final is None else float(final)
    return [
        (float(ac[t]), float(ac[ts[i + 1]]) if i + 1 < len(ts) else final) for i, t in enumerate(ts)
    ]


def ddim_path(
    output: Callable[[torch.Tensor, Any], torch.Tensor],
    x: torch.Tensor,
    timesteps: Sequence,
    levels: Sequence[tuple[float, float]],
    prediction_type: str,
    invert: bool,
    *,
    fixed_point: int = 0,
    progress: bool = False,
    desc: str = "ddim",
) -> torch.Tensor:
    """Deterministic DDIM through ``timesteps`` (``levels`` from :func:`scheduler_levels`) with
    the model output ``output(x, t)``: from noise to the sample, or with ``invert`` from the
    sample back to the noise it decodes from, each inverted step refined by ``fixed_point``
    damped iterations (one more model call each: the decode evaluates the model at ``x_t``, not
    at ``x_s``)."""
    from tqdm.auto import tqdm

    ts = list(timesteps)
    order = range(len(ts) - 1, -1, -1) if invert else range(len(ts))
    for i in tqdm(order, desc=desc, disable=not progress, leave=False):
        out = output(x, ts[i]).float()
        a_t, a_s = levels[i]
        if not invert:
            x = ddim_step(out, x, a_t, a_s, prediction_type)
            continue
        x_t = ddim_invert_step(out, x, a_t, a_s, prediction_type)
        for _ in range(fixed_point):
            solved = ddim_invert_step(output(x_t, ts[i]).float(), x, a_t, a_s, prediction_type)
            x_t = x_t + FIXED_POINT_DAMPING * (solved - x_t)
        x = x_t
    return x


def check_text_diff_args(image, source_caption, target_caption, num_steps, max_theta) -> int:
    """A text diff's arguments checked (one image, two non-empty captions, θ in (0, 1]); returns
    the number of frames."""
    n = check_count(num_steps, "num_steps")
    if not 0 < float(max_theta) <= 1:
        raise ValueError(f"text_diff: max_theta must be in (0, 1], got {max_theta!r}")
    for name, c in (("source_caption", source_caption), ("target_caption", target_caption)):
        if not isinstance(c, str) or not c.strip():
            raise ValueError(f"text_diff: {name} must be a non-empty string")
    if read_image(image).shape[0] != 1:
        raise ValueError("text_diff takes one image; call it once per image")
    return n


def text_diff_embeds(
    image_embeds: torch.Tensor, text_embeds: torch.Tensor, n: int, max_theta: float
) -> tuple[torch.Tensor, list[float]]:
    """The paper's text diff (§3.3): ``image_embeds [1, D]`` turned towards the normalised
    difference of ``text_embeds [2, D]`` (target minus source) by ``slerp`` at ``n`` values of θ
    from 0 to ``max_theta``; returns the ``[n, D]`` embeddings and the θ values."""
    z = text_embeds.float()
    diff = z[1] - z[0]
    if float(diff.norm()) < 1e-6:
        raise ValueError(
            "text_diff: the source and target captions encode identically; give two captions "
            "that differ in what should change"
        )
    z_d = F.normalize(diff, dim=-1)[None].to(image_embeds)
    thetas = [float(max_theta) * i / (n - 1) for i in range(n)] if n > 1 else [0.0]
    # rotate on the unit sphere and keep the image embedding's norm (a CLIP whose embeddings
    # are not normalised, e.g. Karlo's, would otherwise scale the direction down)
    norm = image_embeds.norm(dim=-1, keepdim=True)
    unit = F.normalize(image_embeds, dim=-1)
    return torch.cat([slerp(unit, z_d, th) * norm for th in thetas]), thetas


def _same_seed(generator: Optional[torch.Generator], n: int) -> list[torch.Generator]:
    """``n`` generators with one seed drawn from ``generator``, so that frames differ only by
    what is edited."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError("generator must be one torch.Generator for a sequence of frames")
    src = generator if generator is not None else torch.Generator().manual_seed(0)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=src))
    return [torch.Generator().manual_seed(seed) for _ in range(n)]
