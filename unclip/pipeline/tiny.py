"""Tiny randomly initialised pipelines, built offline from configs (tests, demos, benchmarks).

``tiny_pipeline()`` gives a complete cascade (CLIP → prior → 16px decoder → 32px → 64px) with a few
hundred thousand parameters per stage; its images are noise-like because nothing is trained.
"""

from __future__ import annotations

import torch

from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline

__all__ = [
    "tiny_pipeline",
    "tiny_decoder_kwargs",
    "tiny_upsampler_kwargs",
    "tiny_prior_kwargs",
    "tiny_latent_kwargs",
]


def tiny_prior_kwargs() -> dict:
    return dict(num_layers=2, num_attention_heads=2, attention_head_dim=16)


def tiny_decoder_kwargs(sample_size: int = 16) -> dict:
    return dict(
        sample_size=sample_size,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        attention_head_dim=8,
        norm_num_groups=8,
        cross_attention_dim=32,
    )


def tiny_upsampler_kwargs(low_res_size: int, sample_size: int) -> dict:
    return dict(
        sample_size=sample_size,
        low_res_size=low_res_size,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )


def tiny_latent_kwargs(kind: str = "VQModel", l2_codes: bool = True) -> dict:
    """Decoder arguments that make a tiny latent decoder: a random tiny ``VQModel`` (cosine codes
    with ``l2_codes``) or ``AutoencoderKL`` with 4 latent channels, 4 pixels per latent."""
    blocks = dict(
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    if kind == "VQModel":
        config = dict(
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            num_vq_embeddings=32,
            **blocks,
        )
        return dict(autoencoder={"_class_name": kind, **config}, autoencoder_l2_codes=l2_codes)
    config = dict(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        **blocks,
    )
    return dict(autoencoder={"_class_name": kind, **config})


#: a tiny caption transformer for a tiny decoder or prior (``text_encoder: transformer``)
TINY_TEXT_ENCODER = dict(
    text_encoder="transformer",
    text_encoder_width=32,
    text_encoder_layers=2,
    text_encoder_heads=2,
    text_context_length=16,
)


def tiny_pipeline(
    seed: int = 0,
    sizes: tuple = (16, 32, 64),
    clip_kwargs: dict | None = None,
    decoder_kwargs: dict | None = None,
    prior_kwargs: dict | None = None,
) -> UnCLIPPipeline:
    """A random tiny pipeline: decoder at ``sizes[0]`` then one upsampler per further size;
    ``prior_kwargs``/``decoder_kwargs`` override the tiny prior's and decoder's arguments (e.g.
    :data:`TINY_TEXT_ENCODER`)."""
    torch.manual_seed(seed)
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config(**(clip_kwargs or {}))))
    prior = UnCLIPPrior.from_clip(clip, **{**tiny_prior_kwargs(), **(prior_kwargs or {})})
    decoder = UnCLIPDecoder.from_clip(
        clip, **{**tiny_decoder_kwargs(sizes[0]), **(decoder_kwargs or {})}
    )
    ups = [
        UnCLIPUpsampler(**tiny_upsampler_kwargs(lo, hi)) for lo, hi in zip(sizes[:-1], sizes[1:])
    ]
    for m in [
        prior,
        decoder,
        *ups,
    ]:  # diffusers zero-inits some output layers; perturb so outputs vary
        with torch.no_grad():
            for p in m.parameters():
                if p.abs().sum() == 0 and p.ndim > 1:
                    p.normal_(0, 0.02)
    sampling = {
        "prior": {"scheduler": "ddim", "steps": 4, "guidance_scale": 2.0, "best_of": 2},
        "decoder": {"scheduler": "ddim", "steps": 4, "guidance_scale": 2.0},
    }
    sampling.update(
        {f"sr{hi}": {"scheduler": "ddim", "steps": 3, "guidance_scale": 1.0} for hi in sizes[1:]}
    )
    return UnCLIPPipeline(clip, prior, decoder, ups, sampling=sampling)
