"""What a dry run of ``unclip plan`` builds: the stage's network and training task (by the training
commands' own functions), a micro-batch of the right shapes, and what a real step would trim that
the dry run cannot see."""

from __future__ import annotations

from typing import Any

import torch


def _synthetic_batch(cfg, clip, b: int) -> dict:
    """A micro-batch of the stage's data with the right shapes (values do not matter)."""
    batch: dict[str, Any] = {
        "caption": ["a red circle above a blue square on a white background"] * b
    }
    if _is_token_family(cfg):
        size = cfg.data.resolution
        batch["image"] = torch.rand(b, 3, size, size) * 2 - 1
    elif _is_kandinsky(cfg):  # the loop's batches: images and their views at the towers' size
        size, view = cfg.data.resolution, clip.image_size
        batch["image"] = torch.rand(b, 3, size, size) * 2 - 1
        batch["clip_image"] = torch.rand(b, 3, view, view) * 2 - 1
    elif cfg.stage == "prior" and cfg.data.source == "embeddings":
        batch["image_embed"] = torch.randn(b, clip.embed_dim)
    else:
        size = clip.image_size if cfg.stage == "prior" else cfg.data.resolution
        if cfg.stage == "decoder" and cfg.data.clip_view == "full":
            batch["clip_image"] = torch.rand(b, 3, clip.image_size, clip.image_size) * 2 - 1
        if cfg.stage == "upsampler" and cfg.upsampler_train.crop_size:
            # already the crop: a random crop's offsets are values, which fake tensors do not have
            size = cfg.upsampler_train.crop_size
        batch["image"] = torch.rand(b, 3, size, size) * 2 - 1
    return batch


def _trimmed_text_positions(cfg, clip) -> int:
    """The caption context a real step of ``cfg`` runs only up to a batch's longest caption: a
    diffusion prior's text positions (its own caption transformer's or the CLIP's), a decoder's
    own caption transformer's; 0 for the rest."""
    stage = getattr(cfg, "stage", "")
    section = getattr(cfg, stage, None) if stage in ("prior", "decoder") else None
    if section is None or getattr(section, "type", "diffusion") != "diffusion":
        return 0
    if getattr(section, "text_encoder", "clip") == "transformer":
        return int(section.text_context_length)
    return int(clip.context_length) if stage == "prior" and clip is not None else 0


def _is_token_family(cfg) -> bool:
    """A DALL-E / DALL-E Mega run (:mod:`unclip.train.token_config`) rather than a stage's."""
    return not hasattr(cfg, "stage")


def _is_kandinsky(cfg) -> bool:
    """A Kandinsky 2.2 fine-tuning run (:mod:`unclip.train.kandinsky`)."""
    return hasattr(cfg, "kandinsky")


class _TokensOfShape(torch.nn.Module):
    """The frozen tokenizer of a token-model plan: tokens of the right shape (zeros). A trained
    tokenizer folder need not exist to plan the transformer; the tokenizer's own weights (frozen,
    forward only) are not counted."""

    def __init__(self, grid: int):
        super().__init__()
        self.grid = grid

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        return torch.zeros(b, self.grid, self.grid, dtype=torch.long, device=images.device)


def _build_token_family(cfg, device, loop):
    """The network and task of a tokenizer or token-model run, built by its training code."""
    from unclip.train.tokens import TokenizerTask, TokenModelTask

    with torch.device(device):
        if hasattr(cfg, "transformer"):
            model = cfg.transformer.build()
            model.gradient_checkpointing = cfg.train.gradient_checkpointing
            tokens = _TokensOfShape(cfg.transformer.model.grid)
            return model, TokenModelTask(cfg, tokens, loop)
        return cfg.tokenizer.build(), TokenizerTask(cfg, loop)


def _build(cfg, clip, device, mixed_precision: str):
    """The stage's network and training task, built by the training commands' own functions, for
    a run in ``mixed_precision`` (the loop's)."""
    with torch.device(device):
        if cfg.stage == "prior":
            from unclip.train.prior import PriorTask, build_prior_model

            model = build_prior_model(cfg, clip)
            if cfg.prior.type == "ar":
                from unclip.train.ar_prior import ARPriorTask

                # only shapes matter here: the unfitted (all-zero) edges give every sample code 0
                model.fitted.fill_(1.0)
                return model, ARPriorTask(cfg, clip, device)
            d = clip.embed_dim
            model.set_embedding_stats(torch.zeros(d), torch.ones(d))
            return model, PriorTask(cfg, clip, device, mixed_precision)
        from unclip.train.decoder import (
            DecoderTask,
            UpsamplerTask,
            build_image_model,
            frozen_latent_space,
        )

        net = build_image_model(cfg, clip)
        if cfg.stage == "decoder":
            space = frozen_latent_space(net)
            return net, DecoderTask(cfg, clip, device, mixed_precision, space)
        return net, UpsamplerTask(cfg, clip, device)
