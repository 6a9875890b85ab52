"""One training loss and one classifier-free-guided sampling loop for every stage.

Noise schedules and update rules come from diffusers schedulers; this module only chooses them by
name (:func:`make_scheduler`), computes the training target (:func:`diffusion_loss`: ``epsilon``,
``sample`` (x_0) or ``v_prediction``, optional min-SNR-γ weighting, Hang et al. 2023, and for a
learned variance the Improved-DDPM hybrid loss of :mod:`unclip.diffusion.vlb`) and runs the
reverse process with classifier-free guidance (:func:`sample_loop`, Ho & Salimans 2022)::

    eps_hat = eps(x_t | ∅) + s · (eps(x_t | c) − eps(x_t | ∅))

Guided and unguided passes run as one batch ``[uncond; cond]``; with ``s == 1`` the unconditional
pass is skipped (it cancels exactly), so guidance 1 *is* the unguided path.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_unclip import UnCLIPScheduler
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from unclip.diffusion.config import SCHEDULERS, DiffusionConfig
from unclip.diffusion.schedulers import build_scheduler, check_scheduler_spec
from unclip.diffusion.vlb import predicted_x0, vlb_term

__all__ = [
    "SCHEDULERS",
    "make_scheduler",
    "training_scheduler",
    "diffusion_loss",
    "sample_loop",
    "denoise_steps",
    "guided_output",
    "initial_noise",
    "scheduler_step",
    "check_sampling_args",
    "Generator",
    "randn_generator",
    "StepState",
]

Generator = Optional[Union[torch.Generator, Sequence[torch.Generator]]]


def randn_generator(generator: Generator) -> Union[torch.Generator, list[torch.Generator], None]:
    """``generator`` as diffusers' ``randn_tensor`` takes it: one per batch element only as a
    list (it reads any other sequence as a single generator)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return list(generator)


@dataclass
class StepState:
    """What an ``on_step`` hook of :func:`denoise_steps` sees after step ``i`` (timestep ``t``),
    and may change for the steps that follow.

    ``x_t``: the sample the step started from; ``out``: the network's (guided) output at ``x_t``;
    ``x``: the sample after the step; ``input_scale``: the factor the sampler scaled ``x_t`` by
    before the network (``1/sqrt(1+σ²)`` for samplers in sigma space, 1 for the others). A hook
    may replace ``x`` (e.g. with fewer rows),
    ``denoise`` (the network call, e.g. with the matching conditioning rows) and ``generator``
    (e.g. the kept rows' generators); a hook that changes the batch also cuts the scheduler's
    per-sample state itself."""

    i: int
    t: torch.Tensor
    x_t: torch.Tensor
    out: torch.Tensor
    x: torch.Tensor
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    generator: Generator
    input_scale: float = 1.0


def check_sampling_args(stage: str, scheduler: str, steps: int, guidance_scale: float) -> None:
    """Raise a clear error for an unknown sampler, ``steps < 1``, or a guidance scale that is not a
    finite number ``>= 0`` (NaN and inf would turn every image into NaN)."""
    try:
        check_scheduler_spec(scheduler)
    except ValueError as exc:
        raise ValueError(f"{stage}: {exc}") from None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{stage}: steps must be an integer >= 1, got {steps!r}")
    if isinstance(scheduler, str) and scheduler == "unclip" and steps < 2:
        raise ValueError(
            f"{stage}: the 'unclip' sampler needs steps >= 2 (got {steps}); use ddim for one step"
        )
    if (
        not isinstance(guidance_scale, (int, float))
        or not math.isfinite(guidance_scale)
        or guidance_scale < 0
    ):
        raise ValueError(
            f"{stage}: guidance scale must be a finite number >= 0, got {guidance_scale!r}"
        )


