"""Sampling a latent decoder (:class:`~unclip.nets.latent_decoder.LatentDecoder`): image
embedding → latents → image, with classifier-free guidance against a negative image embedding,
from noise (:func:`sample_latents`), from a noised image (:func:`img2img_latents`) or around a kept
region (:func:`inpaint_latents`). Each runs unclip's one denoising loop
(:func:`unclip.diffusion.loop.denoise_steps`) with any diffusers scheduler and reproduces
diffusers' ``KandinskyV22Pipeline``, ``KandinskyV22Img2ImgPipeline`` and
``KandinskyV22InpaintPipeline`` step for step::

    latents = sample_latents(decoder, scheduler, image_embed, negative_embed, height=512,
                             width=512, num_inference_steps=50, guidance_scale=4.0,
                             generator=torch.Generator().manual_seed(0))
    images = decoder.decode(latents)            # [B, 3, 512, 512] in [-1, 1]

``autocast_dtype`` (e.g. ``torch.bfloat16``) runs the UNet calls under ``torch.autocast``; the
default ``None`` computes in the weights' dtype, as diffusers does.

Conventions kept from diffusers so that the same seeds give the same images:

* guidance runs only for ``guidance_scale > 1`` (diffusers' rule; at or below 1 the conditional
  pass alone runs), the batch ordered ``[negative; positive]``;
* ``num_images_per_prompt`` repeats each embedding (and image, mask) in place
  (``repeat_interleave``), and the initial noise is drawn for the whole batch at once;
* image-to-image starts at step ``steps − int(steps · strength)`` and noises the image's latents
  with one draw from ``generator``;
* inpainting's mask is 1 where the image is repainted (white in a PIL mask), binarised at 0.5,
  resized to the latents by nearest neighbour and grown by one latent pixel (diffusers'
  ``prepare_mask``); after each step the kept region is reset to the image's latents noised to the
  next timestep with the initial noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from unclip.diffusion.loop import Generator, denoise_steps, initial_noise, randn_generator
from unclip.nets.latent_decoder import LatentDecoder

__all__ = [
    "sample_latents",
    "img2img_latents",
    "inpaint_latents",
    "grow_repaint_mask",
    "inpaint_inputs",
    "img2img_inputs",
    "loop_guidance",
]

Callback = Optional[Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]]


def loop_guidance(guidance_scale: float) -> float:
    """The scale :func:`~unclip.diffusion.loop.denoise_steps` takes for diffusers' Kandinsky
    rule: guided only above 1 (the loop guides at every scale but exactly 1)."""
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
        raise TypeError(f"guidance_scale must be a number, got {guidance_scale!r}")
    if not np.isfinite(guidance_scale):
        raise ValueError(f"guidance_scale must be finite, got {guidance_scale}")
    return float(guidance_scale) if guidance_scale > 1 else 1.0


def _check_steps(num_inference_steps) -> int:
    if (
        isinstance(num_inference_steps, bool)
        or not isinstance(num_inference_steps, int)
        or num_inference_steps < 1
    ):
        raise ValueError(
            f"num_inference_steps must be an integer >= 1, got {num_inference_steps!r}"
        )
    return num_inference_steps


def _conditioning(
    decoder: LatentDecoder,
    image_embed: torch.Tensor,
    negative_image_embed: torch.Tensor,
    num_images_per_prompt: int,
    guided: bool,
) -> torch.Tensor:
    """The embeddings the UNet reads: ``[B·n, D]``, or ``[negative; positive]`` ``[2·B·n, D]``
    when guided."""
    if image_embed.ndim != 2 or image_embed.shape[1] != decoder.embed_dim:
        raise ValueError(
            f"image_embeds must be [B, {decoder.embed_dim}] (the decoder's embedding width), got "
            f"{tuple(image_embed.shape)}"
        )
    if negative_image_embed.shape != image_embed.shape:
        raise ValueError(
            f"negative_image_embeds {tuple(negative_image_embed.shape)} must have the shape of "
            f"image_embeds {tuple(image_embed.shape)}"
        )
    if (
        isinstance(num_images_per_prompt, bool)
        or not isinstance(num_images_per_prompt, int)
        or num_images_per_prompt < 1
    ):
        raise ValueError(
            f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}"
        )
    param = next(decoder.unet.parameters())
    cond = image_embed.repeat_interleave(num_images_per_prompt, dim=0)
    if guided:
        neg = negative_image_embed.repeat_interleave(num_images_per_prompt, dim=0)
        cond = torch.cat([neg, cond])
    return cond.to(param.device, param.dtype)


def _denoiser(
    decoder: LatentDecoder, cond: torch.Tensor, mask_inputs: Optional[torch.Tensor] = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def denoise(x_in: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return decoder(x_in, t, cond, mask_inputs)

    return denoise


def sample_latents(
    decoder: LatentDecoder,
    scheduler,
    image_embed: torch.Tensor,
    negative_image_embed: torch.Tensor,
    *,
    height: int = 512,
    width: int = 512,
    num_inference_steps: int = 100,
    guidance_scale: float = 4.0,
    num_images_per_prompt: int = 1,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    callback: Callback = None,
    autocast_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Latents ``[B·n, C, h, w]`` (``n = num_images_per_prompt``, ``(h, w)`` =
    ``decoder.latent_size(height, width)``) for ``image_embed [B, D]``, guided away from
    ``negative_image_embed [B, D]``. ``latents``: the initial noise ``[B·n, C, h, w]`` instead of
    a draw from ``generator``. ``callback(i, t, x)`` runs after step ``i``; a tensor it returns
    replaces ``x``."""
    steps = _check_steps(num_inference_steps)
    scale = loop_guidance(guidance_scale)
    if decoder.inpaint:
        raise ValueError("this is an inpainting decoder: sample it with inpaint_latents")
    cond = _conditioning(
        decoder, image_embed, negative_image_embed, num_images_per_prompt, scale != 1
    )
    b = image_embed.shape[0] * num_images_per_prompt
    shape = (b, decoder.latent_channels, *decoder.latent_size(height, width))
    scheduler.set_timesteps(steps, device=cond.device)
    x = initial_noise(shape, scheduler, generator, latents, cond.device, cond.dtype)
    return denoise_steps(
        _denoiser(decoder, cond),
        x,
        scheduler,
        guidance_scale=scale,
        generator=generator,
        learned_variance=decoder.learned_variance,
        progress=progress,
        desc="decoder",
        callback=callback,
        autocast_dtype=autocast_dtype,
    )


