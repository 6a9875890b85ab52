"""Editing with the cascade (DALL-E 2 paper §3): DDIM inversion, text diffs, interpolation between
inverted images, inpainting and image-to-image. Each edit is a function taking the pipeline first;
:class:`~unclip.pipeline.pipeline.UnCLIPPipeline` carries each as a method of the same name::

    inv = pipe.invert(image)                       # x_T of the decoder's deterministic DDIM
    inv.error                                      # round-trip RMSE of the reconstruction
    out = pipe.text_diff(image, "a red circle on the left", "a blue circle on the left")
    out = pipe.interpolate_inverted(image_a, image_b, num_steps=5)
    out = pipe.inpaint(image, mask, "a green triangle on the right")   # mask: white = regenerate
    out = pipe.img2img(image, "a blue square", strength=0.6)

Conventions follow generation: ``generator`` (one, or one per output image), ``sampling=``
overrides per stage, ``output_type``, ``progress``; results are :class:`EditOutput`.

DDIM here is the deterministic update written out (:func:`ddim_step`, :func:`ddim_invert_step`):
the step from ``x_t`` to ``x_s`` is affine in ``x_t`` for a fixed model output, so the inverse step
solves it exactly for that output. Plain DDIM inversion evaluates the model at ``x_s`` instead of
the unknown ``x_t`` (Song et al. 2021; Dhariwal & Nichol 2021); :func:`invert` then
refines each step's ``x_t`` by damped fixed-point iteration (``fixed_point``; the idea of
Pan et al. 2023 and Garibi et al. 2024), re-evaluating the model at the current estimate, so that
the decode's step from it lands on ``x_s``. Neither direction clips ``x̂_0``. Images are resized
to each stage's resolution (shorter side, centre crop).

Inpainting keeps the unmasked pixels of every stage's output equal to the image resized to that
stage (bit for bit) and regenerates the masked ones: at every step the known region is replaced by
the image noised to the next step's level, with RePaint's resampling (Lugmayr et al. 2022) in the
decoder, where the content is decided (``resample`` passes per step); the upsamplers see the
inpainted lower-resolution image as their condition.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_unclip import UnCLIPScheduler
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from unclip.diffusion.loop import Generator, denoise_steps, make_scheduler, scheduler_step
from unclip.diffusion.schedulers import scheduler_label
from unclip.pipeline.cascade import UnCLIPCascade
from unclip.pipeline.edit_ops import (
    RESAMPLING_SCHEDULERS,
    EditOutput,
    Inversion,
    _check_fixed_point,
    _levels,
    _same_seed,
    at_size,
    check_text_diff_args,
    ddim_path,
    mask_at_size,
    read_image,
    read_mask,
    text_diff_embeds,
)
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.settings import (
    DecoderSampling,
    SamplingConfig,
    UpsamplerSampling,
    resolve_sampling,
)
from unclip.sampling.stages import (
    Denoiser,
    StepCallback,
    decoder_denoiser,
    stage_callback,
    upsampler_denoiser,
)
from unclip.sampling.utils import (
    check_count,
    check_finite,
    check_output_type,
    expand_generator,
    slerp,
)
from unclip.utils.images import as_image_input, to_output
from unclip.utils.offload import releases_gpu

__all__ = [
    "invert",
    "text_diff",
    "interpolate_inverted",
    "img2img",
    "inpaint",
    "variations",
]


def _edit_settings(
    pipe: UnCLIPCascade, sampling, steps=None, guidance_scale=None
) -> SamplingConfig:
    # a copy: the resolved settings are shared with the other stages of the call
    s = replace(pipe._stage_settings("decoder", sampling))
    assert isinstance(s, DecoderSampling)
    if steps is not None:
        s.steps = steps
    if guidance_scale is not None:
        s.guidance_scale = guidance_scale
    # one DDIM path, no candidates to choose among
    s.scheduler, s.best_of, s.rerank_at, s.rerank_contrast = "ddim", 1, None, None
    s.prune_at = s.prune_keep = s.best_of_contrasted = None
    out = resolve_sampling({"decoder": s})["decoder"]
    assert isinstance(out, DecoderSampling)
    return out


def _ddim_denoiser(pipe: UnCLIPCascade, embeds, caption, settings: SamplingConfig) -> Denoiser:
    b = embeds.shape[0]
    text, null = pipe._decoder_captions(None if caption is None else [caption] * b, b)
    pipe._onload("decoder")
    return decoder_denoiser(pipe.decoder, embeds, text, null, settings, pipe.diffusion["decoder"])


def _ddim_run(
    pipe: UnCLIPCascade,
    d: Denoiser,
    x: torch.Tensor,
    invert: bool,
    progress: bool,
    desc: str,
    fixed_point: int = 0,
):
    x = ddim_path(
        lambda x_in, t: d.output(x_in, t, pipe.autocast_dtype),
        x.to(pipe.device, torch.float32),
        d.scheduler.timesteps,
        _levels(d),
        pipe.diffusion["decoder"].prediction_type,
        invert,
        fixed_point=fixed_point,
        progress=progress,
        desc=desc,
    )
    x = check_finite(desc, x)
    # the inversion's x_T stays in the decoder's own space; a decoded path is an image
    return x if invert else pipe.decoder.to_images(x)


@releases_gpu
@torch.no_grad()
def invert(
    pipe: UnCLIPCascade,
    image,
    caption: Optional[str] = None,
    steps: int = 50,
    guidance_scale: float = 1.0,
    image_embeds: Optional[torch.Tensor] = None,
    reconstruct: bool = True,
    progress: bool = True,
    fixed_point: int = 2,
) -> Inversion:
    """DDIM inversion of the decoder: image(s) → the ``x_T`` from which the decoder's
    deterministic DDIM (``steps`` steps, ``guidance_scale``, conditioned on the images' CLIP
    embeddings, or ``image_embeds``, and ``caption``, default the empty one) decodes them back.
    Guidance 1 inverts best (guided updates are not the gradient of one model).
    ``fixed_point``: damped fixed-point iterations that refine each inverted step, one more
    decoder evaluation each (0: plain DDIM inversion, which can diverge at few steps). With
    ``reconstruct`` the round trip is decoded and its RMSE reported (``Inversion.error``)."""
    progress = pipe._progress(progress)
    fixed_point = _check_fixed_point(fixed_point)
    x = read_image(image)
    small = at_size(x, pipe.decoder.config.sample_size).to(pipe.device)
    start = pipe.decoder.to_latents(small)  # a latent decoder inverts its latents
    if image_embeds is None:
        image_embeds = pipe.clip.encode_image(x.to(pipe.device))
    embeds = image_embeds.to(pipe.device).float()
    if embeds.shape[0] != small.shape[0]:
        raise ValueError(f"invert: {embeds.shape[0]} image_embeds for {small.shape[0]} images")
    s = _edit_settings(pipe, None, check_count(steps, "steps"), guidance_scale)
    d = _ddim_denoiser(pipe, embeds, caption, s)
    latents = _ddim_run(pipe, d, start, True, progress, "invert", fixed_point)
    inv = Inversion(
        latents, embeds, small, s.steps, s.guidance_scale, caption, fixed_point=fixed_point
    )
    if reconstruct:
        rec = _ddim_run(pipe, d, latents, False, progress, "reconstruct").clamp(-1, 1)
        inv.reconstruction = rec
        inv.error = float((rec - small).pow(2).mean().sqrt())
    return inv


def _finish(
    pipe: UnCLIPCascade, small, gens, sampling, output_type, progress, callback, embeds, **extra
):
    final = pipe.upsample(small, gens, sampling, progress=progress, callback_on_step_end=callback)
    return EditOutput(to_output(final, output_type), embeds, **extra)


@releases_gpu
@torch.no_grad()
def text_diff(
    pipe: UnCLIPCascade,
    image,
    source_caption: str,
    target_caption: str,
    num_steps: int = 5,
    max_theta: float = 0.5,
    steps: int = 50,
    guidance_scale: float = 1.0,
    caption: Optional[str] = None,
    generator: Optional[torch.Generator] = None,
    sampling: Optional[dict] = None,
    output_type: str = "pil",
    progress: bool = True,
    callback_on_step_end=None,
    fixed_point: int = 2,
) -> EditOutput:
    """A text diff (paper §3.3): the image's CLIP embedding ``z_i`` rotated towards
    ``z_d = norm(z_t − z_t0)``, the difference of the target and source captions' text
    embeddings, ``slerp(z_i, z_d, θ)`` for ``num_steps`` values of θ from 0 to ``max_theta``,
    each decoded from the image's inverted ``x_T`` (:meth:`invert` with ``steps``,
    ``guidance_scale``, the decoder ``caption`` and ``fixed_point``) and upsampled from the
    same seed. θ = 0 reproduces the inversion's reconstruction; ``info["theta"]`` lists the
    θ values and ``info["inversion_error"]`` the round trip's RMSE."""
    progress = pipe._progress(progress)
    sampling = pipe.sampling_settings(sampling)  # resolved once for every stage
    check_output_type(output_type)
    n = check_text_diff_args(image, source_caption, target_caption, num_steps, max_theta)
    inv = invert(
        pipe, image, caption, steps, guidance_scale, progress=progress, fixed_point=fixed_point
    )
    z = pipe.clip.encode_text([source_caption, target_caption]).text_embed
    embeds, thetas = text_diff_embeds(inv.image_embeds, z, n, max_theta)
    d = _ddim_denoiser(pipe, embeds, caption, _edit_settings(pipe, None, steps, guidance_scale))
    small = _ddim_run(pipe, d, inv.latents.repeat(n, 1, 1, 1), False, progress, "text diff")
    gens = _same_seed(generator, n)
    info = {"theta": thetas, "inversion_error": inv.error}
    return _finish(
        pipe,
        small.clamp(-1, 1),
        gens,
        sampling,
        output_type,
        progress,
        callback_on_step_end,
        embeds,
        latents=inv.latents,
        info=info,
    )


