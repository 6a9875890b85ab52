"""Learned σ and the Improved-DDPM hybrid loss: the variational-bound term against closed forms
written here from the papers' formulas, its stop-gradient, agreement with the variance the
diffusers samplers use, a toy fit that reaches the true reverse-process variance, and the config
checks."""

import math

import pytest
import torch
from diffusers import DDPMScheduler, UnCLIPScheduler

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import diffusion_loss, training_scheduler
from unclip.diffusion.vlb import learned_range_log_variance, vlb_term
from unclip.train.config import load_stage_config
from unclip.utils.config import ConfigError

TINY_DECODER = "configs/tiny/decoder.yaml"


def cosine_schedule(T: int, s: float = 0.008) -> tuple[list[float], list[float]]:
    """(β_t, ᾱ_t) of the cosine schedule (Nichol & Dhariwal 2021, eq. 17; β capped at 0.999), in
    float64, computed from the formula (not from diffusers)."""

    def f(u):
        return math.cos((u + s) / (1 + s) * math.pi / 2) ** 2

    betas = [min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)]
    alphas_cumprod, p = [], 1.0
    for b in betas:
        p *= 1 - b
        alphas_cumprod.append(p)
    return betas, alphas_cumprod


def phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def closed_form_l_t(x_0, x_t, t, x_0_hat, v, T=1000) -> float:
    """L_t in bits/dim for one sample, element by element (Ho et al. 2020 eq. 5-7 and 13, Nichol &
    Dhariwal 2021 eq. 15)."""
    betas, ac = cosine_schedule(T)
    beta, a_t = betas[t], ac[t]
    a_prev = ac[t - 1] if t > 0 else 1.0
    post_var = [b * (1 - (ac[i - 1] if i else 1.0)) / (1 - ac[i]) for i, b in enumerate(betas)]
    log_post = math.log(post_var[max(t, 1)])  # β̃_0 = 0 is clipped to β̃_1
    c0 = math.sqrt(a_prev) * beta / (1 - a_t)
    ct = math.sqrt(1 - beta) * (1 - a_prev) / (1 - a_t)
    total, n = 0.0, 0
    for x0, xt, xh, vv in zip(x_0.flatten(), x_t.flatten(), x_0_hat.flatten(), v.flatten()):
        x0, xt, xh, vv = float(x0), float(xt), float(xh), float(vv)
        frac = (vv + 1) / 2
        logvar = frac * math.log(beta) + (1 - frac) * log_post
        mean = c0 * xh + ct * xt
        if t == 0:
            sd = math.exp(0.5 * logvar)
            hi = 1.0 if x0 > 0.999 else phi((x0 - mean + 1 / 255) / sd)
            lo = 0.0 if x0 < -0.999 else phi((x0 - mean - 1 / 255) / sd)
            total += -math.log(max(hi - lo, 1e-12))
        else:
            true_mean = c0 * x0 + ct * xt
            total += 0.5 * (
                -1
                + logvar
                - log_post
                + math.exp(log_post - logvar)
                + (true_mean - mean) ** 2 / math.exp(logvar)
            )
        n += 1
    return total / n / math.log(2)


def test_vlb_term_matches_the_closed_form():
    sched = training_scheduler(DiffusionConfig())
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0, 0, 1, 7, 120, 640, 999])
    b = len(t)
    # 8-bit images with both edge values present, so every branch of the t=0 likelihood runs
    x_0 = torch.randint(0, 256, (b, 3, 4, 4), generator=g).float() / 127.5 - 1
    x_0[:, 0, 0, 0], x_0[:, 0, 0, 1] = -1.0, 1.0
    noise = torch.randn(x_0.shape, generator=g)
    x_t = sched.add_noise(x_0, noise, t)
    # a prediction close to the truth (as a trained model's) and a poor one for t = 0
    x_0_hat = x_0 + 0.01 * torch.randn(x_0.shape, generator=g)
    x_0_hat[1] = torch.randn(x_0.shape[1:], generator=g).clamp(-1, 1)
    v = torch.rand(x_0.shape, generator=g) * 2.4 - 1.2
    got = vlb_term(sched, x_0, x_t, t, x_0_hat, v)
    want = torch.tensor(
        [closed_form_l_t(x_0[i], x_t[i], int(t[i]), x_0_hat[i], v[i]) for i in range(b)],
        dtype=torch.float64,
    )
    assert got.shape == (b,)
    assert torch.allclose(got.double(), want, rtol=2e-3, atol=1e-4), (got, want)
    assert (want > 0).all()


