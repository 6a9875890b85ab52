"""Per-stage sampling: the settings each stage samples with, and each stage's sampling step.

Settings: a stage samples with its settings (:mod:`unclip.sampling.settings`: scheduler, steps,
guidance_scale, best_of, ...) and the :class:`~unclip.diffusion.config.DiffusionConfig` it was
trained with (noise schedule, prediction type); that module's ``stage_settings`` gives every stage
its own settings or the defaults of its kind, and its ``resolve_sampling`` applies and checks
``sampling=`` overrides. This module holds the steps that use them.

Steps: :func:`sample_prior`, :func:`sample_decoder` and :func:`sample_upsampler` each run one
stage's reverse process with classifier-free guidance from that stage's network and settings alone,
and :func:`rerank_candidates` keeps the decoder's best candidates by CLIP score, so they need no
pipeline::

    # sr32: an UnCLIPUpsampler from 16 to 32 px; low: [B, 3, 16, 16] in [-1, 1]
    settings = SamplingConfig(steps=10, guidance_scale=1.0)
    big = sample_upsampler(sr32, low, settings, DiffusionConfig(), generator=gens)  # [B, 3, 32, 32]

A step whose result holds NaN or inf (NaN weights, say) raises a ``ValueError`` naming the stage
(:func:`check_finite`) instead of returning black images.

:class:`~unclip.pipeline.UnCLIPPipeline` chains them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import (
    Generator,
    guided_output,
    is_guided,
    make_scheduler,
    randn_generator,
    sample_loop,
    training_scheduler,
)
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.decoder import Caption, UnCLIPDecoder, UnCLIPUpsampler, upsample_low_res
from unclip.nets.prior import PlainForward, UnCLIPPrior
from unclip.nets.text_encoding import TextEncoding
from unclip.sampling.ar import sample_ar_prior
from unclip.sampling.settings import (
    ARPriorSampling,
    DecoderSampling,
    PriorSampling,
    SamplingConfig,
    UpsamplerSampling,
    sampling_as,
)
from unclip.sampling.utils import check_finite

__all__ = [
    "stage_callback",
    "sample_prior",
    "sample_decoder",
    "select_scheduler_rows",
    "sample_upsampler",
    "Denoiser",
    "decoder_denoiser",
    "upsampler_denoiser",
]


#: ``callback(step, timestep, x_t) -> new x_t | None``, as :func:`~unclip.diffusion.sample_loop`
LoopCallback = Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
#: ``callback_on_step_end(pipe, step, timestep, callback_kwargs) -> dict | None``, as in diffusers
StepCallback = Callable[[Any, int, torch.Tensor, dict], Optional[dict]]


# ----------------------------------------------------------------------------------------- steps
def stage_callback(
    pipe: Any, stage: str, callback_on_step_end: Optional[StepCallback]
) -> Optional[LoopCallback]:
    """A pipeline-level ``callback_on_step_end`` as the ``callback`` of ``stage``'s sampling loop:
    it is called as ``callback_on_step_end(pipe, step, timestep, {"stage": stage, "latents": x_t})``
    and a returned dict's ``"latents"`` replaces ``x_t``."""
    if callback_on_step_end is None:
        return None
    if not callable(callback_on_step_end):
        raise TypeError(
            f"callback_on_step_end must be callable, got {type(callback_on_step_end).__name__}"
        )

    def step(i, t, x):
        out = callback_on_step_end(pipe, i, t, {"stage": stage, "latents": x})
        if out is None:
            return None
        if not isinstance(out, Mapping):
            raise TypeError(
                f"callback_on_step_end must return None or a dict, got {type(out).__name__}"
            )
        return out.get("latents")

    return step


def _sample(denoise, shape, sched, settings: SamplingConfig, net, desc: str, **kwargs):
    """:func:`~unclip.diffusion.sample_loop` with ``settings``' steps and guidance scale, on the
    network ``net``'s device and in its dtype."""
    return sample_loop(
        denoise,
        shape,
        sched,
        num_steps=settings.steps,
        guidance_scale=settings.guidance_scale,
        device=net.device,
        dtype=net.dtype,
        desc=desc,
        **kwargs,
    )