@releases_gpu
@torch.no_grad()
def interpolate_inverted(
    pipe: UnCLIPCascade,
    start,
    end,
    num_steps: int = 5,
    steps: int = 50,
    guidance_scale: float = 1.0,
    generator: Optional[torch.Generator] = None,
    sampling: Optional[dict] = None,
    output_type: str = "pil",
    progress: bool = True,
    callback_on_step_end=None,
    caption: Optional[str] = None,
    fixed_point: int = 2,
) -> EditOutput:
    """Interpolation between two images that keeps each image's inverted latent (paper §3.2,
    figure 4): both are inverted (:meth:`invert` with ``steps``, ``guidance_scale``, the
    decoder ``caption``, default the empty one, and ``fixed_point``); frame ``w`` decodes
    ``slerp`` of the two CLIP embeddings from ``slerp`` of the two ``x_T`` with that caption,
    so the end frames reconstruct the images. ``info["weight"]`` lists the weights."""
    progress = pipe._progress(progress)
    sampling = pipe.sampling_settings(sampling)  # resolved once for every stage
    check_output_type(output_type)
    if check_count(num_steps, "num_steps") < 2:
        raise ValueError("interpolate_inverted: num_steps must be >= 2")
    invs = [
        invert(pipe, x, caption, steps, guidance_scale, progress=progress, fixed_point=fixed_point)
        for x in (start, end)
    ]
    if any(i.latents.shape[0] != 1 for i in invs):
        raise ValueError("interpolate_inverted takes one start and one end image")
    ws = [i / (num_steps - 1) for i in range(num_steps)]
    embeds = torch.cat([slerp(invs[0].image_embeds, invs[1].image_embeds, w) for w in ws])
    lat = [i.latents.flatten(1) for i in invs]
    shape = invs[0].latents.shape[1:]
    latents = torch.cat([slerp(lat[0], lat[1], w).view(1, *shape) for w in ws])
    d = _ddim_denoiser(pipe, embeds, caption, _edit_settings(pipe, None, steps, guidance_scale))
    small = _ddim_run(pipe, d, latents, False, progress, "interpolate")
    info = {"weight": ws, "inversion_error": [i.error for i in invs]}
    return _finish(
        pipe,
        small.clamp(-1, 1),
        _same_seed(generator, num_steps),
        sampling,
        output_type,
        progress,
        callback_on_step_end,
        embeds,
        latents=latents,
        info=info,
    )


