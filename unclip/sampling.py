"""Per-stage sampling: the settings each stage samples with, and each stage's sampling step.

Settings: a stage samples with a :class:`~unclip.config.SamplingConfig` (scheduler, steps,
guidance_scale, best_of) and the :class:`~unclip.config.DiffusionConfig` it was trained with (noise
schedule, prediction type). :func:`stage_settings` gives every stage its own settings or the
defaults of its kind (:data:`DEFAULT_SAMPLING`, :data:`DEFAULT_DIFFUSION`);
:func:`resolve_sampling` applies and checks ``sampling=`` overrides.

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

import copy
import dataclasses
import difflib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from unclip.ar_prior import UnCLIPARPrior
from unclip.ar_sampling import check_ar_sampling, sample_ar_prior
from unclip.clip import CLIP, TextEncoding, check_prompts
from unclip.config import DiffusionConfig, SamplingConfig, from_dict, to_dict
from unclip.decoder import Caption, UnCLIPDecoder, UnCLIPUpsampler, upsample_low_res
from unclip.diffusion import (
    Generator,
    check_sampling_args,
    guided_output,
    initial_noise,
    is_guided,
    make_scheduler,
    sample_loop,
    scheduler_step,
    training_scheduler,
)
from unclip.pipeline_utils import check_count
from unclip.prior import PlainForward, UnCLIPPrior
from unclip.registry import EntryPointRegistry

__all__ = [
    "DEFAULT_SAMPLING",
    "DEFAULT_DIFFUSION",
    "SAMPLING_FIELDS",
    "EVERY_UPSAMPLER",
    "stage_kind",
    "stage_settings",
    "resolve_sampling",
    "stage_callback",
    "sample_prior",
    "sample_decoder",
    "pruning",
    "sample_decoder_reranked",
    "select_scheduler_rows",
    "check_prune",
    "check_best_of_contrasted",
    "candidate_counts",
    "check_rerank_at",
    "sample_upsampler",
    "Denoiser",
    "decoder_denoiser",
    "upsampler_denoiser",
    "check_finite",
    "image_text_cosines",
    "rerank_candidates",
    "RERANK_CONTRASTS",
    "REGION_SPLITS",
    "RegionPart",
    "region_views",
    "region_scores",
    "register_rerank_contrast",
]

DEFAULT_SAMPLING = {
    "prior": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0, best_of=2),
    "decoder": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0),
    "upsampler": SamplingConfig(scheduler="ddim", steps=10, guidance_scale=1.0),
}
DEFAULT_DIFFUSION = {
    "prior": DiffusionConfig(prediction_type="sample"),
    "decoder": DiffusionConfig(prediction_type="epsilon"),
    "upsampler": DiffusionConfig(prediction_type="epsilon"),
}
#: the fields a ``sampling=`` override may set for a stage
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
#: the ``sampling=`` key whose settings apply to every upsampler (a stage's own key wins)
EVERY_UPSAMPLER = "upsampler"

#: ``callback(step, timestep, x_t) -> new x_t | None``, as :func:`~unclip.diffusion.sample_loop`
LoopCallback = Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
#: ``callback_on_step_end(pipe, step, timestep, callback_kwargs) -> dict | None``, as in diffusers
StepCallback = Callable[[Any, int, torch.Tensor, dict], Optional[dict]]


def stage_kind(name: str) -> str:
    """``"prior"``, ``"decoder"`` or ``"upsampler"`` for a stage name (``sr64`` is an upsampler)."""
    return "upsampler" if name.startswith("sr") else name


# -------------------------------------------------------------------------------------- settings
def stage_settings(
    stage_names: Sequence[str],
    diffusion: Optional[Mapping] = None,
    sampling: Optional[Mapping] = None,
) -> tuple[dict[str, DiffusionConfig], dict[str, SamplingConfig]]:
    """``({stage: DiffusionConfig}, {stage: SamplingConfig})`` for ``stage_names``: each stage's
    entry of ``diffusion``/``sampling`` (a config or a dict, as in ``unclip.json``) or else the
    defaults of its kind. Sampling configs are copies, so changing them changes nothing given."""
    diffusion_out: dict[str, DiffusionConfig] = {}
    sampling_out: dict[str, SamplingConfig] = {}
    for name in stage_names:
        kind = stage_kind(name)
        d = (diffusion or {}).get(name, DEFAULT_DIFFUSION[kind])
        s = (sampling or {}).get(name, DEFAULT_SAMPLING[kind])
        diffusion_out[name] = (
            d
            if isinstance(d, DiffusionConfig)
            else from_dict(DiffusionConfig, d, prefix=f"diffusion.{name}")
        )
        sampling_out[name] = (
            copy.deepcopy(s)
            if isinstance(s, SamplingConfig)
            else from_dict(SamplingConfig, s, prefix=f"sampling.{name}")
        )
    return diffusion_out, sampling_out


def resolve_sampling(
    settings: Mapping[str, SamplingConfig],
    sampling: Optional[Mapping] = None,
    ar_stages: Collection[str] = (),
) -> dict[str, SamplingConfig]:
    """``settings`` (``{stage: SamplingConfig}``, a pipeline's stages in order) with the overrides
    ``sampling`` applied and every stage's result checked; a new dict of copies.

    ``sampling``: ``{key: {field: value}}`` (or ``{key: SamplingConfig}``); a key is a stage of
    ``settings`` or ``"upsampler"`` (every upsampler; an upsampler's own key wins), a field one of
    :data:`SAMPLING_FIELDS`. ``"prior"`` and ``"upsampler"`` are accepted (and checked) where
    ``settings`` has no such stage, so one set of overrides serves every pipeline. Unknown keys or
    fields and invalid values are a ``ValueError`` naming them. ``ar_stages``: the stages sampled
    by an autoregressive prior, the only ones that take its settings
    (:data:`~unclip.ar_sampling.AR_SAMPLING_FIELDS`)."""
    over = _check_overrides(sampling, list(settings))
    out = {}
    for stage, base in settings.items():
        s = copy.deepcopy(base)
        merged = dict(over.get(EVERY_UPSAMPLER, {})) if stage_kind(stage) == "upsampler" else {}
        merged.update(over.get(stage, {}))
        for k, v in merged.items():
            setattr(s, k, v)
        if "best_of" in merged and "best_of_contrasted" not in merged:
            s.best_of_contrasted = None  # a count given alone is every prompt's count
        check_sampling_args(stage, s.scheduler, s.steps, s.guidance_scale)
        check_ar_sampling(stage, s, stage in ar_stages)
        if isinstance(s.best_of, bool) or not isinstance(s.best_of, int) or s.best_of < 1:
            raise ValueError(f"{stage}: best_of must be an integer >= 1, got {s.best_of!r}")
        if s.rerank_at is not None:
            if stage_kind(stage) != "decoder":
                raise ValueError(
                    f"{stage}: rerank_at is a decoder setting (when to choose among its best_of "
                    f"candidates); remove it from {stage}'s settings"
                )
            r = s.rerank_at
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(
                    f"{stage}: rerank_at must be an integer >= 1 (a step number; steps or more, "
                    f"or None, choose among the finished images), got {r!r}"
                )
        check_rerank_contrast(stage, s.rerank_contrast)
        check_best_of_contrasted(stage, s)
        check_prune(stage, s)
        if s.best_of_contrasted is not None and s.rerank_contrast is not None:
            try:
                check_prune(stage, dataclasses.replace(s, best_of=s.best_of_contrasted))
            except ValueError as exc:
                raise ValueError(
                    f"{exc} (for the {s.best_of_contrasted} candidates of best_of_contrasted)"
                ) from None
        if stage_kind(stage) == "upsampler" and s.best_of != 1:
            raise ValueError(
                f"{stage}: best_of must be 1 for an upsampler (candidates are chosen by the "
                f"prior's and the decoder's best_of), got {s.best_of}"
            )
        out[stage] = s
    return out


def check_best_of_contrasted(stage: str, s: SamplingConfig) -> None:
    """Refuse ``best_of_contrasted`` outside the decoder or other than an integer >= 1."""
    value = s.best_of_contrasted
    if value is None:
        return
    if stage_kind(stage) != "decoder":
        raise ValueError(
            f"{stage}: best_of_contrasted is a decoder setting (the candidates of prompts its "
            f"rerank_contrast has alternatives for); remove it from {stage}'s settings"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{stage}: best_of_contrasted must be an integer >= 1, got {value!r}")


def candidate_counts(s: SamplingConfig, prompts: Sequence[str]) -> list[int]:
    """The decoder's candidates per image for each of ``prompts`` under its settings ``s``
    (checked): ``best_of_contrasted`` where ``rerank_contrast`` has alternatives for the prompt
    (the prompts :func:`rerank_candidates` scores by ``log p(caption | image)``), ``best_of``
    for the others (scored by the plain cosine)."""
    if s.best_of_contrasted is None or s.rerank_contrast is None:
        return [s.best_of] * len(prompts)
    fn = RERANK_CONTRASTS[s.rerank_contrast]
    alternatives = {p: len(list(fn(p))) > 1 for p in dict.fromkeys(prompts)}
    return [s.best_of_contrasted if alternatives[p] else s.best_of for p in prompts]


def check_prune(stage: str, s: SamplingConfig) -> None:
    """Refuse ``prune_at`` / ``prune_keep`` outside the decoder, one without the other, or a
    pruning step that is not before the decoder's part-way choice (``rerank_at``)."""
    given = {f: getattr(s, f) for f in ("prune_at", "prune_keep") if getattr(s, f) is not None}
    if not given:
        return
    clear = "sampling={'decoder': {'prune_at': None, 'prune_keep': None}}, --decoder-prune-at none"
    if stage_kind(stage) != "decoder":
        raise ValueError(
            f"{stage}: {' and '.join(given)} are decoder settings (pruning its best_of "
            f"candidates part-way); remove them from {stage}'s settings"
        )
    for field, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{stage}: {field} must be an integer >= 1, got {value!r}")
    if len(given) == 1:
        missing = "prune_keep" if "prune_at" in given else "prune_at"
        raise ValueError(
            f"{stage}: {next(iter(given))} needs {missing} too (after step prune_at keep each "
            f"image's prune_keep best candidates), or neither ({clear})"
        )
    if s.best_of <= s.prune_keep:
        return  # nothing to prune: a smaller best_of than the model's defaults keeps working
    if s.rerank_at is None or s.rerank_at >= s.steps or s.prune_at >= s.rerank_at:
        raise ValueError(
            f"{stage}: prune_at {s.prune_at} needs the final choice later, part-way: rerank_at "
            f"above it and below steps ({s.steps}), got rerank_at {s.rerank_at!r}; set rerank_at, "
            f"or stop pruning ({clear})"
        )


def pruning(s: SamplingConfig) -> bool:
    """Whether the decoder settings ``s`` (checked) prune candidates before the final choice."""
    return s.prune_at is not None and s.best_of > s.prune_keep


def _check_overrides(sampling: Optional[Mapping], stages: list[str]) -> dict[str, dict]:
    if sampling is None:
        return {}
    if not isinstance(sampling, Mapping):
        raise TypeError(
            f"sampling must be a dict {{stage: {{setting: value}}}}, got {type(sampling).__name__}"
        )
    valid = [*stages, EVERY_UPSAMPLER]
    if "prior" not in stages:
        valid.append("prior")
    out = {}
    for key, values in sampling.items():
        if key not in valid:
            if key == "upsamplers":
                hint = f"; use {EVERY_UPSAMPLER!r} for every upsampler"
            else:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"sampling: unknown stage {key!r}{hint} (valid: {', '.join(valid)})")
        if isinstance(values, SamplingConfig):
            values = to_dict(values)
        if not isinstance(values, Mapping):
            raise TypeError(
                f"sampling[{key!r}] must be a dict of settings, got {type(values).__name__}"
            )
        unknown = [k for k in values if k not in SAMPLING_FIELDS]
        if unknown:
            raise ValueError(
                f"sampling[{key!r}]: unknown sampling setting {unknown[0]!r} "
                f"(valid: {', '.join(SAMPLING_FIELDS)})"
            )
        out[key] = dict(values)
    return out


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


def _checked(stage: str, settings: SamplingConfig) -> SamplingConfig:
    """``settings`` checked as :func:`resolve_sampling` checks a stage's (a copy)."""
    return resolve_sampling({stage: settings})[stage]


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
        return torch.cat([null, cond])
    return TextEncoding.cat([null, cond])


def check_finite(stage: str, x: torch.Tensor, autocast_dtype: Optional[torch.dtype] = None):
    """``x``, a stage's sampled result, if every value is finite; else a one-line ``ValueError``
    naming the stage. NaN weights (a corrupt or diverged checkpoint) otherwise reach the user as
    black images; float16 can also overflow to inf."""
    if torch.isfinite(x).all():
        return x
    hint = "its weights or inputs hold NaN/inf; check the model folder"
    if autocast_dtype == torch.float16 or x.dtype == torch.float16:
        hint += (
            " (or float16 overflowed: try bfloat16 or full precision, autocast_dtype=None / "
            "--autocast none)"
        )
    raise ValueError(f"{stage} produced NaN/inf values: {hint}")


@torch.no_grad()
def sample_prior(
    prior: Union[UnCLIPPrior, UnCLIPARPrior],
    text: TextEncoding,
    null_text: Callable[[int], TextEncoding],
    settings: SamplingConfig,
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

    An autoregressive prior (:class:`~unclip.ar_prior.UnCLIPARPrior`) is sampled by
    :func:`~unclip.ar_sampling.sample_ar_prior` (``diffusion`` and ``clip_range`` do not apply to
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
    settings = _checked("prior", settings)
    n_best, b = settings.best_of, len(text)
    device = prior.device
    cond = text.repeat_interleave(n_best).to(device=device)
    batch = b * n_best
    if is_guided(settings.guidance_scale):
        cond = _null_first(null_text(batch).to(device=device), cond)
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
    x = check_finite("prior", x, autocast_dtype)
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
    size = decoder.config.sample_size
    learned = decoder.config.learned_variance
    sched = make_scheduler(
        settings.scheduler, diffusion, clip_sample_range=1.0, learned_variance=learned
    )
    sched.set_timesteps(settings.steps, device=device)
    return Denoiser(
        lambda x_in, t: decoder(x_in, t, cond=cond),
        sched,
        (b, 3, size, size),
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

        noise = randn_tensor(low_up.shape, generator=generator, device=device, dtype=low_up.dtype)
        low_up = training_scheduler(diffusion).add_noise(low_up, noise, levels.cpu())
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
    [-1, 1] at the decoder's resolution.

    Guidance's unconditional input is the decoder's learned null image embedding with the empty
    caption ``null_text(B)`` (called only when guided). ``text``: a CLIP :class:`TextEncoding`, or
    caption token ids ``[B, L]`` for a decoder with its own text encoder. ``generator``: one, or
    one per image; ``latents [B, 3, s, s]``: the initial noise. ``autocast_dtype``, ``callback``: as
    :func:`~unclip.diffusion.sample_loop`."""
    settings = _checked("decoder", settings)
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
    return check_finite("decoder", x, autocast_dtype).float().clamp(-1, 1)


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


def check_rerank_at(
    settings: SamplingConfig, diffusion: DiffusionConfig, learned_variance: bool = False
) -> None:
    """Refuse a decoder sampler that ``rerank_at`` cannot stop part-way: one that makes two
    network calls per step (Heun, DPM2), whose steps are not the loop's, or one whose noise is a
    process over the whole batch (DPM-Solver SDE's Brownian tree), which cannot be cut to rows."""
    sched = make_scheduler(
        settings.scheduler, diffusion, clip_sample_range=1.0, learned_variance=learned_variance
    )
    sched.set_timesteps(settings.steps)
    name = type(sched).__name__
    if len(sched.timesteps) != settings.steps or "noise_sampler" in vars(sched):
        raise ValueError(
            f"decoder: rerank_at {settings.rerank_at} (choose among candidates after that step; "
            "a pipeline's sampling defaults may set it) needs a sampler with one network call per "
            f"step and per-sample noise; {name} does not fit ({len(sched.timesteps)} calls for "
            f"{settings.steps} steps, or batch-wide noise): use ddim, dpm++, unipc, euler or ddpm, "
            "or choose among finished candidates with rerank_at None "
            "(sampling={'decoder': {'rerank_at': None}}, --decoder-rerank-at none)"
        )


def _predicted_x0(sched, training, x, t, out, prediction_type: str) -> torch.Tensor:
    """The network's x_0 at step ``t`` from its output ``out`` for sample ``x``. Samplers in sigma
    space (Euler, LMS) scale the model input by ``1/sqrt(1+σ²) = sqrt(ᾱ)``, which gives ᾱ at the
    sampler's own noise level; the others sample in x_t's scale, and ᾱ is the training schedule's
    at the (rounded) timestep: exact for the built-in samplers and UniPC/DPM-Solver++ by name, close
    for a solver given Karras sigmas."""
    one = torch.ones((), device=x.device, dtype=torch.float32)
    c = float(sched.scale_model_input(one, t))
    x = sched.scale_model_input(x, t).float()
    if abs(c - 1.0) > 1e-6:
        ac = torch.tensor(c * c, dtype=torch.float64)
    else:
        ac = training.alphas_cumprod.double()[int(torch.as_tensor(t).round().long())]
    a, s = float(ac.sqrt()), float((1 - ac).sqrt())
    out = out.float()
    if prediction_type == "epsilon":
        return (x - s * out) / a
    if prediction_type == "v_prediction":
        return a * x - s * out
    return out  # "sample"


@torch.no_grad()
def sample_decoder_reranked(
    decoder: UnCLIPDecoder,
    image_embed: torch.Tensor,
    text: Caption,
    null_text: Callable[[int], Caption],
    settings: SamplingConfig,
    diffusion: DiffusionConfig,
    choose: Callable[[torch.Tensor], torch.Tensor],
    *,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
    prune: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_decoder` over candidates that keeps only some of them part-way (the
    decoder's ``rerank_at``, which must be below ``steps``; arguments as :func:`sample_decoder`,
    the rows of ``image_embed`` and ``text`` are the candidates). After step ``rerank_at``,
    ``choose(x0)`` gets every candidate's predicted final image ``[N, 3, s, s]`` in [-1, 1] at that
    step and returns the indices of the rows to keep; only those are denoised to the end, with
    their own conditioning rows (guidance's unconditional ones included). ``callback`` sees every
    candidate up to that step and the kept rows after it. ``prune(x0)``: the same, earlier, after
    the decoder's ``prune_at`` step (used when :func:`pruning`); ``choose`` then gets the rows it
    kept.

    Returns ``(images [M, 3, s, s] in [-1, 1], kept indices [M])``, the indices into the
    candidates given (through both choices when pruning). With a distinct generator per
    candidate (a list), each kept row finishes exactly as it would in a run of every candidate:
    its generator goes with it and the scheduler's per-sample state
    (:func:`select_scheduler_rows`) is cut to the kept rows. Samplers that cannot stop part-way
    are refused (:func:`check_rerank_at`)."""
    settings = _checked("decoder", settings)
    m = settings.rerank_at
    if m is None or m >= settings.steps:
        raise ValueError(
            f"sample_decoder_reranked needs the decoder's rerank_at below steps ({settings.steps}),"
            f" got {m!r}; choose among finished images with sample_decoder and rerank_candidates"
        )
    check_rerank_at(settings, diffusion, decoder.config.learned_variance)
    d = decoder_denoiser(decoder, image_embed, text, null_text, settings, diffusion)
    sched = d.scheduler
    x = initial_noise(d.shape, sched, generator, latents, decoder.device, decoder.dtype)
    n, fn, gen = x.shape[0], d.fn, generator
    training = training_scheduler(diffusion)
    guided = is_guided(settings.guidance_scale)
    choices = {m - 1: choose}
    if pruning(settings):
        if prune is None:
            raise ValueError(
                f"decoder: prune_at {settings.prune_at} is set; give sample_decoder_reranked the "
                "prune function that keeps each image's prune_keep best candidates"
            )
        choices[settings.prune_at - 1] = prune
    keep, cond = torch.arange(n), d.cond  # keep: indices into the candidates given
    for i in tqdm(range(len(sched.timesteps)), desc="decoder", disable=not progress, leave=False):
        t = sched.timesteps[i]
        out = guided_output(
            fn,
            x,
            t,
            sched,
            guidance_scale=settings.guidance_scale,
            learned_variance=d.learned_variance,
            autocast_dtype=autocast_dtype,
        )
        if i in choices:
            mean = out[:, : x.shape[1]]
            x0 = _predicted_x0(sched, training, x, t, mean, diffusion.prediction_type)
        x = scheduler_step(sched, out, i, x, gen, history=i + 1)
        if i in choices:
            rows = torch.as_tensor(choices[i](x0.clamp(-1, 1)), dtype=torch.long).cpu()
            now = x.shape[0]
            x, keep = x[rows.to(x.device)], keep[rows]
            select_scheduler_rows(sched, rows, now, x.ndim)
            gen = [gen[j] for j in rows.tolist()] if isinstance(gen, list) else gen
            both = torch.cat([rows, rows + now]) if guided else rows  # [uncond; cond] halves
            cond = tuple(c[both.to(c.device)] for c in cond)

            def fn(x_in, t, cond=cond):
                return decoder(x_in, t, cond=cond)

        if callback is not None:
            new = callback(i, t, x)
            x = x if new is None else new
    return check_finite("decoder", x, autocast_dtype).float().clamp(-1, 1), keep


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
    settings = _checked(name, settings)
    d = upsampler_denoiser(up, low, settings, diffusion, generator)
    x = _sample(
        d.fn,
        d.shape,
        d.scheduler,
        settings,
        up,
        name,
        generator=generator,
        progress=progress,
        autocast_dtype=autocast_dtype,
        callback=callback,
    )
    return check_finite(name, x, autocast_dtype).float().clamp(-1, 1)


def image_text_cosines(clip: CLIP, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
    """Cosine ``[B]`` between ``clip``'s embeddings of images ``[B, 3, H, W]`` in [-1, 1] and text
    embeddings ``[B, D]``."""
    img = F.normalize(clip.encode_image(images), dim=-1)
    return (img * F.normalize(text_embed.to(img), dim=-1)).sum(-1)


#: entry point group of contrasts: name = the ``rerank_contrast`` setting, value = fn(prompt) ->
#: captions (pyproject.toml: "shapes", "shapes-pairs" and "shapes-pairs-regions" from
#: unclip.shapes.world)
RERANK_CONTRAST_ENTRY_POINTS = "unclip.rerank_contrasts"

#: Contrastive reranking (the decoder's ``rerank_contrast``): name → ``fn(prompt) -> captions``,
#: the first standing for the prompt and the rest for what a wrong image would show instead; an
#: empty list (e.g. a prompt the function cannot parse) reranks that prompt by plain CLIP score.
RERANK_CONTRASTS = EntryPointRegistry(RERANK_CONTRAST_ENTRY_POINTS)


def register_rerank_contrast(name: str, fn: Callable[[str], list[str]]) -> None:
    """Make ``fn(prompt) -> [caption, *alternatives]`` available as the decoder's
    ``rerank_contrast = name`` (see :func:`rerank_candidates`); packages can declare the same as an
    ``unclip.rerank_contrasts`` entry point instead."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"rerank_contrast names are non-empty strings, got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_rerank_contrast({name!r}, fn): fn must be callable")
    RERANK_CONTRASTS[name] = fn


def check_rerank_contrast(stage: str, name) -> None:
    """A ``ValueError`` unless ``name`` is None or a registered contrast of the decoder."""
    if name is None:
        return
    if stage_kind(stage) != "decoder":
        raise ValueError(
            f"{stage}: rerank_contrast is a decoder setting (how its best_of candidates are "
            f"scored); remove it from {stage}'s settings"
        )
    if not isinstance(name, str) or name not in RERANK_CONTRASTS:
        raise ValueError(
            f"{stage}: rerank_contrast must be one of {sorted(RERANK_CONTRASTS)} or None, got "
            f"{name!r} (unclip.sampling.register_rerank_contrast adds one)"
        )


@dataclasses.dataclass(frozen=True)
class RegionPart:
    """One phrase of a prompt, read on one side of the image (a contrast's ``regions``; see
    :func:`rerank_candidates`): ``axis`` ``"x"`` (columns) or ``"y"`` (rows); ``low``: the side
    before the split (left or top) rather than after it; ``captions``: the phrase as a caption of
    its own first, then its alternatives."""

    axis: str
    low: bool
    captions: tuple[str, ...]

    def __post_init__(self):
        if self.axis not in ("x", "y"):
            raise ValueError(f"RegionPart.axis must be 'x' or 'y', got {self.axis!r}")
        if not isinstance(self.low, bool):
            raise TypeError(f"RegionPart.low must be True (left/top) or False, got {self.low!r}")
        if isinstance(self.captions, str):
            raise TypeError("RegionPart.captions: a sequence of captions, not one string")
        object.__setattr__(self, "captions", tuple(self.captions))
        if len(self.captions) < 2:
            raise ValueError(
                "RegionPart.captions: the part's caption and at least one alternative, got "
                f"{list(self.captions)!r}"
            )


#: where a contrast's region parts split the image (fractions of its width or height); each
#: candidate counts at its best split, since a prompt such as "a circle to the left of a square"
#: fixes the order of its objects, not where between them the boundary lies
REGION_SPLITS = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7)


def region_views(images: torch.Tensor, axis: str, low: bool, splits=REGION_SPLITS) -> torch.Tensor:
    """``[len(splits), B, 3, H, W]``: ``images [B, 3, H, W]`` with everything on the other side of
    each split painted in the image's background, taken as the per-channel median of its border
    pixels (the regions are meant for flat backgrounds, as in the shapes world)."""
    if axis not in ("x", "y"):
        raise ValueError(f"region_views: axis must be 'x' or 'y', got {axis!r}")
    size = images.shape[-1] if axis == "x" else images.shape[-2]
    border = torch.cat(
        [images[..., 0, :], images[..., -1, :], images[..., :, 0], images[..., :, -1]], -1
    )
    fill = border.median(-1).values[..., None, None]
    centres = (torch.arange(size, device=images.device) + 0.5) / size
    shape = (1, 1, 1, size) if axis == "x" else (1, 1, size, 1)
    views = []
    for split in splits:
        keep = ((centres < split) == low).view(shape)
        views.append(torch.where(keep, images, fill))
    return torch.stack(views)


def region_scores(clip: CLIP, images, parts: Sequence[RegionPart]) -> torch.Tensor:
    """``[B]``: at the split that suits each image best, the sum over ``parts`` of ``log p(part's
    caption | the image masked to the part's side)`` among the part's captions."""
    if not parts:
        raise ValueError("region_scores: no parts to read (a prompt without regions has none)")
    total = torch.zeros(len(REGION_SPLITS), images.shape[0], device=clip.device)
    for part in parts:
        if not isinstance(part, RegionPart):
            raise TypeError(f"region parts are RegionPart objects, got {type(part).__name__}")
        txt = F.normalize(clip.encode_text(list(part.captions)).text_embed.float(), dim=-1)
        # encoded one split at a time: B views per encoding, as many as the candidates themselves
        for i, view in enumerate(region_views(images, part.axis, part.low)):
            img = F.normalize(clip.encode_image(view).float(), dim=-1)
            logp = ((img @ txt.to(img).T) * clip.logit_scale).log_softmax(-1)[:, 0]
            total[i] += logp.to(total.device)
    return total.max(0).values


def _contrast_scores(clip: CLIP, images, prompts, contrast) -> torch.Tensor:
    """Per image, ``log p(caption | image)`` over its prompt's caption set (a softmax of the
    CLIP's logits, ``logit_scale × cosine``), or the plain cosine where the set is empty; plus the
    contrast's region term where it has ``regions`` for the prompt (:func:`rerank_candidates`)."""
    fn = RERANK_CONTRASTS[contrast] if isinstance(contrast, str) else contrast
    sets = {p: list(fn(p)) for p in dict.fromkeys(prompts)}  # each distinct prompt once
    regions = getattr(fn, "regions", None)
    img = F.normalize(clip.encode_image(images), dim=-1)
    scores = torch.empty(len(prompts), device=img.device)
    for prompt, captions in sets.items():
        rows = torch.tensor([i for i, p in enumerate(prompts) if p == prompt], device=img.device)
        texts = captions or [prompt]
        txt = F.normalize(clip.encode_text(texts).text_embed.to(img), dim=-1)
        cos = img[rows] @ txt.T
        scores[rows] = (
            (cos.float() * clip.logit_scale).log_softmax(-1)[:, 0].to(scores)
            if len(captions) > 1
            else cos[:, 0]
        )
        # a prompt scored by the plain cosine gets no region term: log-probabilities added to a
        # cosine would not compare across its candidates' scale
        parts = list(regions(prompt)) if regions is not None and len(captions) > 1 else []
        if parts:
            mine = images[rows.to(images.device)]
            scores[rows] += region_scores(clip, mine, parts).to(scores)
    return scores


@torch.no_grad()
def rerank_candidates(
    clip: CLIP,
    images: torch.Tensor,
    prompts: Union[str, Sequence[str]],
    k: int,
    contrast: Union[str, Callable[[str], list[str]], None] = None,
    keep: int = 1,
) -> torch.Tensor:
    """Indices ``[B]`` of the best of each consecutive group of ``k`` candidates
    (``images [B·k, 3, H, W]`` in [-1, 1]) by the cosine between ``clip``'s embeddings of the image
    and of its prompt (the decoder's ``best_of``). ``prompts``: one per image (``B·k``), one per
    group (``B``), or one string for all; ``k = 1`` keeps every image. ``keep``: the indices
    ``[B·keep]`` of each group's ``keep`` best instead, group by group and in their original order
    within a group, so they form consecutive groups of ``keep`` again (the decoder's
    ``prune_keep``); ``keep >= k`` keeps every image.

    ``contrast`` (the decoder's ``rerank_contrast``; a name in :data:`RERANK_CONTRASTS` or a
    function ``prompt -> [caption, *alternatives]``): score each candidate instead by how much the
    CLIP prefers the caption over its alternatives, ``log p(caption | image)`` among them — the
    CLIP's retrieval task, which it is trained for, rather than how close the image is to the
    caption in absolute terms (an image close to every caption of its kind scores high on the
    cosine whatever it shows). ``"shapes"``: the one-attribute variants and color/shape swaps of a
    shapes caption (:func:`unclip.shapes.world.caption_alternatives`); ``"shapes-pairs"``: the same
    for two-object captions only.

    A contrast function may also carry ``regions``, a function ``prompt -> [RegionPart, ...]``
    (empty: none for that prompt): each part is a phrase of the prompt read on one side of the
    image, the other side painted in the background (:func:`region_views`), and a candidate's score
    gains the parts' summed ``log p(caption | side)`` at the split that suits it best
    (:data:`REGION_SPLITS`). A CLIP that reads one object well but binds two objects' attributes
    less surely (which color or shape goes with which object) is then asked the easier question
    once per object. ``"shapes-pairs-regions"``: ``"shapes-pairs"`` with each object of a
    two-object caption as a part (:func:`unclip.shapes.world.region_parts`). A prompt whose
    contrast has fewer than two captions (scored by the plain cosine) gets no region term; with
    pruning (``keep > 1``) the region term counts at both choices."""
    k = check_count(k, "k")
    keep = check_count(keep, "keep")
    if isinstance(contrast, str):
        check_rerank_contrast("decoder", contrast)
    elif contrast is not None and not callable(contrast):
        kind = type(contrast).__name__
        raise TypeError(f"rerank contrast must be a registered name or a function, got {kind}")
    if images.shape[0] % k:
        raise ValueError(f"rerank: {images.shape[0]} images are not groups of {k} candidates")
    if k == 1 or keep >= k:
        return torch.arange(images.shape[0])
    if isinstance(prompts, torch.Tensor):
        raise TypeError(
            "rerank takes the prompts (strings), not text embeddings: the reranking CLIP "
            "(pipe.rerank_clip) encodes them itself"
        )
    prompts = [prompts] * images.shape[0] if isinstance(prompts, str) else check_prompts(prompts)
    if len(prompts) == images.shape[0] // k:
        prompts = [p for p in prompts for _ in range(k)]
    if len(prompts) != images.shape[0]:
        raise ValueError(
            f"rerank: {len(prompts)} prompts for {images.shape[0]} images in groups of {k}; "
            f"give one prompt per image or one per group"
        )
    if contrast is not None:
        # log-probabilities over different caption sets (or a cosine) do not compare
        if any(len(set(prompts[i : i + k])) > 1 for i in range(0, len(prompts), k)):
            raise ValueError(
                "rerank with a contrast: the k candidates of a group must share one prompt "
                "(give one prompt per group)"
            )
        scores = _contrast_scores(clip, images, prompts, contrast).view(-1, k)
    else:
        scores = image_text_cosines(clip, images, clip.encode_text(prompts).text_embed).view(-1, k)
    scores = scores.float().cpu()
    first = torch.arange(scores.shape[0]) * k
    if keep == 1:
        return first + scores.argmax(1)
    best = scores.topk(keep, dim=1).indices.sort(dim=1).values
    return (first[:, None] + best).flatten()