def _null_first(null: Caption, cond: Caption) -> Caption:
    """``[uncond; cond]`` conditioning for a guided :func:`~unclip.diffusion.sample_loop`."""
    if isinstance(cond, torch.Tensor):  # caption token ids of a decoder's own text encoder
        assert isinstance(null, torch.Tensor), "the null caption is token ids like the caption"
        return torch.cat([null, cond])
    assert isinstance(null, TextEncoding), "the null caption is a TextEncoding like the caption"
    return TextEncoding.cat([null, cond])


@torch.no_grad()
def sample_prior(
    prior: Union[UnCLIPPrior, UnCLIPARPrior],
    text: TextEncoding,
    null_text: Callable[[int], TextEncoding],
    settings: Union[SamplingConfig, ARPriorSampling],
    diffusion: DiffusionConfig,
    *,
    generator: Generator = None,
    clip_range: Optional[float] = 10.0,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prior: ``text [B]`` → ``(best [B, D], candidates [B, N, D])`` CLIP image embeddings.

    Samples ``N = settings.best_of`` candidates per row and keeps the one with the highest dot
    product with the row's text embedding (paper §2.2). ``null_text(n)``: the empty caption's
    encoding repeated ``n`` times (the unconditional input; called only when guided).
    ``generator``: one, or one per candidate (``B·N``, row-major). ``clip_range``: predicted x_0
    (the normalised embedding) is clipped to ``[-r, r]``; None disables. ``latents [B·N, D]``:
    the initial noise. ``autocast_dtype``, ``callback``: as
    :func:`~unclip.diffusion.sample_loop`.

    An autoregressive prior (:class:`~unclip.nets.ar_prior.UnCLIPARPrior`) is sampled by
    :func:`~unclip.sampling.ar.sample_ar_prior` (``diffusion`` and ``clip_range`` do not apply to
    it, nor do ``latents``)."""
    # a torch.compile wrapper is not an instance of the class it wraps
    if isinstance(getattr(prior, "_orig_mod", prior), UnCLIPARPrior):
        if latents is not None:
            raise ValueError(
                "prior: latents are the diffusion prior's initial noise; the autoregressive "
                "prior samples codes and takes none"
            )
        return sample_ar_prior(
            prior,
            text,
            null_text,
            settings,
            generator=generator,
            progress=progress,
            autocast_dtype=autocast_dtype,
            callback=callback,
        )
    settings = sampling_as(PriorSampling, "prior", settings)
    getattr(prior, "_orig_mod", prior).check_text(text)  # before the null rows are joined to it
    n_best, b = settings.best_of, len(text)
    device = prior.device
    cond = text.repeat_interleave(n_best).to(device=device)
    batch = b * n_best
    if is_guided(settings.guidance_scale):
        cond = TextEncoding.cat([null_text(batch).to(device=device), cond])
    sched = make_scheduler(settings.scheduler, diffusion, clip_sample_range=clip_range)
    # a torch.compile(prior) wrapper would hand `conditioned` to the uncompiled module it wraps
    wrapper = getattr(prior, "_orig_mod", None) is not None
    step = PlainForward(prior, cond) if wrapper else prior.conditioned(cond)
    x = _sample(
        step,
        (batch, prior.config.embed_dim),
        sched,
        settings,
        prior,
        "prior",
        generator=generator,
        latents=latents,
        progress=progress,
        autocast_dtype=autocast_dtype,
        callback=callback,
    )
    x = check_finite("prior", x, autocast_dtype, module=prior, settings=settings)
    cands = prior.denormalize(x.float()).view(b, n_best, -1)
    text_embed = text.text_embed.to(cands)
    scores = (F.normalize(cands, dim=-1) * text_embed[:, None]).sum(-1)
    best = cands[torch.arange(b), scores.argmax(dim=1)]
    return best, cands


@dataclasses.dataclass
class Denoiser:
    """One stage's conditioned network call, ready for a sampling loop: ``fn(x_in, t)`` is the
    model output for ``x_in`` (``[uncond; cond]`` halves when ``settings`` guide), ``scheduler``
    the stage's sampler with its timesteps set, ``shape`` the stage's sample shape."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scheduler: Any
    shape: tuple
    settings: SamplingConfig
    learned_variance: bool = False
    #: the decoder's prepared conditioning (tokens, mask, time embedding; ``[uncond; cond]`` rows
    #: when guided), which :func:`sample_decoder_reranked` cuts to the kept candidates
    cond: Optional[tuple] = None

    def output(self, x: torch.Tensor, t, autocast_dtype=None) -> torch.Tensor:
        """The guided model output at ``x``, as the scheduler's step takes it."""
        return guided_output(
            self.fn,
            x,
            t,
            self.scheduler,
            guidance_scale=self.settings.guidance_scale,
            learned_variance=self.learned_variance,
            autocast_dtype=autocast_dtype,
        )


def decoder_denoiser(
    decoder: UnCLIPDecoder,
    image_embed: torch.Tensor,
    text: Caption,
    null_text: Callable[[int], Caption],
    settings: SamplingConfig,
    diffusion: DiffusionConfig,
) -> Denoiser:
    """The decoder's :class:`Denoiser` for ``image_embed [B, D]`` and captions ``text [B]``
    (arguments as :func:`sample_decoder`; ``settings`` already checked)."""
    b, device = image_embed.shape[0], decoder.device
    text = text.to(device=device)
    image_embed = image_embed.to(device)
    drop = None
    if is_guided(settings.guidance_scale):
        text = _null_first(null_text(b).to(device=device), text)
        image_embed = torch.cat([image_embed, image_embed])
        drop = torch.arange(2 * b, device=device) < b
    cond = decoder.condition(image_embed, text, drop)
    learned = decoder.config.learned_variance
    # pixels are clipped to the image range; an autoencoder's latents have no such bound
    clip_range = None if decoder.is_latent else 1.0
    sched = make_scheduler(
        settings.scheduler, diffusion, clip_sample_range=clip_range, learned_variance=learned
    )
    sched.set_timesteps(settings.steps, device=device)
    return Denoiser(
        lambda x_in, t: decoder(x_in, t, cond=cond),
        sched,
        (b, *decoder.sample_shape),
        settings,
        learned,
        cond,
    )


def upsampler_denoiser(
    up: UnCLIPUpsampler,
    low: torch.Tensor,
    settings: SamplingConfig,
    diffusion: DiffusionConfig,
    generator: Generator = None,
) -> Denoiser:
    """An upsampler's :class:`Denoiser` conditioned on ``low [B, 3, h, w]`` (resized, and noised
    by ``generator`` as :func:`sample_upsampler` describes; ``settings`` already checked)."""
    b, size, device = low.shape[0], up.config.sample_size, up.device
    low_up = upsample_low_res(low.to(device), size, clamp=up.config.clamp_low_res)
    level = int(up.config.noise_level)
    levels = torch.full((b,), level, dtype=torch.long, device=device)
    if level > 0:
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(
            low_up.shape, generator=randn_generator(generator), device=device, dtype=low_up.dtype
        )
        # diffusers annotates timesteps as IntTensor; any integer tensor works (here int64)
        low_up = training_scheduler(diffusion).add_noise(low_up, noise, levels.cpu())  # type: ignore[arg-type]
    if is_guided(settings.guidance_scale):  # unconditional = no low-res information (zeros)
        low_up = torch.cat([torch.zeros_like(low_up), low_up])
        levels = torch.cat([levels, levels])
    sched = make_scheduler(settings.scheduler, diffusion, clip_sample_range=1.0)
    sched.set_timesteps(settings.steps, device=device)

    def denoise(x_in, t):
        final = bool(t == sched.timesteps[-1])
        return up(x_in, t, low_up, levels, final_step=final)

    return Denoiser(denoise, sched, (b, 3, size, size), settings)


@torch.no_grad()
def sample_decoder(
    decoder: UnCLIPDecoder,
    image_embed: torch.Tensor,
    text: Caption,
    null_text: Callable[[int], Caption],
    settings: SamplingConfig,
    diffusion: DiffusionConfig,
    *,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
) -> torch.Tensor:
    """Decoder: ``image_embed [B, D]`` and captions ``text [B]`` → images ``[B, 3, s, s]`` in
    [-1, 1] at the decoder's resolution (a latent decoder samples its latents and decodes them).

    Guidance's unconditional input is the decoder's learned null image embedding with the empty
    caption ``null_text(B)`` (called only when guided). ``text``: a CLIP :class:`TextEncoding`, or
    caption token ids ``[B, L]`` for a decoder with its own text encoder. ``generator``: one, or
    one per image; ``latents [B, *decoder.sample_shape]``: the initial noise. ``autocast_dtype``,
    ``callback``: as :func:`~unclip.diffusion.sample_loop`."""
    settings = sampling_as(DecoderSampling, "decoder", settings)
    d = decoder_denoiser(decoder, image_embed, text, null_text, settings, diffusion)
    x = _sample(
        d.fn,
        d.shape,
        d.scheduler,
        settings,
        decoder,
        "decoder",
        generator=generator,
        latents=latents,
        learned_variance=d.learned_variance,
        progress=progress,
        autocast_dtype=autocast_dtype,
        callback=callback,
    )
    x = check_finite("decoder", x, autocast_dtype, module=decoder, settings=settings)
    if decoder.is_latent:  # the autoencoder's decode can overflow on its own (half precision)
        x = check_finite("the decoder's autoencoder", decoder.to_images(x))
    return x.float().clamp(-1, 1)


def select_scheduler_rows(scheduler, rows: torch.Tensor, batch: int, ndim: int) -> None:
    """Keep only ``rows`` of the per-sample state ``scheduler`` carries from one step to the next
    (a multistep solver's previous model outputs and sample, Heun's first-order sample, ...), for
    a batch of ``batch`` samples with ``ndim`` dimensions, in place. Per-sample tensors are told
    from the noise schedule's tables by their shape (``[batch, ...]`` with ``ndim`` dimensions;
    schedule tables are 1-D), so a batch as long as the schedule is handled too."""

    def per_sample(v) -> bool:
        return torch.is_tensor(v) and v.ndim == ndim and v.shape[0] == batch

    for name, value in list(vars(scheduler).items()):
        if per_sample(value):
            setattr(scheduler, name, value[rows.to(value.device)])
        elif isinstance(value, (list, tuple)) and any(per_sample(v) for v in value):
            kept = [v[rows.to(v.device)] if per_sample(v) else v for v in value]
            setattr(scheduler, name, type(value)(kept))


@torch.no_grad()
def sample_upsampler(
    up: UnCLIPUpsampler,
    low: torch.Tensor,
    settings: SamplingConfig,
    diffusion: DiffusionConfig,
    *,
    generator: Generator = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
    latents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One upsampler: ``low [B, 3, h, w]`` in [-1, 1] (``h = up.config.low_res_size``) → images
    ``[B, 3, H, W]`` in [-1, 1] (``H = up.config.sample_size``), on the upsampler's device.

    The low-res images are resized to ``H`` (bicubic) and, when ``up.config.noise_level > 0``,
    noised to that level by ``diffusion``'s forward process, as in training (noise conditioning
    augmentation); guidance's unconditional input is an all-zero low-res image. ``generator``: one,
    or one per image; it draws that noise, the initial noise and the scheduler's noise.
    ``diffusion``: the upsampler's training noise schedule. ``autocast_dtype``, ``callback``: as
    :func:`~unclip.diffusion.sample_loop`."""
    name = f"sr{up.config.sample_size}"
    if not isinstance(low, torch.Tensor) or low.ndim != 4:
        raise TypeError(f"{name}: the low-res images must be a tensor [B, 3, h, w] in [-1, 1]")
    if low.shape[-1] != up.config.low_res_size:
        raise ValueError(f"{name} expects {up.config.low_res_size}px input, got {low.shape[-1]}px")
    settings = sampling_as(UpsamplerSampling, name, settings)
    d = upsampler_denoiser(up, low, settings, diffusion, generator)
    x = _sample(
        d.fn,
        d.shape,
        d.scheduler,
        settings,
        up,
        name,
        generator=generator,
        latents=latents,
        progress=progress,
        autocast_dtype=autocast_dtype,
        callback=callback,
    )
    return check_finite(name, x, autocast_dtype, module=up, settings=settings).float().clamp(-1, 1)