def _edit_embeds(
    pipe: UnCLIPCascade, prompt, n, gen, sampling, negative_prompt, image_embeds, progress, cb
):
    if image_embeds is not None:
        emb = torch.as_tensor(image_embeds).float().to(pipe.device)
        emb = emb[None] if emb.ndim == 1 else emb
        if emb.shape[0] == 1:
            emb = emb.repeat(n, 1)
        if emb.shape != (n, pipe.clip.embed_dim):
            raise ValueError(
                f"image_embeds: expected [{n}, {pipe.clip.embed_dim}] (or one row), got "
                f"{tuple(emb.shape)}"
            )
        return emb
    if pipe.prior is None:
        raise ValueError("this pipeline has no prior; pass image_embeds=")
    return pipe.sample_image_embeds(
        [prompt] * n,  # one row per image, so generators given per image serve each row
        1,
        gen,
        sampling,
        progress=progress,
        callback_on_step_end=cb,
        negative_prompt=negative_prompt,
    )


def _edit_start(pipe: UnCLIPCascade, image, prompt, num_images, generator, what):
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{what}: prompt must be a non-empty string")
    x = read_image(image)
    if x.shape[0] != 1:
        raise ValueError(f"{what} takes one image; call it once per image")
    n = check_count(num_images, "num_images")
    return x, n, expand_generator(generator, 1, n, "generator")