def img2img_latents(
    decoder: LatentDecoder,
    scheduler,
    image_embed: torch.Tensor,
    negative_image_embed: torch.Tensor,
    images: torch.Tensor,
    *,
    strength: float = 0.3,
    num_inference_steps: int = 100,
    guidance_scale: float = 4.0,
    num_images_per_prompt: int = 1,
    generator: Generator = None,
    progress: bool = True,
    callback: Callback = None,
    autocast_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Latents ``[B·n, C, h, w]`` of ``images [B, 3, H, W]`` (in [-1, 1], sides multiples of
    ``decoder.scale_factor``) redrawn towards ``image_embed [B, D]``: the images' latents noised
    to the step ``strength`` (0 < strength <= 1) of the way back, then denoised. One image per
    embedding row."""
    steps = _check_steps(num_inference_steps)
    scale = loop_guidance(guidance_scale)
    if isinstance(strength, bool) or not isinstance(strength, (int, float)):
        raise TypeError(f"strength must be a number in (0, 1], got {strength!r}")
    if not 0 < strength <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    kept = min(int(steps * strength), steps)
    if kept < 1:
        raise ValueError(
            f"strength {strength} of {steps} steps runs no step (int(steps * strength) = 0); "
            "raise strength or num_inference_steps"
        )
    if decoder.inpaint:
        raise ValueError("this is an inpainting decoder: sample it with inpaint_latents")
    _check_images(images, image_embed.shape[0])
    cond = _conditioning(
        decoder, image_embed, negative_image_embed, num_images_per_prompt, scale != 1
    )
    x_0 = decoder.encode(images.to(cond.device, cond.dtype))
    x_0 = x_0.repeat_interleave(num_images_per_prompt, dim=0)
    scheduler.set_timesteps(steps, device=cond.device)
    start = steps - kept
    t = scheduler.timesteps[start : start + 1].repeat(x_0.shape[0])
    noise = randn_tensor(
        tuple(x_0.shape), generator=randn_generator(generator), device=cond.device, dtype=cond.dtype
    )
    x = scheduler.add_noise(x_0, noise, t)
    return denoise_steps(
        _denoiser(decoder, cond),
        x,
        scheduler,
        guidance_scale=scale,
        start=start,
        generator=generator,
        learned_variance=decoder.learned_variance,
        progress=progress,
        desc="decoder",
        callback=callback,
        autocast_dtype=autocast_dtype,
    )


def grow_repaint_mask(keep: torch.Tensor) -> torch.Tensor:
    """``keep [B, 1, h, w]`` (1 = kept, 0 = repainted) with the repainted region grown by one
    pixel, as diffusers' Kandinsky ``prepare_mask`` does: a kept pixel is repainted when a
    repainted one lies above, below, left, right, or on the main diagonal (up-left, down-right)
    of it. The anti-diagonal neighbours are left alone, as there."""
    repaint = (keep != 1).to(torch.float32)
    kernel = torch.tensor(
        [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], device=keep.device
    ).view(1, 1, 3, 3)
    grown = F.conv2d(repaint.flatten(0, 1)[:, None], kernel, padding=1).view(repaint.shape) > 0
    return keep.masked_fill(grown, 0)


def inpaint_latents(
    decoder: LatentDecoder,
    scheduler,
    image_embed: torch.Tensor,
    negative_image_embed: torch.Tensor,
    images: torch.Tensor,
    mask: torch.Tensor,
    *,
    height: Optional[int] = None,
    width: Optional[int] = None,
    num_inference_steps: int = 100,
    guidance_scale: float = 4.0,
    num_images_per_prompt: int = 1,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    callback: Callback = None,
    autocast_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Latents ``[B·n, C, h, w]`` that keep ``images [B, 3, H, W]`` (in [-1, 1]) where ``mask
    [B, 1, H, W]`` is 0 and repaint it, conditioned on ``image_embed [B, D]``, where it is 1
    (values binarised at 0.5; :func:`inpaint_inputs` prepares PIL images and masks as diffusers
    does). ``height``/``width`` default to the images' size and must give their latent size.
    Needs an inpainting decoder (its UNet reads ``2C + 1`` channels)."""
    steps = _check_steps(num_inference_steps)
    scale = loop_guidance(guidance_scale)
    if not decoder.inpaint:
        raise ValueError(
            "inpainting needs an inpainting decoder (a UNet with 2C + 1 input channels, e.g. "
            "kandinsky-2-2-decoder-inpaint); this one reads only the latents"
        )
    _check_images(images, image_embed.shape[0])
    if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[0] != images.shape[0]:
        raise ValueError(
            f"mask must be [B, 1, H, W] with one row per image, got {tuple(mask.shape)}"
        )
    if mask.shape[-2:] != images.shape[-2:]:
        raise ValueError(
            f"mask size {tuple(mask.shape[-2:])} differs from the image's "
            f"{tuple(images.shape[-2:])}; resize one to the other"
        )
    cond = _conditioning(
        decoder, image_embed, negative_image_embed, num_images_per_prompt, scale != 1
    )
    n = num_images_per_prompt
    x_0 = decoder.encode(images.to(cond.device, cond.dtype))
    keep = (mask.to(cond.device, cond.dtype) < 0.5).to(cond.dtype)
    keep = grow_repaint_mask(F.interpolate(keep, tuple(x_0.shape[-2:]), mode="nearest"))
    x_0, keep = x_0.repeat_interleave(n, dim=0), keep.repeat_interleave(n, dim=0)
    known = torch.cat([x_0 * keep, keep], dim=1)
    mask_inputs = torch.cat([known, known]) if scale != 1 else known
    h, w = decoder.latent_size(height or images.shape[-2], width or images.shape[-1])
    if (h, w) != tuple(x_0.shape[-2:]):
        raise ValueError(
            f"height/width {height}x{width} give {h}x{w} latents but the image's latents are "
            f"{tuple(x_0.shape[-2:])}; pass the image's own size"
        )
    scheduler.set_timesteps(steps, device=cond.device)
    x = initial_noise(tuple(x_0.shape), scheduler, generator, latents, cond.device, cond.dtype)
    noise = x.clone()
    timesteps = scheduler.timesteps

    def keep_known(i: int, t: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
        # the kept region at the noise level of the next step (clean after the last)
        known_t = x_0
        if i < len(timesteps) - 1:
            known_t = scheduler.add_noise(x_0, noise, timesteps[i + 1 : i + 2])
        x = keep * known_t + (1 - keep) * x
        if callback is not None:
            new = callback(i, t, x)
            x = x if new is None else new
        return x

    return denoise_steps(
        _denoiser(decoder, cond, mask_inputs),
        x,
        scheduler,
        guidance_scale=scale,
        generator=generator,
        learned_variance=decoder.learned_variance,
        progress=progress,
        desc="decoder",
        callback=keep_known,
        autocast_dtype=autocast_dtype,
    )


def _check_images(images, rows: int) -> None:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            "image must be a [B, 3, H, W] tensor in [-1, 1] (img2img_inputs and inpaint_inputs "
            f"convert PIL images), got {getattr(images, 'shape', type(images).__name__)}"
        )
    if images.shape[0] != rows:
        raise ValueError(
            f"{images.shape[0]} images for {rows} image embeddings; pass one image per embedding"
        )


# inputs ----------------------------------------------------------------------------------------
ImageInput = Union[Image.Image, np.ndarray, torch.Tensor, list]


def img2img_inputs(
    image: ImageInput, height: int, width: int, scale_factor: int, latent_channels: int
) -> torch.Tensor:
    """PIL image(s), arrays or tensors → ``[B, 3, H', W']`` in [-1, 1], as diffusers'
    ``KandinskyV22Img2ImgPipeline`` prepares them (its ``VaeImageProcessor``: bicubic resize to
    ``height × width`` rounded down to multiples of ``scale_factor``)."""
    from diffusers.image_processor import VaeImageProcessor

    items = image if isinstance(image, list) else [image]
    if not items or not all(isinstance(i, (Image.Image, torch.Tensor)) for i in items):
        raise TypeError(
            "image must be a PIL image, a [B, 3, H, W] tensor in [-1, 1], or a list of them"
        )
    processor = VaeImageProcessor(
        vae_scale_factor=scale_factor,
        vae_latent_channels=latent_channels,
        resample="bicubic",
        reducing_gap=1,
    )
    return torch.cat([processor.preprocess(i, width, height) for i in items], dim=0)


def inpaint_inputs(
    image: ImageInput, mask: ImageInput, height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [B, 3, H, W] in [-1, 1], mask [B, 1, H, W] in {0, 1})`` from what diffusers'
    ``KandinskyV22InpaintPipeline`` takes: PIL images (resized to ``width × height``, bicubic;
    the mask with Lanczos, read as grey levels), ``H × W × 3`` arrays and ``H × W`` masks, or
    tensors (``[3, H, W]``/``[B, 3, H, W]`` in [-1, 1]; masks ``[H, W]``, ``[1, H, W]``,
    ``[B, H, W]`` or ``[B, 1, H, W]`` in [0, 1]). The mask is 1 where the image is repainted."""
    if isinstance(image, torch.Tensor) != isinstance(mask, torch.Tensor):
        raise TypeError("image and mask_image must both be tensors, or neither")
    if isinstance(image, torch.Tensor):
        assert isinstance(mask, torch.Tensor)
        images = image[None] if image.ndim == 3 else image
        m = mask.float()
        if m.ndim == 2:
            m = m[None, None]
        elif m.ndim == 3:
            m = m[None] if m.shape[0] == 1 else m[:, None]
        if images.ndim != 4 or m.ndim != 4:
            raise ValueError(
                f"image must be [3, H, W] or [B, 3, H, W] and mask [H, W], [B, H, W] or "
                f"[B, 1, H, W]; got {tuple(image.shape)} and {tuple(mask.shape)}"
            )
        if images.shape[-2:] != m.shape[-2:] or images.shape[0] != m.shape[0]:
            raise ValueError(
                f"image {tuple(images.shape)} and mask {tuple(m.shape)} must have the same batch "
                "size and height × width"
            )
        if images.min() < -1 or images.max() > 1:
            raise ValueError("image tensors must be in [-1, 1]")
        if m.min() < 0 or m.max() > 1:
            raise ValueError("mask tensors must be in [0, 1]")
        return images.float(), (m >= 0.5).float()
    images_list = image if isinstance(image, list) else [image]
    masks_list = mask if isinstance(mask, list) else [mask]
    arrays = []
    for i in images_list:
        if isinstance(i, Image.Image):
            i = np.array(
                i.resize((width, height), Image.Resampling.BICUBIC, reducing_gap=1).convert("RGB")
            )
        if not isinstance(i, np.ndarray) or i.ndim != 3 or i.shape[2] != 3:
            raise TypeError("image must be PIL images, H × W × 3 arrays or tensors")
        arrays.append(i)
    images = torch.from_numpy(np.stack(arrays).transpose(0, 3, 1, 2)).float() / 127.5 - 1.0
    mask_arrays = []
    for m_ in masks_list:
        if isinstance(m_, Image.Image):
            resized = m_.resize((width, height), Image.Resampling.LANCZOS).convert("L")
            m_ = np.array(resized).astype(np.float32) / 255.0
        if not isinstance(m_, np.ndarray) or m_.ndim != 2:
            raise TypeError("mask_image must be PIL images, H × W arrays or tensors")
        mask_arrays.append(m_)
    masks = torch.from_numpy(np.stack(mask_arrays)[:, None].astype(np.float32))
    if masks.shape[0] != images.shape[0] or masks.shape[-2:] != images.shape[-2:]:
        raise ValueError(
            f"{masks.shape[0]} masks of {tuple(masks.shape[-2:])} for {images.shape[0]} images "
            f"of {tuple(images.shape[-2:])}; give one mask of the image's size per image"
        )
    return images, (masks >= 0.5).float()
