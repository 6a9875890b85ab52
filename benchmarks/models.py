"""Random model configurations for the benchmarks (tiny / small / mid), all built offline.

``mid_pipeline()`` is the sampling benchmark's side-by-side model: shaped so diffusers' (deprecated)
``UnCLIPPipeline`` can load it through :func:`unclip.interop.diffusers.export_diffusers` — text
width equals the CLIP embedding size, raw (un-normalised) CLIP embeddings, a learned-variance
decoder, exactly one upsampler without noise-level conditioning — and sampled with the ``unclip``
sampler at diffusers' default steps and guidance (prior 25 steps × guidance 4, decoder 25 × 8,
super-res 7 × 1).
"""

from __future__ import annotations

import torch

from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.pipeline.tiny import tiny_decoder_kwargs, tiny_prior_kwargs, tiny_upsampler_kwargs

# the three-level decoder UNet: attention below the full resolution
DOWN_3 = ("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D", "SimpleCrossAttnDownBlock2D")
UP_3 = ("SimpleCrossAttnUpBlock2D", "SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D")

# name → (clip kwargs, prior kwargs, decoder kwargs, upsampler kwargs)
SIZES = {
    # unclip.pipeline.tiny's sizes (the test suite's models)
    "tiny": dict(
        clip=dict(embed_dim=32, width=32, layers=2, context_length=32),
        prior=tiny_prior_kwargs(),
        decoder=tiny_decoder_kwargs(16),
        upsampler=tiny_upsampler_kwargs(16, 32),
    ),
    # the bundled shapes model's sizes (configs/shapes/*.yaml)
    "small": dict(
        clip=dict(embed_dim=64, width=64, layers=3, context_length=24),
        prior=dict(num_layers=4, num_attention_heads=4, attention_head_dim=32),
        decoder=dict(
            sample_size=32,
            block_out_channels=(32, 64, 128),
            layers_per_block=2,
            down_block_types=DOWN_3,
            up_block_types=UP_3,
            attention_head_dim=32,
            norm_num_groups=16,
        ),
        upsampler=dict(
            low_res_size=32,
            sample_size=64,
            block_out_channels=(32, 64, 128),
            layers_per_block=1,
            down_block_types=("DownBlock2D",) * 3,
            up_block_types=("UpBlock2D",) * 3,
            norm_num_groups=16,
        ),
    ),
    "mid": dict(
        clip=dict(embed_dim=256, width=256, layers=4, context_length=77),
        prior=dict(num_layers=6, num_attention_heads=4, attention_head_dim=64),
        decoder=dict(
            sample_size=64,
            block_out_channels=(64, 128, 256),
            layers_per_block=1,
            down_block_types=DOWN_3,
            up_block_types=UP_3,
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            attention_head_dim=64,
            norm_num_groups=32,
        ),
        upsampler=dict(
            low_res_size=64,
            sample_size=128,
            block_out_channels=(32, 64, 128),
            layers_per_block=1,
            down_block_types=("ResnetDownsampleBlock2D",) * 3,
            up_block_types=("ResnetUpsampleBlock2D",) * 3,
            norm_num_groups=32,
        ),
    ),
}

# diffusers' UnCLIPPipeline defaults (steps, guidance), on unclip's "unclip" sampler
DIFFUSERS_SAMPLING = {
    "prior": {"scheduler": "unclip", "steps": 25, "guidance_scale": 4.0, "best_of": 1},
    "decoder": {"scheduler": "unclip", "steps": 25, "guidance_scale": 8.0},
    "upsampler": {"scheduler": "unclip", "steps": 7, "guidance_scale": 1.0},
}


def clip_model(size: str) -> CLIP:
    c = SIZES[size]["clip"]
    heads = max(1, c["width"] // 64)
    cfg = tiny_clip_config(**c)
    cfg["text_cfg"]["heads"] = heads
    return CLIP.from_config(ClipConfig(f"bench-{size}", model_cfg=cfg))


def _perturb(*modules, seed: int = 0) -> None:
    """diffusers zero-initialises output convolutions; random offsets make every layer matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                if p.ndim > 1 and p.abs().sum() == 0:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def stage_models(size: str, *, exportable: bool = False, seed: int = 0):
    """``(clip, prior, decoder, upsampler)`` at ``size``, randomly initialised from ``seed``."""
    torch.manual_seed(seed)
    s = SIZES[size]
    clip = clip_model(size)
    prior = UnCLIPPrior.from_clip(clip, **s["prior"])
    decoder = UnCLIPDecoder.from_clip(clip, **s["decoder"], learned_variance=exportable)
    up_kwargs = dict(s["upsampler"])
    if exportable:  # Karlo's super-res: no noise-level input, no mid-block attention, no clamping
        up_kwargs.update(noise_level_conditioning=False, add_attention=False, clamp_low_res=False)
    upsampler = UnCLIPUpsampler(**up_kwargs)
    _perturb(prior, decoder, upsampler, seed=seed)
    if exportable:
        clip.normalize_embeds = False
        with torch.no_grad():  # non-trivial embedding statistics, as a trained prior has
            g = torch.Generator().manual_seed(seed + 1)
            d = clip.embed_dim
            prior.transformer.clip_mean.copy_(torch.randn(1, d, generator=g) * 0.1)
            prior.transformer.clip_std.copy_(torch.rand(1, d, generator=g) + 0.5)
    return clip, prior, decoder, upsampler


def mid_pipeline(seed: int = 0) -> UnCLIPPipeline:
    """The exportable mid-size pipeline (see module doc)."""
    clip, prior, decoder, up = stage_models("mid", exportable=True, seed=seed)
    sr = f"sr{up.config.sample_size}"
    sampling = {
        "prior": DIFFUSERS_SAMPLING["prior"],
        "decoder": DIFFUSERS_SAMPLING["decoder"],
        sr: DIFFUSERS_SAMPLING["upsampler"],
    }
    diffusion = {
        "prior": {"prediction_type": "sample"},
        "decoder": {"prediction_type": "epsilon"},
        sr: {"prediction_type": "epsilon"},
    }
    pipe = UnCLIPPipeline(
        clip, prior, decoder, [up], diffusion=diffusion, sampling=sampling, prior_clip_range=5.0
    )
    for m in pipe.modules().values():
        m.eval().requires_grad_(False)
    return pipe


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