def test_hybrid_loss_trains_only_the_variance_through_the_bound():
    """The bound sees the mean through a stop-gradient: adding it changes the gradient of the
    variance half only; the mean half gets exactly the L_simple gradient."""
    sched = training_scheduler(DiffusionConfig())
    g = torch.Generator().manual_seed(1)
    x_0 = torch.rand(4, 3, 4, 4, generator=g) * 2 - 1
    t = torch.tensor([0, 3, 250, 900])
    noise = torch.randn(x_0.shape, generator=g)
    out0 = torch.randn(4, 6, 4, 4, generator=g)

    def grads(weight):
        out = out0.clone().requires_grad_(True)
        loss = diffusion_loss(
            lambda x_t, t_: out,
            x_0,
            sched,
            t=t,
            noise=noise,
            learned_variance=True,
            vlb_weight=weight,
        )
        loss.backward()
        return loss, out.grad

    simple, g_simple = grads(0.0)
    hybrid, g_hybrid = grads(1e-3)
    assert hybrid > simple
    assert torch.equal(g_hybrid[:, :3], g_simple[:, :3])
    assert (g_simple[:, 3:] == 0).all() and (g_hybrid[:, 3:] != 0).all()
    # the weight is λ·T on L_t: λ = 1e-3 with T = 1000 adds L_t (bits/dim) itself
    x_t = sched.add_noise(x_0, noise, t)
    x_0_hat = (x_t - (1 - sched.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1) * out0[:, :3]) / (
        sched.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
    )
    l_t = vlb_term(sched, x_0, x_t, t, x_0_hat, out0[:, 3:])
    assert torch.allclose(hybrid - simple, l_t.mean(), rtol=1e-4)


@pytest.mark.parametrize("scheduler", [DDPMScheduler, UnCLIPScheduler])
def test_training_variance_is_the_samplers_learned_range(scheduler):
    """Training reads the variance half as diffusers' learned_range samplers do (t > 0; at t = 0
    they add no noise)."""
    kw = dict(variance_type="learned_range", num_train_timesteps=1000)
    if scheduler is DDPMScheduler:
        kw["beta_schedule"] = "squaredcos_cap_v2"
    sampler = scheduler(**kw)
    sched = training_scheduler(DiffusionConfig())
    g = torch.Generator().manual_seed(2)
    for t in (1, 2, 50, 500, 998, 999):
        v = torch.rand(1, 3, 2, 2, generator=g) * 2 - 1
        want = sampler._get_variance(t, predicted_variance=v)
        got = learned_range_log_variance(sched, torch.tensor([t]), v)
        assert torch.allclose(got, want.float(), rtol=1e-4, atol=1e-5), t