def make_scheduler(
    name: str,
    diffusion: DiffusionConfig,
    *,
    clip_sample_range: Optional[float] = 1.0,
    learned_variance: bool = False,
):
    """A diffusers scheduler for sampling, by name: ``ddpm``, ``ddim``, ``dpm++`` or ``unclip``
    (configured here), or any other diffusers scheduler by alias, class name or instance
    (:func:`unclip.diffusion.schedulers.build_scheduler`).

    ``clip_sample_range`` clips predicted x_0 to ``[-r, r]`` (1 for images; None disables, e.g. for
    prior embeddings under DPM-Solver++). ``learned_variance``: the model outputs ``2C`` channels
    (mean, variance interpolation) as in Karlo's decoder; only ``ddpm``/``unclip`` use the variance
    half.
    """
    common = dict(
        num_train_timesteps=diffusion.num_train_timesteps, beta_schedule=diffusion.beta_schedule
    )
    clip = clip_sample_range is not None
    rng = float(clip_sample_range or 1.0)
    pred = diffusion.prediction_type
    if name == "unclip":
        if diffusion.beta_schedule != "squaredcos_cap_v2" or pred == "v_prediction":
            raise ValueError(
                "the 'unclip' sampler needs beta_schedule squaredcos_cap_v2 and an epsilon or "
                "sample (x_0) model; use ddpm, ddim or dpm++"
            )
        return UnCLIPScheduler(
            variance_type="learned_range" if learned_variance else "fixed_small_log",
            clip_sample=clip,
            clip_sample_range=rng,
            prediction_type=pred,
            num_train_timesteps=diffusion.num_train_timesteps,
        )
    if name == "ddpm":
        return DDPMScheduler(
            **common,
            prediction_type=pred,
            clip_sample=clip,
            clip_sample_range=rng,
            variance_type="learned_range" if learned_variance else "fixed_small",
            timestep_spacing="trailing",
        )
    if name == "ddim":
        return DDIMScheduler(
            **common,
            prediction_type=pred,
            clip_sample=clip,
            clip_sample_range=rng,
            timestep_spacing="trailing",
            set_alpha_to_one=False,
        )
    if name == "dpm++":
        return DPMSolverMultistepScheduler(
            **common,
            prediction_type=pred,
            algorithm_type="dpmsolver++",
            solver_order=2,
            timestep_spacing="trailing",
            final_sigmas_type="zero",
        )
    return build_scheduler(name, diffusion, learned_variance=learned_variance)


def training_scheduler(diffusion: DiffusionConfig) -> DDPMScheduler:
    """The forward (noising) process used in training: ``add_noise`` and ``get_velocity``."""
    return DDPMScheduler(
        num_train_timesteps=diffusion.num_train_timesteps,
        beta_schedule=diffusion.beta_schedule,
        prediction_type=diffusion.prediction_type,
    )


def _per_sample(
    fn: Callable[[torch.Generator], torch.Tensor], generators: Sequence[torch.Generator]
):
    return torch.stack([fn(g) for g in generators])


def shifted_timesteps(u: torch.Tensor, num_train_timesteps: int, shift: float) -> torch.Tensor:
    """Integer timesteps from uniforms ``u`` in [0, 1) under the shift ``s``.

    ``t/T = s·u / (1 + (s − 1)·u)`` maps the uniform onto one with density rising towards the
    noisy end for ``s > 1`` (a fraction ``s/(1+s)`` of the draws lands in the noisier half: three
    quarters for ``s = 3``), and is the identity for ``s = 1``.
    """
    s = float(shift)
    frac = s * u / (1.0 + (s - 1.0) * u)
    return (frac * num_train_timesteps).long().clamp_(0, num_train_timesteps - 1)


