"""Tiny random Kandinsky 2.2 folders, built offline from diffusers' own classes
(``KandinskyV22PriorPipeline(...).save_pretrained`` and its decoder pipelines), for the tests of
reading, sampling and fine-tuning them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from diffusers import (
    DDPMScheduler,
    KandinskyV22Pipeline,
    KandinskyV22PriorPipeline,
    PriorTransformer,
    UnCLIPScheduler,
    UNet2DConditionModel,
    VQModel,
)
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from unclip.interop.clip import bpe_vocab

L, W, D = 16, 32, 32  # context length, text width, CLIP embedding size


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random offsets on every parameter, so zero-initialised or swapped weights show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.eval()


def _tokenizer() -> CLIPTokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = bpe_vocab()
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text(
            "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
        )
        return CLIPTokenizer.from_pretrained(tmp, pad_token="!", model_max_length=L)


def build_prior(root: Path) -> KandinskyV22PriorPipeline:
    """A Kandinsky-2.2-shaped prior folder (gelu CLIP towers, as ViT-bigG's) with tiny random
    weights, saved to ``root``."""
    torch.manual_seed(0)
    text = CLIPTextModelWithProjection(
        CLIPTextConfig(
            hidden_size=W,
            intermediate_size=64,
            projection_dim=D,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=L,
            hidden_act="gelu",
            pad_token_id=0,
        )
    )
    vision = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=W,
            intermediate_size=64,
            projection_dim=D,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            hidden_act="gelu",
        )
    )
    prior = _perturb(
        PriorTransformer(
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            embedding_dim=D,
            num_embeddings=L,
            additional_embeddings=4,
        ),
        3,
    )
    with torch.no_grad():
        prior.clip_std.copy_(torch.rand(1, D) + 0.5)
        prior.clip_mean.copy_(torch.randn(1, D) * 0.1)
    pipe = KandinskyV22PriorPipeline(
        prior=prior,
        image_encoder=_perturb(vision, 2),
        text_encoder=_perturb(text, 1),
        tokenizer=_tokenizer(),
        scheduler=UnCLIPScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            clip_sample=True,
            clip_sample_range=10.0,
        ),
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(str(root), safe_serialization=True)
    return pipe


def _unet(in_channels: int, seed: int) -> UNet2DConditionModel:
    return _perturb(
        UNet2DConditionModel(
            sample_size=16,
            in_channels=in_channels,
            out_channels=8,
            addition_embed_type="image",
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            block_out_channels=(16, 32),
            layers_per_block=1,
            norm_num_groups=8,
            encoder_hid_dim=D,
            encoder_hid_dim_type="image_proj",
            cross_attention_dim=24,
            attention_head_dim=4,
            resnet_time_scale_shift="scale_shift",
            class_embed_type=None,
        ),
        seed,
    )


def _movq(seed: int) -> VQModel:
    return _perturb(
        VQModel(
            # MoVQ's spatial norm has 32 groups whatever norm_num_groups says
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
            up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            norm_type="spatial",
            num_vq_embeddings=12,
            vq_embed_dim=4,
        ),
        seed,
    )


def _ddpm(clip_sample: bool = False) -> DDPMScheduler:
    """The decoder scheduler kandinsky-2-2-decoder ships (its steps draw noise from the
    generator); ``clip_sample`` bounds the predicted latents, which a random UNet otherwise drives
    to ~30 in three steps."""
    return DDPMScheduler(
        beta_schedule="linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=clip_sample,
        steps_offset=1,
        prediction_type="epsilon",
        variance_type="fixed_small",
    )


def build_decoder(
    root: Path, cls=KandinskyV22Pipeline, in_channels: int = 4, clip_sample: bool = False
):
    torch.manual_seed(0)
    pipe = cls(unet=_unet(in_channels, 4), scheduler=_ddpm(clip_sample), movq=_movq(5))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(str(root), safe_serialization=True)
    return pipe
