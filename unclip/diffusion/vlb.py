"""Learned reverse-process variances and the variational-bound term of the hybrid loss.

Improved DDPM (Nichol & Dhariwal 2021, §3.1), as used by GLIDE and the unCLIP decoder: the network
outputs, beside its mean parameter (eps, x_0 or v), a per-channel interpolation value ``v`` and

    log σ_t² = frac · log β_t + (1 − frac) · log β̃_t,    frac = (v + 1) / 2

where ``β̃_t = β_t (1 − ᾱ_{t−1}) / (1 − ᾱ_t)`` is the posterior variance of
``q(x_{t−1} | x_t, x_0)``. This is diffusers' ``variance_type="learned_range"`` (``DDPMScheduler``
and ``UnCLIPScheduler`` read the second half of the model output the same way), so a decoder
trained here samples ancestrally through those schedulers without conversion.

The variance is trained by the variational bound (:func:`vlb_term`): for ``t > 0`` the KL divergence
``KL(q(x_{t−1} | x_t, x_0) ‖ p(x_{t−1} | x_t))`` between Gaussians, for ``t = 0`` the negative
log-likelihood of ``x_0`` under the discretised Gaussian decoder (256 bins over [−1, 1]), both per
dimension and in bits, as in the paper. The training loss is ``L_simple + λ · L_vlb`` with
``L_vlb ≈ T · L_t`` for the sampled ``t`` (:func:`unclip.diffusion.diffusion_loss`); the model mean
enters the bound with a stop-gradient, so the bound trains only the variance and ``L_simple`` alone
the mean.

As in Improved DDPM, ``log β̃_0`` (β̃_0 = 0) is replaced by ``log β̃_1`` so the interpolation stays
finite at ``t = 0``; samplers never use the variance at ``t = 0`` (no noise is added on the last
step), so this only affects the ``t = 0`` likelihood term.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "posterior_tables",
    "learned_range_log_variance",
    "predicted_x0",
    "normal_kl",
    "discretized_gaussian_log_likelihood",
    "vlb_term",
]


def posterior_tables(scheduler) -> dict[str, torch.Tensor]:
    """Per-timestep float64 tables ``[T]`` of a diffusers scheduler's schedule: ``log_beta``,
    ``log_posterior_variance`` (log β̃, with index 0 set to index 1), ``coef_x0`` and ``coef_xt``
    (posterior mean ``μ̃ = coef_x0 · x_0 + coef_xt · x_t``, Ho et al. 2020 eq. 7)."""
    betas = scheduler.betas.double()
    # in float64 from the betas: diffusers' float32 ᾱ_t leaves 1 − ᾱ_t (≈ β_0 = 4e-5 at t = 0 on
    # the cosine schedule) with ~1e-3 relative error, which the posterior coefficients divide by
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
    post_var = betas * (1 - prev) / (1 - alphas_cumprod)
    # β̃_0 = 0: clip its log to β̃_1's (Improved DDPM), the only finite choice at t = 0
    log_post = torch.log(torch.cat([post_var[1:2], post_var[1:]]))
    return {
        "log_beta": torch.log(betas),
        "log_posterior_variance": log_post,
        "coef_x0": betas * prev.sqrt() / (1 - alphas_cumprod),
        "coef_xt": (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod),
        "alphas_cumprod": alphas_cumprod,
    }


def _at(table: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``table[t]`` shaped ``[B, 1, …]`` to broadcast against ``like``, in float32 on its device."""
    values = table.to(t.device)[t].to(device=like.device, dtype=torch.float32)
    return values.view(-1, *([1] * (like.ndim - 1)))


def learned_range_log_variance(scheduler, t: torch.Tensor, v: torch.Tensor, tables=None):
    """``log σ_t²`` ``[B, C, …]`` from the model's variance output ``v`` ``[B, C, …]`` (module doc);
    ``t`` ``[B]`` int."""
    tables = tables or posterior_tables(scheduler)
    frac = (v.float() + 1) / 2
    return frac * _at(tables["log_beta"], t, v) + (1 - frac) * _at(
        tables["log_posterior_variance"], t, v
    )


