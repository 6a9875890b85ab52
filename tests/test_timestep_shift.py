"""`diffusion.timestep_shift`: training timesteps drawn more often at high noise
(t/T = s·u / (1 + (s − 1)·u)), checked against the formula, in the loss, in a training config,
and the default left exactly as the uniform draw it was."""

import pytest
import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import diffusion_loss, shifted_timesteps, training_scheduler
from unclip.train.config import load_stage_config
from unclip.utils.config import ConfigError


def test_shifted_timesteps_follow_the_formula():
    u = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    assert torch.equal(shifted_timesteps(u, 1000, 1.0), (u * 1000).long())
    t = shifted_timesteps(u, 1000, 3.0)
    # t >= T/2 exactly when u >= 1/(s+1): three quarters of an even grid for s = 3
    assert int((t >= 500).sum()) == 750
    assert bool((t[1:] >= t[:-1]).all()) and int(t.min()) >= 0 and int(t.max()) <= 999
    expected = [int(3 * x / (1 + 2 * x) * 1000) for x in u[::97].tolist()]
    assert t[::97].tolist() == expected
    # s < 1 favours low noise
    assert int((shifted_timesteps(u, 1000, 1 / 3) >= 500).sum()) == 250
    # a float32 u just under 1 with a large shift rounds to t/T = 1: clamped to the last step
    top = torch.tensor([1 - 2**-24], dtype=torch.float32)
    assert int(shifted_timesteps(top, 1000, 1e3)) == 999


def _drawn_t(shift, seeds):
    seen = {}

    def model_fn(x_t, t):
        seen["t"] = t.clone()
        return torch.zeros_like(x_t)

    sched = training_scheduler(DiffusionConfig())
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    loss = diffusion_loss(
        model_fn, torch.zeros(len(seeds), 3, 4, 4), sched, generators=gens, timestep_shift=shift
    )
    return seen["t"], loss


def test_the_loss_draws_shifted_timesteps_per_sample_generator():
    seeds = list(range(64))
    t, _ = _drawn_t(3.0, seeds)
    u = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(s)) for s in seeds])
    assert torch.equal(t, shifted_timesteps(u, 1000, 3.0))
    assert float((t >= 500).float().mean()) > 0.6  # uniform would give about one half
    # the default keeps the uniform integer draw, so earlier runs reproduce bit for bit
    t1, _ = _drawn_t(1.0, seeds)
    ref = torch.stack(
        [torch.randint(0, 1000, (), generator=torch.Generator().manual_seed(s)) for s in seeds]
    )
    assert torch.equal(t1, ref)


def test_config_accepts_and_checks_the_shift():
    cfg = load_stage_config("configs/tiny/decoder.yaml", ["diffusion.timestep_shift=3"])
    assert cfg.diffusion.timestep_shift == 3.0
    assert load_stage_config("configs/tiny/decoder.yaml").diffusion.timestep_shift == 1.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="timestep_shift"):
            DiffusionConfig(timestep_shift=bad)


def test_every_stage_loss_passes_the_shift_on(tiny_pipe):
    """The decoder, upsampler and prior losses draw their timesteps with the config's shift: a
    huge shift puts every draw at the last step."""
    from unclip.nets.decoder import encode_captions
    from unclip.train.decoder import decoder_loss, upsampler_loss
    from unclip.train.prior import prior_loss

    clip, seen = tiny_pipe.clip, []

    class recording:  # the losses reach the network through .module, as under DDP
        def __init__(self, net):
            self.module = net

        def __call__(self, x_t, t, *args):
            seen.append(t.clone())
            return self.module(x_t, t, *args)

    captions = ["a red circle", "a big blue square"]
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    over = ["diffusion.timestep_shift=1e6"]
    cfg = load_stage_config("configs/tiny/decoder.yaml", over)
    sched = training_scheduler(cfg.diffusion)
    size = tiny_pipe.decoder.config.sample_size
    batch = {"image": torch.rand(2, 3, size, size) * 2 - 1, "caption": captions}
    null = encode_captions(cfg.decoder, clip, [""])
    with torch.no_grad():
        decoder_loss(recording(tiny_pipe.decoder), batch, clip, null, gens, cfg, sched, "cpu")
        up = tiny_pipe.upsamplers[0]
        cfg = load_stage_config("configs/tiny/sr32.yaml", over)
        size = up.config.sample_size
        batch = {"image": torch.rand(2, 3, size, size) * 2 - 1, "caption": captions}
        upsampler_loss(recording(up), batch, gens, cfg, sched, "cpu")
        cfg = load_stage_config("configs/tiny/prior.yaml", over)
        batch = {"image_embed": torch.randn(2, clip.embed_dim), "caption": captions}
        prior_loss(
            recording(tiny_pipe.prior), batch, clip, clip.encode_text([""]), gens, cfg, sched, "cpu"
        )
    assert len(seen) == 3
    assert all(t.tolist() == [999, 999] for t in seen)


def test_saved_settings_leave_out_training_only_keys_at_their_defaults(tiny_pipe, tmp_path):
    """A pipeline's unclip.json holds no timestep_shift / vlb_weight at their defaults (so older
    versions, which refuse unknown keys, load it); a non-default value is kept and reloads."""
    import json

    from unclip import UnCLIPPipeline
    from unclip.diffusion.config import diffusion_to_save

    tiny_pipe.save_pretrained(tmp_path / "p")
    saved = json.loads((tmp_path / "p" / "unclip.json").read_text())["diffusion"]
    assert saved and all("prediction_type" in d for d in saved.values())
    assert not any({"timestep_shift", "vlb_weight"} & set(d) for d in saved.values())
    kept = diffusion_to_save(DiffusionConfig(timestep_shift=3.0, min_snr_gamma=5.0))
    assert kept["timestep_shift"] == 3.0 and "vlb_weight" not in kept
    assert kept["min_snr_gamma"] == 5.0  # only the listed newer keys are dropped
    pipe = UnCLIPPipeline(
        tiny_pipe.clip,
        tiny_pipe.prior,
        tiny_pipe.decoder,
        tiny_pipe.upsamplers,
        diffusion={"decoder": {**saved["decoder"], "timestep_shift": 2.0}},
    )
    pipe.save_pretrained(tmp_path / "q")
    again = UnCLIPPipeline.from_pretrained(tmp_path / "q")
    assert again.diffusion["decoder"].timestep_shift == 2.0