def test_hybrid_loss_fits_the_true_reverse_variance(one_thread):
    """A model with one mean slope and one variance value per timestep, trained with the hybrid loss
    on x_0 ~ N(0, 0.3²) (T = 10, so β_t and β̃_t are far apart), learns
    log σ_t² = log Var(x_{t−1} | x_t), the true reverse variance of this data (closed form: with
    V = ᾱ_{t−1}s² + 1 − ᾱ_{t−1}, Var(x_{t−1}|x_t) = V β_t / (α_t V + β_t)), starting from the middle
    of the learned range."""
    T, s, dims = 10, 0.3, 16
    sched = DDPMScheduler(num_train_timesteps=T, beta_schedule="squaredcos_cap_v2")
    betas, ac = cosine_schedule(T)
    target, gap = [], []
    for t in range(1, T):
        b, prev = betas[t], ac[t - 1]
        post = b * (1 - prev) / (1 - ac[t])
        var = prev * s * s + 1 - prev
        true_var = var * b / ((1 - b) * var + b)
        gap.append(math.log(b) - math.log(post))
        target.append((math.log(true_var) - math.log(post)) / gap[-1])
    target, gap = torch.tensor(target), torch.tensor(gap)

    torch.manual_seed(0)
    slope = torch.zeros(T, requires_grad=True)
    v = torch.zeros(T, requires_grad=True)
    opt = torch.optim.Adam([slope, v], lr=0.05)
    steps = 300
    # the step size decays to 0 so the fit settles below the noise of the last batches
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x_0 = torch.randn(256, dims, generator=g) * s
        t = torch.randint(1, T, (256,), generator=g)
        noise = torch.randn(x_0.shape, generator=g)

        def model(x_t, t_):
            eps = slope[t_][:, None] * x_t
            return torch.cat([eps, v[t_][:, None].expand_as(x_t)], dim=1)

        loss = diffusion_loss(
            model, x_0, sched, t=t, noise=noise, learned_variance=True, vlb_weight=1.0 / T
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    learned = ((v.detach() + 1) / 2)[1:]
    # where β_t and β̃_t differ by > 15% (t = 1..6 here) the interpolation is well determined
    # (above, the whole learned range spans < 14% of variance and the loss is nearly flat in it):
    # each of those moved from the middle towards its own target (some up, some down) and reached it
    start = torch.full_like(target, 0.5)
    sel = gap > 0.15
    assert sel.sum() == 6
    assert ((learned - start).sign() == (target - start).sign())[sel].all(), (learned, target)
    assert (learned - target).abs()[sel].max() < 0.05, (learned, target)
    assert ((learned - target).abs() < 0.3 * (start - target).abs())[sel].all()


def _decoder_cfg(*overrides):
    return load_stage_config(TINY_DECODER, list(overrides))


def test_config_checks_for_learned_variance():
    cfg = _decoder_cfg("decoder.learned_variance=true", "diffusion.vlb_weight=0.001")
    assert cfg.decoder.learned_variance and cfg.diffusion.vlb_weight == 0.001
    assert not _decoder_cfg().decoder.learned_variance  # default: a fixed variance, not predicted
    with pytest.raises(ConfigError, match="needs diffusion.vlb_weight > 0"):
        _decoder_cfg("decoder.learned_variance=true")
    with pytest.raises(ConfigError, match="set decoder.learned_variance=true or"):
        _decoder_cfg("diffusion.vlb_weight=0.001")
    with pytest.raises(ConfigError, match="stage 'upsampler' has none"):
        load_stage_config("configs/tiny/sr32.yaml", ["diffusion.vlb_weight=0.001"])
    with pytest.raises(ConfigError, match="vlb_weight must be a finite number >= 0"):
        _decoder_cfg("diffusion.vlb_weight=-1")
    with pytest.raises(ConfigError, match="clip_view='full' applies to stage 'decoder' only"):
        load_stage_config("configs/tiny/prior.yaml", ["data.clip_view=full"])


def test_learned_variance_output_of_the_wrong_size_is_a_clear_error():
    sched = training_scheduler(DiffusionConfig())
    with pytest.raises(ValueError, match="must output 6 channels"):
        diffusion_loss(lambda x_t, t: x_t, torch.zeros(2, 3, 4, 4), sched, learned_variance=True)


def test_learned_variance_decoder_trains_exports_and_samples_ancestrally(tmp_path, one_thread):
    """A tiny decoder with learned σ trains with the hybrid loss (finite losses), its sample grid
    runs the 'unclip' ancestral sampler on the variance half, and the exported component keeps
    its 6 output channels."""
    import json

    from unclip.cli import train_decoder
    from unclip.nets.decoder import UnCLIPDecoder

    out = tmp_path / "run"
    code = train_decoder.main(
        [
            TINY_DECODER,
            f"train.output_dir={out}",
            "train.progress=false",
            "train.max_steps=2",
            "train.log_every=1",
            "train.sample_every=2",
            "decoder.learned_variance=true",
            "diffusion.vlb_weight=0.001",
            "sampling.scheduler=unclip",
            "sampling.steps=3",
        ]
    )
    assert code == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "loss" in m] == [1, 2]
    assert all(math.isfinite(m["loss"]) for m in logged if "loss" in m)
    assert (out / "samples" / "step_00000002.png").is_file()
    decoder = UnCLIPDecoder.from_pretrained(out / "final" / "decoder")
    assert decoder.config.learned_variance and decoder.unet.config.out_channels == 6