def diffusion_loss(
    model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x_0: torch.Tensor,
    scheduler: DDPMScheduler,
    *,
    prediction_type: str = "epsilon",
    min_snr_gamma: Optional[float] = None,
    generators: Optional[Sequence[torch.Generator]] = None,
    t: Optional[torch.Tensor] = None,
    noise: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    learned_variance: bool = False,
    vlb_weight: float = 0.0,
    timestep_shift: float = 1.0,
) -> torch.Tensor:
    """Denoising loss ``|| target − model_fn(x_t, t) ||²`` on ``x_0 [B, ...]``.

    ``t ~ U{0, T-1}`` and ``eps ~ N(0, I)`` are drawn per sample from ``generators`` (one
    ``torch.Generator`` per sample, so results do not depend on how samples are grouped into
    batches), or from the global RNG when ``generators`` is None; ``timestep_shift`` s ≠ 1 draws
    ``t`` from the shifted density instead (:func:`shifted_timesteps`). ``prediction_type``:
    ``epsilon`` (target eps), ``sample`` (target x_0) or ``v_prediction`` (target v = α·eps −
    σ·x_0). ``min_snr_gamma`` weights each sample by ``min(SNR, γ)`` expressed for the chosen
    target. ``learned_variance``: the model outputs ``2C`` channels, its mean parameter then the
    variance interpolation ``v`` of :mod:`unclip.diffusion.vlb`; the loss adds the hybrid loss's
    variational-bound term ``vlb_weight · T · L_t`` (Improved DDPM: ``L_simple + λ·L_vlb``, ``L_t``
    in bits/dim, the mean under a stop-gradient so only the variance learns from it; min-SNR
    weighting applies to the ``L_simple`` part only). Returns a scalar (``reduction="mean"``) or the
    per-sample losses ``[B]`` (``reduction="none"``).
    """
    b = x_0.shape[0]
    T = scheduler.config["num_train_timesteps"]
    cpu = torch.device("cpu")
    if t is None and timestep_shift != 1.0:
        if generators is not None:
            u = _per_sample(lambda g: torch.rand((), generator=g, device=cpu), generators)
        else:
            u = torch.rand((b,), device=cpu)
        t = shifted_timesteps(u, T, timestep_shift)
    elif t is None:
        if generators is not None:
            t = _per_sample(lambda g: torch.randint(0, T, (), generator=g, device=cpu), generators)
        else:
            t = torch.randint(0, T, (b,), device=cpu)
    if noise is None:
        if generators is not None:
            noise = _per_sample(
                lambda g: torch.randn(x_0.shape[1:], generator=g, device=cpu), generators
            )
        else:
            noise = torch.randn(x_0.shape, device=cpu)
    t = t.to(x_0.device)
    noise = noise.to(x_0.device, x_0.dtype)
    x_t = scheduler.add_noise(x_0, noise, t)  # type: ignore[arg-type]  # any integer tensor
    pred = model_fn(x_t, t).float()
    var = None
    if learned_variance:
        pred, var = _split_variance(pred, x_0)
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "sample":
        target = x_0
    elif prediction_type == "v_prediction":
        target = scheduler.get_velocity(x_0, noise, t)  # type: ignore[arg-type]  # any int tensor
    else:
        raise ValueError(
            f"unknown prediction_type {prediction_type!r}; use epsilon, sample or v_prediction"
        )
    if pred.shape != target.shape:
        raise ValueError(
            f"model output {tuple(pred.shape)} does not match the target {tuple(target.shape)}"
        )
    loss = F.mse_loss(pred, target.float(), reduction="none").flatten(1).mean(1)
    if min_snr_gamma is not None:
        ac = scheduler.alphas_cumprod.to(x_0.device)[t].float()
        snr = ac / (1 - ac)
        clipped = torch.clamp(snr, max=float(min_snr_gamma))
        weight = {"epsilon": clipped / snr, "sample": clipped, "v_prediction": clipped / (snr + 1)}[
            prediction_type
        ]
        loss = loss * weight
    if var is not None and vlb_weight:
        x_0_hat = predicted_x0(scheduler, x_t, t, pred.detach(), prediction_type)
        loss = loss + float(vlb_weight) * T * vlb_term(scheduler, x_0, x_t, t, x_0_hat, var)
    return loss.mean() if reduction == "mean" else loss