def _edit_decoder(pipe: UnCLIPCascade, embeds, prompt, n, sampling, negative_prompt) -> Denoiser:
    text, null = pipe._decoder_captions([prompt] * n, n)
    if negative_prompt is not None:
        null = pipe._decoder_negative(negative_prompt, n)
    s = pipe._stage_settings("decoder", sampling)
    assert isinstance(s, DecoderSampling)
    pipe._onload("decoder")
    return decoder_denoiser(pipe.decoder, embeds, text, null, s, pipe.diffusion["decoder"])


@releases_gpu
@torch.no_grad()
def img2img(
    pipe: UnCLIPCascade,
    image,
    prompt: str,
    strength: float = 0.6,
    num_images: int = 1,
    generator: Generator = None,
    sampling: Optional[dict] = None,
    negative_prompt: Optional[str] = None,
    image_embeds: Optional[torch.Tensor] = None,
    output_type: str = "pil",
    return_intermediates: bool = False,
    progress: bool = True,
    callback_on_step_end=None,
) -> EditOutput:
    """Image-to-image (SDEdit, Meng et al. 2022): the image at the decoder's resolution,
    noised to the level of the decoder sampler's step ``(1 − strength)·steps``, denoised
    from there conditioned on ``prompt`` (its prior sample, or ``image_embeds``), then
    upsampled. ``strength`` in (0, 1]: 1 keeps almost nothing of the image, small values
    keep its layout and colours. The decoder's ``best_of`` is not used (one sample per
    image)."""
    progress = pipe._progress(progress)
    sampling = pipe.sampling_settings(sampling)  # resolved once for every stage
    check_output_type(output_type)
    if not isinstance(strength, (int, float)) or not 0 < float(strength) <= 1:
        raise ValueError(f"img2img: strength must be in (0, 1], got {strength!r}")
    x, n, gen = _edit_start(pipe, image, prompt, num_images, generator, "img2img")
    cb = callback_on_step_end
    embeds = _edit_embeds(
        pipe, prompt, n, gen, sampling, negative_prompt, image_embeds, progress, cb
    )
    d = _edit_decoder(pipe, embeds, prompt, n, sampling, negative_prompt)
    steps = d.settings.steps
    run = max(1, min(steps, round(float(strength) * steps)))
    sched = d.scheduler
    # second-order solvers list each timestep twice (UnCLIPScheduler has no order: first)
    start = (steps - run) * getattr(sched, "order", 1)
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start)  # where sigma-indexed samplers read add_noise's level
    known = at_size(x, pipe.decoder.config.sample_size).to(pipe.device).repeat(n, 1, 1, 1)
    known = pipe.decoder.to_latents(known)
    noise = randn_tensor(known.shape, generator=gen, device=pipe.device, dtype=known.dtype)
    # the sampler's own forward process: sigma-space samplers (Euler, ...) scale x_t
    # differently from the variance-preserving one the model was trained with
    x_t = sched.add_noise(known, noise, sched.timesteps[start].reshape(1).repeat(n))
    small = denoise_steps(
        d.fn,
        x_t,
        d.scheduler,
        guidance_scale=d.settings.guidance_scale,
        start=start,
        generator=gen,
        learned_variance=d.learned_variance,
        progress=progress,
        desc="img2img",
        autocast_dtype=pipe.autocast_dtype,
        callback=stage_callback(pipe, "decoder", cb),
    )
    small = pipe.decoder.to_images(check_finite("decoder", small)).float().clamp(-1, 1)
    out = _finish(
        pipe,
        small,
        gen,
        sampling,
        output_type,
        progress,
        cb,
        embeds,
        info={"strength": float(strength), "decoder_steps_run": run},
    )
    if return_intermediates:
        out.stage_images = {"decoder": small}
    return out


