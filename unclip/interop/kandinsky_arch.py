"""Kandinsky 2.2's networks as configs, without weights: what a dry run of a fine-tuning step
(``unclip plan``) builds on fake tensors.

:func:`kandinsky_architecture` gives a prior's or a decoder's component configs, read from a
local folder's ``config.json`` files (no weights are opened) or, for the published Hub ids, from
:data:`ARCHITECTURES`, so planning a run on ``kandinsky-community/kandinsky-2-2-decoder`` needs no
download. The table holds the published models' configurations (diffusers' class arguments and
transformers' CLIP configs); built, they have the parameter counts the model card gives: a
1.25B-parameter UNet (the card: 1.22B), a 67.8M MoVQ (67M), a 1.03B prior (1B) and a 1.84B
ViT-bigG/14 image tower (1.8B), beside a 695M text tower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unclip.io.weights import read_json

__all__ = ["ARCHITECTURES", "kandinsky_architecture", "PRIOR_ID", "DECODER_ID"]

PRIOR_ID = "kandinsky-community/kandinsky-2-2-prior"
DECODER_ID = "kandinsky-community/kandinsky-2-2-decoder"

_TEXT = {  # CLIP ViT-bigG/14's text tower (transformers CLIPTextModelWithProjection)
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "projection_dim": 1280,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "hidden_act": "gelu",
}
_VISION = {  # its image tower (CLIPVisionModelWithProjection)
    "hidden_size": 1664,
    "intermediate_size": 8192,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 224,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
_PRIOR = {  # diffusers PriorTransformer: 20 layers of width 2048 over 1,280-wide embeddings
    "num_attention_heads": 32,
    "attention_head_dim": 64,
    "num_layers": 20,
    "embedding_dim": 1280,
    "num_embeddings": 77,
    "additional_embeddings": 4,
}
_PRIOR_SCHEDULER = {
    "_class_name": "UnCLIPScheduler",
    "num_train_timesteps": 1000,
    "variance_type": "fixed_small_log",
    "clip_sample": True,
    "clip_sample_range": 10.0,
    "prediction_type": "sample",
}


def _unet(in_channels: int) -> dict:
    return {
        "sample_size": 64,
        "in_channels": in_channels,
        "out_channels": 8,
        "layers_per_block": 3,
        "block_out_channels": [384, 768, 1152, 1536],
        "down_block_types": ["ResnetDownsampleBlock2D"] + ["SimpleCrossAttnDownBlock2D"] * 3,
        "up_block_types": ["SimpleCrossAttnUpBlock2D"] * 3 + ["ResnetUpsampleBlock2D"],
        "mid_block_type": "UNetMidBlock2DSimpleCrossAttn",
        "attention_head_dim": 64,
        "cross_attention_dim": 768,
        "encoder_hid_dim": 1280,
        "encoder_hid_dim_type": "image_proj",
        "addition_embed_type": "image",
        "addition_embed_type_num_heads": 64,
        "resnet_time_scale_shift": "scale_shift",
        "norm_num_groups": 32,
    }


_MOVQ = {  # diffusers VQModel with MoVQ's spatial norm, 8x downsampling, 4 latent channels
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": [128, 256, 256, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 3 + ["AttnDownEncoderBlock2D"],
    "up_block_types": ["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "norm_type": "spatial",
    "num_vq_embeddings": 16384,
    "vq_embed_dim": 4,
    "sample_size": 32,
}
# the decoder's training noise schedule (diffusers' Kandinsky 2.2 fine-tuning scripts train with a
# DDPM of this schedule); the UNet's second half of outputs (variance) is not trained
_DECODER_SCHEDULER = {
    "_class_name": "DDPMScheduler",
    "num_train_timesteps": 1000,
    "beta_schedule": "linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "clip_sample": False,
    "prediction_type": "epsilon",
}

#: the published Kandinsky 2.2 repositories: {"kind", component: config}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    PRIOR_ID: {
        "kind": "prior",
        "prior": _PRIOR,
        "text_encoder": _TEXT,
        "image_encoder": _VISION,
        "scheduler": _PRIOR_SCHEDULER,
    },
    DECODER_ID: {
        "kind": "decoder",
        "unet": _unet(4),
        "movq": _MOVQ,
        "scheduler": _DECODER_SCHEDULER,
        "prior": PRIOR_ID,
    },
    DECODER_ID + "-inpaint": {
        "kind": "decoder",
        "unet": _unet(9),
        "movq": _MOVQ,
        "scheduler": _DECODER_SCHEDULER,
        "prior": PRIOR_ID,
    },
}

_COMPONENTS = {
    "prior": ("prior", "text_encoder", "image_encoder"),
    "decoder": ("unet", "movq"),
}


def kandinsky_architecture(source: str) -> dict[str, Any]:
    """``{"kind": "prior" | "decoder", component: config dict, "scheduler": config,
    "prior": the prior a decoder's model card names (or None)}`` of a Kandinsky 2.2 folder (its
    configs only) or of a published Hub id (:data:`ARCHITECTURES`). Another Hub id is a
    ``ValueError`` saying what to do: its configs would have to be downloaded."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        from unclip.interop.kandinsky import card_prior, kandinsky_kind

        kind = kandinsky_kind(folder)
        if kind is None:
            raise ValueError(
                f"{source} is not a Kandinsky 2.2 folder (its model_index.json names no "
                "Kandinsky 2.2 pipeline)"
            )
        out: dict[str, Any] = {"kind": kind}
        for comp in _COMPONENTS[kind]:
            out[comp] = read_json(folder / comp / "config.json", comp)
        out["scheduler"] = read_json(folder / "scheduler" / "scheduler_config.json", "scheduler")
        if kind == "decoder":
            out["prior"] = card_prior(folder)
        return out
    if str(source) in ARCHITECTURES:
        return ARCHITECTURES[str(source)]
    raise ValueError(
        f"unclip plan builds a Kandinsky run's networks from their configs: {source!r} is neither "
        f"a local folder nor one of the published ids it knows ({', '.join(ARCHITECTURES)}); "
        "download the folder's config files (the weights are not needed) and plan with its path"
    )
