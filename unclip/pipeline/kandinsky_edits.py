"""Kandinsky 2.2's edits along the decoder's deterministic DDIM path (the paper's §3 on the latent
decoder): DDIM inversion of an image's MoVQ latents, text diffs, and interpolation between prompts
or images, as :class:`KandinskyEdits`, a capability
:class:`~unclip.pipeline.kandinsky.KandinskyPipeline` inherits.

    inv = pipe.invert(image, steps=50)                 # inv.latents: the x_T it decodes from
    frames = pipe.text_diff(image, "a cat", "a dog", num_steps=5).images
    frames = pipe.interpolate("a red cat", "a blue dog", num_steps=5).images

The DDIM path is the folder scheduler's noise schedule stepped as ``DDIMScheduler`` steps it with
η = 0 (the same timesteps and final level);
its model output is the UNet's first ``C`` channels (a learned-variance UNet's second half is its
variance), guided against the embedding of no image when ``guidance_scale > 1`` (1, the default
of the inversions, inverts best: guided updates are not the gradient of one model).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from diffusers.schedulers.scheduling_ddim import DDIMScheduler

from unclip.diffusion.loop import Generator, guided_output, is_guided
from unclip.nets.clip import CLIP
from unclip.nets.latent_decoder import LatentDecoder
from unclip.pipeline.base import BasePipeline
from unclip.pipeline.edit_ops import (
    EditOutput,
    Inversion,
    _check_fixed_point,
    _same_seed,
    at_size,
    check_text_diff_args,
    ddim_path,
    read_image,
    scheduler_levels,
    text_diff_embeds,
)
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.kandinsky import prior_text, zero_image_embed
from unclip.sampling.stages import StepCallback
from unclip.sampling.utils import check_count, check_output_type, slerp
from unclip.utils.images import as_image_input, to_output
from unclip.utils.offload import releases_gpu

__all__ = ["KandinskyEdits"]


def _decoder_ddim(
    pipe: KandinskyEdits,
    embeds: torch.Tensor,
    steps: int,
    guidance_scale: float,
    x: torch.Tensor,
    invert: bool,
    progress: bool,
    desc: str,
    fixed_point: int = 0,
) -> torch.Tensor:
    """``x`` (latents ``[B, C, h, w]``) along the decoder's DDIM path conditioned on ``embeds``:
    to the sample, or with ``invert`` back to the noise it decodes from."""
    assert pipe.clip is not None
    sched = DDIMScheduler.from_config(pipe.scheduler.config)
    sched.set_timesteps(check_count(steps, "steps"), device=pipe.device)
    decoder = pipe.decoder
    guided = is_guided(guidance_scale)
    cond = embeds.to(pipe.device)
    if guided:
        pipe._onload("clip")
        cond = torch.cat([zero_image_embed(pipe.clip, embeds.shape[0]).to(cond), cond])
    pipe._onload("decoder")
    param = next(decoder.unet.parameters())
    cond = cond.to(param.device, param.dtype)
    c = decoder.latent_channels

    def output(x_in: torch.Tensor, t) -> torch.Tensor:
        out = guided_output(
            lambda xx, tt: decoder(xx.to(param.dtype), tt, cond).float(),
            x_in,
            t,
            sched,
            guidance_scale=float(guidance_scale),
            learned_variance=decoder.learned_variance,
            autocast_dtype=pipe.autocast_dtype,
        )
        return out[:, :c]

    return ddim_path(
        output,
        x.to(param.device, torch.float32),
        sched.timesteps,
        # the last step ends where diffusers' DDIM ends it (its final_alpha_cumprod)
        scheduler_levels(sched, float(sched.final_alpha_cumprod)),
        str(pipe.scheduler.config.get("prediction_type", "epsilon")),
        invert,
        fixed_point=fixed_point,
        progress=progress,
        desc=desc,
    )


def _side(pipe: KandinskyEdits, size: Optional[int]) -> int:
    side = pipe.resolution if size is None else size
    f2 = pipe.decoder.scale_factor**2
    if isinstance(side, bool) or not isinstance(side, int) or side < f2 or side % f2:
        raise ValueError(
            f"size must be a positive multiple of {f2} (the MoVQ's downsampling, squared), got "
            f"{side!r}"
        )
    return side


@torch.no_grad()
def _invert(
    pipe: KandinskyEdits,
    image,
    steps: int = 50,
    guidance_scale: float = 1.0,
    image_embeds: Optional[torch.Tensor] = None,
    size: Optional[int] = None,
    reconstruct: bool = True,
    progress: bool = True,
    fixed_point: int = 2,
) -> Inversion:
    """:meth:`KandinskyEdits.invert`."""
    progress = pipe._progress(progress)
    fixed_point = _check_fixed_point(fixed_point)
    x = read_image(image)
    small = at_size(x, _side(pipe, size)).to(pipe.device)
    embeds = pipe._image_embed(x) if image_embeds is None else image_embeds.to(pipe.device)
    if embeds.shape[0] != small.shape[0]:
        raise ValueError(f"invert: {embeds.shape[0]} image_embeds for {small.shape[0]} images")
    pipe._onload("decoder")
    start = pipe.decoder.encode(small).float()
    latents = _decoder_ddim(
        pipe, embeds, steps, guidance_scale, start, True, progress, "invert", fixed_point
    )
    inv = Inversion(latents, embeds.float(), small, int(steps), float(guidance_scale))
    inv.fixed_point = fixed_point
    if reconstruct:
        back = _decoder_ddim(
            pipe, embeds, steps, guidance_scale, latents, False, progress, "reconstruct"
        )
        rec = pipe.decoder.decode(back).float().clamp(-1, 1)
        inv.reconstruction = rec
        inv.error = float((rec - small.float()).pow(2).mean().sqrt())
    return inv


@torch.no_grad()
def _text_diff(
    pipe: KandinskyEdits,
    image,
    source_caption: str,
    target_caption: str,
    num_steps: int = 5,
    max_theta: float = 0.5,
    steps: int = 50,
    guidance_scale: float = 1.0,
    size: Optional[int] = None,
    output_type: str = "pil",
    progress: bool = True,
    fixed_point: int = 2,
) -> EditOutput:
    """:meth:`KandinskyEdits.text_diff`."""
    check_output_type(output_type)
    progress = pipe._progress(progress)
    n = check_text_diff_args(image, source_caption, target_caption, num_steps, max_theta)
    inv = _invert(
        pipe, image, steps, guidance_scale, size=size, progress=progress, fixed_point=fixed_point
    )
    assert pipe.clip is not None
    pipe._onload("clip")
    z = prior_text(pipe.clip, [source_caption, target_caption]).text_embed
    embeds, thetas = text_diff_embeds(inv.image_embeds, z, n, max_theta)
    x = _decoder_ddim(
        pipe, embeds, steps, guidance_scale, inv.latents.repeat(n, 1, 1, 1), False, progress,
        "text diff",
    )  # fmt: skip
    images = pipe.decoder.decode(x).float().clamp(-1, 1)
    info = {"theta": thetas, "inversion_error": inv.error}
    return EditOutput(to_output(images, output_type), embeds, latents=inv.latents, info=info)


@torch.no_grad()
def _interpolate(
    pipe: KandinskyEdits,
    start,
    end,
    num_steps: int = 5,
    generator: Optional[torch.Generator] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    sampling=None,
    output_type: str = "pil",
    progress: bool = True,
    callback_on_step_end=None,
):
    """:meth:`KandinskyEdits.interpolate`."""
    check_output_type(output_type)
    if check_count(num_steps, "num_steps") < 2:
        raise ValueError("interpolate: num_steps must be >= 2")
    settings = pipe.sampling_settings(sampling)
    seed_gen = generator if generator is not None else torch.Generator().manual_seed(0)
    ends = []
    for x in (start, end):
        if isinstance(x, str) and not os.path.isfile(x):
            embeds, _ = pipe.sample_image_embeds(
                x,
                generator=seed_gen,
                sampling=settings,
                progress=progress,
                callback_on_step_end=callback_on_step_end,
            )
            ends.append(embeds)
        else:
            ends.append(pipe._image_embed(as_image_input(x)))
    ws = torch.linspace(0, 1, num_steps)
    embeds = torch.cat([slerp(ends[0].float(), ends[1].float(), float(w)) for w in ws])
    assert pipe.clip is not None
    pipe._onload("clip")
    negative = zero_image_embed(pipe.clip, num_steps)
    images = pipe.decode(
        embeds,
        negative,
        height=height,
        width=width,
        generator=_same_seed(seed_gen, num_steps),
        sampling=settings,
        progress=progress,
        callback_on_step_end=callback_on_step_end,
        output_type=output_type,
    )
    return UnCLIPOutput(images=images, image_embeds=embeds)


class KandinskyEdits(BasePipeline):
    """:meth:`invert`, :meth:`text_diff` and :meth:`interpolate` on a Kandinsky pipeline (see the
    module doc). What they read of the pipeline is declared here; the pipeline provides it."""

    decoder: LatentDecoder
    clip: Optional[CLIP]
    scheduler: Any
    resolution: int

    if TYPE_CHECKING:  # the pipeline's own, declared for the edits that call them

        def _image_embed(self, image) -> torch.Tensor: ...

        def sample_image_embeds(
            self,
            prompt,
            negative_prompt=None,
            num_images_per_prompt: int = 1,
            generator: Generator = None,
            latents: Optional[torch.Tensor] = None,
            sampling: Optional[Mapping] = None,
            progress: bool = True,
            callback_on_step_end: Optional[StepCallback] = None,
        ) -> tuple[torch.Tensor, torch.Tensor]: ...

        def decode(
            self,
            image_embeds: torch.Tensor,
            negative_image_embeds: torch.Tensor,
            height: Optional[int] = None,
            width: Optional[int] = None,
            num_images_per_prompt: int = 1,
            generator: Generator = None,
            latents: Optional[torch.Tensor] = None,
            sampling: Optional[Mapping] = None,
            progress: bool = True,
            callback_on_step_end: Optional[StepCallback] = None,
            output_type: str = "latent",
        ) -> Any: ...

    @releases_gpu
    def invert(
        self,
        image,
        steps: int = 50,
        guidance_scale: float = 1.0,
        image_embeds: Optional[torch.Tensor] = None,
        size: Optional[int] = None,
        reconstruct: bool = True,
        progress: bool = True,
        fixed_point: int = 2,
    ) -> Inversion:
        """DDIM inversion of the decoder: image(s), resized to ``size`` (default
        :attr:`resolution`) and encoded by MoVQ, → the latents ``x_T`` from which the decoder's
        deterministic DDIM (``steps``, ``guidance_scale``, conditioned on the images' image-tower
        embeddings, or ``image_embeds``) decodes them back. ``fixed_point``: damped iterations
        refining each inverted step; with ``reconstruct`` the round trip is decoded and its RMSE
        in [-1, 1] units reported (``Inversion.error``)."""
        return _invert(
            self, image, steps, guidance_scale, image_embeds, size, reconstruct, progress,
            fixed_point,
        )  # fmt: skip

    @releases_gpu
    def text_diff(
        self,
        image,
        source_caption: str,
        target_caption: str,
        num_steps: int = 5,
        max_theta: float = 0.5,
        steps: int = 50,
        guidance_scale: float = 1.0,
        size: Optional[int] = None,
        output_type: str = "pil",
        progress: bool = True,
        fixed_point: int = 2,
    ) -> EditOutput:
        """A text diff (paper §3.3): the image's embedding turned from ``source_caption``
        towards ``target_caption`` (θ from 0 to ``max_theta`` in ``num_steps`` frames), each
        frame decoded from the image's inversion (:meth:`invert` with ``steps``,
        ``guidance_scale``, ``size``, ``fixed_point``). θ = 0 is the reconstruction;
        ``info["theta"]`` lists the θ values, ``info["inversion_error"]`` the round trip's
        RMSE."""
        return _text_diff(
            self, image, source_caption, target_caption, num_steps, max_theta, steps,
            guidance_scale, size, output_type, progress, fixed_point,
        )  # fmt: skip

    @releases_gpu
    def interpolate(
        self,
        start,
        end,
        num_steps: int = 5,
        generator: Optional[torch.Generator] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> UnCLIPOutput:
        """Frames along the slerp between the CLIP image embeddings of two prompts (the
        prior's) or two images (the image tower's), every frame decoded with one seed drawn from
        ``generator`` so that they differ only by the embedding."""
        return _interpolate(
            self, start, end, num_steps, generator, height, width, sampling, output_type,
            progress, callback_on_step_end,
        )  # fmt: skip