@releases_gpu
@torch.no_grad()
def inpaint(
    pipe: UnCLIPCascade,
    image,
    mask,
    prompt: str,
    num_images: int = 1,
    resample: int = 4,
    generator: Generator = None,
    sampling: Optional[dict] = None,
    negative_prompt: Optional[str] = None,
    image_embeds: Optional[torch.Tensor] = None,
    output_type: str = "pil",
    return_intermediates: bool = False,
    progress: bool = True,
    callback_on_step_end=None,
) -> EditOutput:
    """Regenerate the masked region of ``image`` to ``prompt`` and keep the rest (see the
    module doc). ``mask``: the image's size, white/1/True = regenerate (:func:`read_mask`).
    The prompt describes the whole edited image; its prior sample (or ``image_embeds``)
    conditions the decoder. ``resample``: RePaint passes per decoder step (1 = plain
    replacement; more harmonise the new region with the kept one, at that many times the
    decoder's cost; the decoder's sampler must then be one of
    :data:`RESAMPLING_SCHEDULERS`). The unmasked pixels of every stage's output are the
    image's, resized to that stage, bit for bit."""
    progress = pipe._progress(progress)
    check_output_type(output_type)
    resample = check_count(resample, "resample")
    x, n, gen = _edit_start(pipe, image, prompt, num_images, generator, "inpaint")
    m = read_mask(mask, x.shape[-2], x.shape[-1])
    settings = sampling = pipe.sampling_settings(sampling)  # resolved once for every stage
    dec = settings["decoder"]
    assert isinstance(dec, DecoderSampling)
    spec = dec.scheduler
    stateless = (DDIMScheduler, DDPMScheduler, UnCLIPScheduler)
    built = make_scheduler(
        spec, pipe.diffusion["decoder"], learned_variance=pipe.decoder.config.learned_variance
    )
    if resample > 1 and not isinstance(built, stateless):
        raise ValueError(
            f"inpaint: resample={resample} needs a decoder sampler that keeps no history "
            f"({', '.join(RESAMPLING_SCHEDULERS)}), not {scheduler_label(spec)!r}; "
            "use resample=1 or another sampler"
        )
    cb = callback_on_step_end
    embeds = _edit_embeds(
        pipe, prompt, n, gen, sampling, negative_prompt, image_embeds, progress, cb
    )
    d = _edit_decoder(pipe, embeds, prompt, n, sampling, negative_prompt)
    space = pipe.decoder.latent_space
    out = _masked(pipe, d, x, m, "decoder", resample, gen, progress, cb, space)
    stages = {"decoder": out}
    for name, up in zip(pipe.upsampler_names, pipe.upsamplers):
        pipe._onload(name)
        s = settings[name]
        assert isinstance(s, UpsamplerSampling)
        du = upsampler_denoiser(up, out, s, pipe.diffusion[name], gen)
        out = _masked(pipe, du, x, m, name, 1, gen, progress, cb)
        stages[name] = out
    res = EditOutput(to_output(out, output_type), embeds, info={"resample": resample})
    if return_intermediates:
        res.stage_images = stages
    return res