def _split_variance(out: torch.Tensor, x_0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean parameter, variance interpolation)`` halves of a learned-variance model output."""
    c = x_0.shape[1]
    if out.shape[1] != 2 * c or out.shape[2:] != x_0.shape[2:]:
        raise ValueError(
            f"a learned-variance model must output {2 * c} channels (mean, variance) of "
            f"{tuple(x_0.shape[2:])}, got {tuple(out.shape[1:])}"
        )
    return out[:, :c], out[:, c:]


def _step_kwargs(scheduler, generator, prev_timestep):
    params = inspect.signature(scheduler.step).parameters
    kwargs = {}
    if "generator" in params:
        kwargs["generator"] = generator
    if "prev_timestep" in params:
        kwargs["prev_timestep"] = prev_timestep
    return kwargs


def sample_loop(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shape: tuple,
    scheduler,
    *,
    num_steps: int,
    guidance_scale: float,
    generator: Generator = None,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    latents: Optional[torch.Tensor] = None,
    learned_variance: bool = False,
    progress: bool = True,
    desc: str = "sampling",
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None,
    on_step: Optional[Callable[[StepState], None]] = None,
) -> torch.Tensor:
    """Run the reverse process from noise ``x_T`` of ``shape`` and return ``x_0``.

    ``denoise(x_in, t)`` returns the model output for ``x_in``; when ``guidance_scale != 1``
    ``x_in`` is ``[x_t; x_t]`` (batch ``2B``) and the caller's conditioning must be ordered
    ``[uncond; cond]``, prepared once (see :func:`is_guided`). ``generator`` (one, or a list with
    one per batch element) draws the initial noise and any noise the scheduler adds, so a seed
    reproduces the result and a list of per-image generators gives the same images whether they are
    sampled together or alone. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs only ``denoise``
    under ``torch.autocast``; its output is cast back to ``dtype`` so guidance and the scheduler
    step stay in full precision.
    ``callback(i, t, x)`` runs after step ``i`` (timestep ``t``) with the new ``x``; a tensor it
    returns replaces ``x``. ``on_step(state)`` runs before it with the whole :class:`StepState`
    (the decoder's candidate choice keeps only some rows this way).
    """
    scheduler.set_timesteps(num_steps, device=device)
    x = initial_noise(shape, scheduler, generator, latents, device, dtype)
    return denoise_steps(
        denoise,
        x,
        scheduler,
        guidance_scale=guidance_scale,
        generator=generator,
        learned_variance=learned_variance,
        progress=progress,
        desc=desc,
        autocast_dtype=autocast_dtype,
        callback=callback,
        on_step=on_step,
    )


def initial_noise(
    shape: tuple,
    scheduler,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x_T`` of ``shape`` for ``scheduler`` (timesteps set): ``latents`` (checked against
    ``shape``) or noise drawn by ``generator`` (one, or one per batch element), scaled by the
    scheduler's initial noise sigma."""
    if latents is None:
        latents = randn_tensor(
            shape, generator=randn_generator(generator), device=torch.device(device), dtype=dtype
        )
    elif tuple(latents.shape) != tuple(shape):
        raise ValueError(f"latents must have shape {tuple(shape)}, got {tuple(latents.shape)}")
    return latents.to(device=device, dtype=dtype) * scheduler.init_noise_sigma


def guided_output(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    t: torch.Tensor,
    scheduler,
    *,
    guidance_scale: float,
    learned_variance: bool = False,
    autocast_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The classifier-free-guided model output at ``x`` (timestep ``t``), as ``scheduler.step``
    takes it: ``denoise`` sees ``[x; x]`` when guided (see :func:`sample_loop`); a learned variance
    keeps the conditioned half's variance channels where the scheduler uses them and is dropped
    otherwise."""
    x_in = torch.cat([x, x]) if is_guided(guidance_scale) else x
    x_in = scheduler.scale_model_input(x_in, t)
    if autocast_dtype is None:
        out = denoise(x_in, t)
    else:
        with torch.autocast(x.device.type, dtype=autocast_dtype):
            out = denoise(x_in, t)
        out = out.to(x.dtype)
    var = None
    if learned_variance:
        out, var = out.split(x.shape[1], dim=1)
    if is_guided(guidance_scale):
        uncond, cond = out.chunk(2)
        out = uncond + guidance_scale * (cond - uncond)
        if var is not None:
            var = var.chunk(2)[1]
    if var is not None and getattr(scheduler.config, "variance_type", None) == "learned_range":
        out = torch.cat([out, var], dim=1)
    return out


def denoise_steps(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    scheduler,
    *,
    guidance_scale: float,
    start: int = 0,
    generator: Generator = None,
    learned_variance: bool = False,
    progress: bool = True,
    desc: str = "sampling",
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None,
    on_step: Optional[Callable[[StepState], None]] = None,
) -> torch.Tensor:
    """The reverse process from ``x``, the noisy sample at ``scheduler.timesteps[start]`` (its
    timesteps already set), to ``x_0``: :func:`sample_loop` from its first step, or image-to-image
    from a later one. Arguments as :func:`sample_loop`."""
    timesteps = scheduler.timesteps
    if start and hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)  # multistep solvers index their history by step
    steps = range(start, len(timesteps))
    for i in tqdm(steps, desc=desc, disable=not progress, leave=False):
        t = timesteps[i]
        out = guided_output(
            denoise,
            x,
            t,
            scheduler,
            guidance_scale=guidance_scale,
            learned_variance=learned_variance,
            autocast_dtype=autocast_dtype,
        )
        # a linear multistep solver started mid-schedule (image-to-image) has only the steps
        # since ``start`` in its history; left alone it would weigh missing ones
        scale = 1.0
        if on_step is not None:
            # read before the step: samplers in sigma space index their sigma by a step counter
            # that the step moves on
            scale = float(scheduler.scale_model_input(torch.ones((), device=x.device), t))
        x_next = scheduler_step(scheduler, out, i, x, generator, history=i - start + 1)
        if on_step is not None:
            state = StepState(i, t, x, out, x_next, denoise, generator, scale)
            on_step(state)
            x_next, denoise, generator = state.x, state.denoise, state.generator
        x = x_next
        if callback is not None:
            new = callback(i, t, x)
            x = x if new is None else new
    return x


def scheduler_step(
    scheduler,
    out: torch.Tensor,
    i: int,
    x: torch.Tensor,
    generator: Generator,
    history: Optional[int] = None,
):
    """``scheduler``'s step ``i`` (of its set timesteps) from ``x`` with the model output ``out``:
    the sample at the next timestep (``x_0`` after the last). ``history``: how many steps this
    run has taken, counting this one, for a sampler whose step takes an ``order`` (LMS)."""
    timesteps = scheduler.timesteps
    prev = timesteps[i + 1] if i + 1 < len(timesteps) else None
    kwargs = _step_kwargs(scheduler, generator, prev)
    if history is not None and "order" in inspect.signature(scheduler.step).parameters:
        kwargs["order"] = min(history, 4)
    return scheduler.step(out, timesteps[i], x, **kwargs).prev_sample


def is_guided(guidance_scale: float) -> bool:
    """Whether sampling runs the unconditional pass (every scale except exactly 1)."""
    return float(guidance_scale) != 1.0


__all__.append("is_guided")