def predicted_x0(
    scheduler, x_t: torch.Tensor, t: torch.Tensor, pred: torch.Tensor, prediction_type: str
):
    """The model's ``x̂_0`` from its mean output ``pred`` for ``prediction_type`` ``epsilon``,
    ``sample`` or ``v_prediction`` (not clipped, as in training)."""
    ac = _at(scheduler.alphas_cumprod.double(), t, x_t)
    a, s = ac.sqrt(), (1 - ac).sqrt()
    x_t = x_t.float()
    if prediction_type == "epsilon":
        return (x_t - s * pred) / a
    if prediction_type == "sample":
        return pred
    if prediction_type == "v_prediction":
        return a * x_t - s * pred
    raise ValueError(
        f"unknown prediction_type {prediction_type!r}; use epsilon, sample or v_prediction"
    )


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """Elementwise ``KL(N(mean1, e^logvar1) ‖ N(mean2, e^logvar2))`` in nats."""
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + torch.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def discretized_gaussian_log_likelihood(
    x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor
) -> torch.Tensor:
    """Elementwise log-probability (nats) of ``x`` in [−1, 1] under a Gaussian of ``mean`` and
    standard deviation ``exp(log_scale)`` integrated over the 8-bit bin of ``x`` (width 2/255); the
    edge bins extend to ±∞ (Ho et al. 2020, eq. 13). Probabilities are floored at 1e-12 as in the
    Improved-DDPM reference, so a far-off mean early in training costs at most ~40 bits per
    dimension instead of thousands (at t = 0 the standard deviation is ~0.006)."""
    centered = x - mean
    inv_std = torch.exp(-log_scale)
    upper = inv_std * (centered + 1.0 / 255.0)
    lower = inv_std * (centered - 1.0 / 255.0)
    ndtr = torch.special.ndtr
    # a bin above the mean is measured with upper tails: Φ(b) − Φ(a) of two numbers near 1 would
    # lose the bin's mass to float32 cancellation
    inner = torch.where(lower > 0, ndtr(-lower) - ndtr(-upper), ndtr(upper) - ndtr(lower))
    prob = torch.where(x < -0.999, ndtr(upper), torch.where(x > 0.999, ndtr(-lower), inner))
    return torch.log(prob.clamp(min=1e-12))


def vlb_term(
    scheduler,
    x_0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    x_0_hat: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """The variational-bound term ``L_t`` per sample ``[B]``, in bits per dimension.

    ``x_0``, ``x_t``: ``[B, C, …]``; ``t``: ``[B]``; ``x_0_hat``: the model's predicted ``x_0``
    (pass it detached for the hybrid loss's stop-gradient); ``v``: the model's variance output.
    ``t > 0``: ``KL(q(x_{t−1}|x_t,x_0) ‖ N(μ(x_t, x̂_0), σ_t²))``; ``t = 0``: ``−log p(x_0 | x_1)``
    under the discretised Gaussian decoder.
    """
    tables = posterior_tables(scheduler)
    x_0, x_t, x_0_hat = x_0.float(), x_t.float(), x_0_hat.float()
    c0, ct = _at(tables["coef_x0"], t, x_t), _at(tables["coef_xt"], t, x_t)
    true_mean = c0 * x_0 + ct * x_t
    true_logvar = _at(tables["log_posterior_variance"], t, x_t).expand_as(x_t)
    model_mean = c0 * x_0_hat + ct * x_t
    model_logvar = learned_range_log_variance(scheduler, t, v, tables)
    kl = normal_kl(true_mean, true_logvar, model_mean, model_logvar).flatten(1).mean(1)
    nll = -discretized_gaussian_log_likelihood(x_0, model_mean, 0.5 * model_logvar)
    nll = nll.flatten(1).mean(1)
    return torch.where(t.to(kl.device) == 0, nll, kl) / math.log(2.0)