def _masked(
    pipe: UnCLIPCascade, d: Denoiser, image, mask, stage, resample, gen, progress, cb, space=None
):
    """One stage's masked sampling: ``d``'s reverse process with the unmasked region replaced
    at every step by ``image`` noised to the next step's level, ``resample`` passes per step;
    the result's unmasked pixels are exactly ``image`` at the stage's size. With ``space`` (a
    latent decoder's :class:`~unclip.nets.autoencoder.LatentSpace`) the process runs on the
    image's latents and regenerates every latent whose pixels touch the mask."""
    b, size = d.shape[0], d.shape[-1]
    pixels = size if space is None else size * space.factor
    known_px = at_size(image, pixels).to(pipe.device).repeat(b, 1, 1, 1)
    regen_px = mask_at_size(mask, pixels).to(pipe.device)
    known, regen = known_px, regen_px
    if space is not None:
        known = space.encode(known_px)
        regen = F.max_pool2d(regen_px.float(), space.factor) > 0
    sched, ts = d.scheduler, d.scheduler.timesteps
    ac = sched.alphas_cumprod
    x = randn_tensor(d.shape, generator=gen, device=pipe.device) * sched.init_noise_sigma
    callback = stage_callback(pipe, stage, cb)

    def noised(level):
        # the sampler's own forward process at the level its next step starts from (a
        # sigma-indexed sampler reads it from its step index, already advanced)
        noise = randn_tensor(known.shape, generator=gen, device=pipe.device)
        return sched.add_noise(known, noise, level.reshape(1).repeat(b))

    for i in tqdm(range(len(ts)), desc=f"inpaint {stage}", disable=not progress, leave=False):
        last = i + 1 == len(ts)
        for r in range(1 if last else resample):
            out = d.output(x, ts[i], pipe.autocast_dtype)
            x_next = scheduler_step(sched, out, i, x, gen)
            x_next = torch.where(regen, x_next, known if last else noised(ts[i + 1]))
            if r + 1 < resample and not last:  # RePaint: back to step i's level, again
                ratio = float(ac[int(ts[i])] / ac[int(ts[i + 1])])
                noise = randn_tensor(x.shape, generator=gen, device=pipe.device)
                x = math.sqrt(ratio) * x_next + math.sqrt(1 - ratio) * noise
        x = x_next
        if callback is not None:
            new = callback(i, ts[i], x)
            x = x if new is None else new
    x = check_finite(stage, x)
    x = (x if space is None else space.decode(x)).float().clamp(-1, 1)
    return torch.where(regen_px, x, known_px)


@releases_gpu
@torch.no_grad()
def variations(
    pipe: UnCLIPCascade,
    image,
    num_images: int = 1,
    generator: Generator = None,
    caption: Optional[str] = None,
    sampling: Optional[dict] = None,
    output_type: str = "pil",
    progress: bool = True,
    callback_on_step_end: Optional[StepCallback] = None,
) -> UnCLIPOutput:
    """Image → CLIP image embedding → ``num_images`` decodings (paper §3.1). ``image``: one
    image (a path, a PIL image, an array or a tensor), or a list of them: ``num_images``
    variations of each, image-major (``generator``: one, one per input image, or one per
    output). ``caption``: one for all, or one per input image. ``callback_on_step_end``: see
    :meth:`__call__`."""
    progress = pipe._progress(progress)
    sampling = pipe.sampling_settings(sampling)  # resolved once for every stage
    check_output_type(output_type)
    n = check_count(num_images, "num_images")
    images = list(image) if isinstance(image, (list, tuple)) else [image]
    if not images:
        raise ValueError("variations: no image given")
    embed = torch.cat([pipe.clip.encode_image(as_image_input(x)) for x in images])
    if embed.shape[0] != len(images):
        raise ValueError(
            "variations: a batch tensor holds several images; pass a list of images instead"
        )
    embeds = embed.repeat_interleave(n, dim=0)
    if caption is None:
        text = None
    else:
        captions = [caption] * len(images) if isinstance(caption, str) else list(caption)
        if len(captions) != len(images):
            raise ValueError(
                f"variations: {len(captions)} captions for {len(images)} images; give one "
                "for all, or one per image"
            )
        text = [c for c in captions for _ in range(n)]
    gen = expand_generator(generator, len(images), n, "generator")
    cb: dict[str, Any] = {"progress": progress, "callback_on_step_end": callback_on_step_end}
    small = pipe.decode(embeds, text, gen, sampling, **cb)
    final = pipe.upsample(small, gen, sampling, **cb)
    return UnCLIPOutput(to_output(final, output_type), embeds)
