"""The frozen autoencoder of a latent decoder: images ↔ latents.

A latent decoder (:class:`~unclip.nets.decoder.UnCLIPDecoder` with an ``autoencoder``) runs its
diffusion on the latents of a frozen autoencoder instead of on pixels, as Kandinsky 2.2 (MoVQ) and
Stable Diffusion do; its UNet then works on a grid ``factor`` times smaller per side, which is what
makes a large decoder affordable. :class:`LatentSpace` holds the autoencoder and the two maps::

    space = LatentSpace(dict(vqmodel.config), l2_codes=True)
    space.model.load_state_dict(vqmodel.state_dict())
    z = space.encode(images)          # [B, 3, H, W] in [-1, 1] → [B, C, H/f, W/f], unit scale
    images = space.decode(z)          # → [B, 3, H, W] (not clamped)

Two kinds of autoencoder, both diffusers' own classes:

- ``VQModel`` (a VQGAN; e.g. one trained with ``unclip train-tokenizer``, or MoVQ with
  ``norm_type="spatial"``). The latents are the encoder's pre-quantisation output (normalised
  per position when the codes are looked up by cosine, ``l2_codes``); decoding snaps each
  position to its nearest code first, because the VQ decoder was only ever trained on codes
  (Kandinsky 2.2's own pipelines decode MoVQ latents without snapping; its decoder is
  :class:`~unclip.nets.latent_decoder.LatentDecoder`, which does as they do).
- ``AutoencoderKL`` (Stable Diffusion's VAE). The latents are the posterior's mean (a
  deterministic encoding, so a training batch's target does not depend on a random draw), minus
  its ``shift_factor`` when it has one; one that sets ``force_upcast`` runs in float32 in a half
  precision pipeline.

``scale`` multiplies the latents so the diffusion sees roughly unit variance, as Stable
Diffusion's ``scaling_factor`` does: by default the KL model's own ``scaling_factor``, ``sqrt(C)``
for cosine codes (unit vectors of C components), else 1 (Kandinsky's MoVQ latents are used
unscaled).

:func:`load_autoencoder` reads a ``train-tokenizer`` VQGAN folder or a diffusers ``VQModel`` /
``AutoencoderKL`` folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Union, cast

import torch
import torch.nn.functional as F
from diffusers.models import AutoencoderKL, VQModel
from torch import nn

__all__ = [
    "AUTOENCODERS",
    "LatentSpace",
    "autoencoder_config",
    "latent_geometry",
    "load_autoencoder",
]

#: images decoded at once by :meth:`LatentSpace.decode`
DECODE_ROWS = 8
#: the autoencoder classes a latent decoder takes, by diffusers' ``_class_name``
AUTOENCODERS = {"VQModel": VQModel, "AutoencoderKL": AutoencoderKL}


def latent_geometry(model: Union[VQModel, AutoencoderKL]) -> tuple[int, int]:
    """``(C, f)``: the latent channels of a diffusers autoencoder and the pixels per latent side
    (each level but the last halves the image)."""
    c = model.config
    return int(c["latent_channels"]), 2 ** (len(c["block_out_channels"]) - 1)


def autoencoder_config(model: Union[VQModel, AutoencoderKL]) -> dict:
    """``model``'s diffusers config with its ``_class_name``, as :class:`LatentSpace` takes it:
    the architecture only (diffusers' private entries, such as the path it was loaded from, are
    not JSON a nested config could hold)."""
    arch = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return {**arch, "_class_name": type(model).__name__}


class LatentSpace(nn.Module):
    """A frozen ``VQModel`` or ``AutoencoderKL`` (``config``: its diffusers config, with
    ``_class_name``) with :meth:`encode` and :meth:`decode` (see the module doc). It stays in
    eval mode and never requires gradients: the decoder trains on its latents, not through it."""

    def __init__(self, config: dict, l2_codes: bool = False, scale: Optional[float] = None):
        super().__init__()
        kind = config.get("_class_name")
        if kind not in AUTOENCODERS:
            raise ValueError(
                f"autoencoder: _class_name {kind!r} is not one of {', '.join(AUTOENCODERS)}; a "
                "latent decoder takes a diffusers VQModel or AutoencoderKL"
            )
        if l2_codes and kind != "VQModel":
            raise ValueError("autoencoder: l2_codes (cosine code lookup) is for a VQModel only")
        self.kind = kind
        self.l2_codes = bool(l2_codes)
        self.model = AUTOENCODERS[kind].from_config(config)
        self.scale = float(self.default_scale() if scale is None else scale)
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"latent_scale must be a positive number, got {scale!r}")
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> LatentSpace:
        # frozen: a decoder's train() must not switch the autoencoder's layers to training
        return super().train(False)

    @property
    def channels(self) -> int:
        return latent_geometry(self.model)[0]

    @property
    def factor(self) -> int:
        """Pixels per latent side."""
        return latent_geometry(self.model)[1]

    @property
    def shift(self) -> float:
        """Subtracted before scaling (a KL model's ``shift_factor``, as SD3's VAE has; else 0)."""
        return (
            float(self.model.config.get("shift_factor") or 0.0)
            if self.kind == "AutoencoderKL"
            else 0.0
        )

    def _compute_model(self):
        # a VAE that asks for float32 (force_upcast: SDXL's overflows in float16) runs in it
        half = self.model.dtype in (torch.float16, torch.bfloat16)
        if half and self.model.config.get("force_upcast", False):
            self.model.float()
        return self.model

    def default_scale(self) -> float:
        if self.kind == "AutoencoderKL":
            return float(self.model.config.get("scaling_factor", 1.0))
        return math.sqrt(self.channels) if self.l2_codes else 1.0

    def _codebook(self) -> torch.Tensor:
        weight = self.model.quantize.embedding.weight
        return F.normalize(weight, dim=1) if self.l2_codes else weight

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[-1, 1]`` → scaled latents ``[B, C, H/f, W/f]``."""
        model = self._compute_model()
        x = images.to(model.device, model.dtype)
        if self.kind == "AutoencoderKL":
            z = model.encode(x).latent_dist.mean
        else:
            z = model.encode(x).latents
            if self.l2_codes:
                z = F.normalize(z, dim=1)
        return (z - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents ``[B, C, h, w]`` → images ``[B, 3, f·h, f·w]`` (float32, not
        clamped), :data:`DECODE_ROWS` rows at a time (a decoder candidate batch can be large,
        and the decoder's full-resolution activations are per row)."""
        parts = [self._decode(c) for c in latents.split(DECODE_ROWS)]
        return torch.cat(parts)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        model = self._compute_model()
        z = latents.to(model.device, model.dtype) / self.scale + self.shift
        if self.kind == "AutoencoderKL":
            return model.decode(z).sample.float()
        if self.l2_codes:
            z = F.normalize(z, dim=1)
        b, c, h, w = z.shape
        codebook = self._codebook()
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        # nearest codes a block of positions at a time: the distance matrix of all of them
        # (positions × codes) would be the largest tensor of the decode
        codes = torch.cat([torch.cdist(q, codebook).argmin(1) for q in flat.split(4096)])
        z_q = codebook[codes].view(b, h, w, c).permute(0, 3, 1, 2)
        # the code vectors themselves, not VQModel.decode: with lookup_from_codebook (a
        # train-tokenizer VQGAN) that reads its input as code indices
        spatial = model.config.get("norm_type") == "spatial"  # MoVQ's decoder reads z_q too
        out = model.decoder(model.post_quant_conv(z_q), z_q if spatial else None)
        return out.float()


def load_autoencoder(
    path: Union[str, Path], weights: bool = True
) -> tuple[Union[VQModel, AutoencoderKL], bool]:
    """``(model, l2_codes)`` from ``path``: a ``train-tokenizer`` VQGAN folder (its
    ``VQModel`` and whether it looks codes up by cosine) or a diffusers ``VQModel`` /
    ``AutoencoderKL`` folder (safetensors weights only). Anything else is a ``ValueError``
    naming what the folder holds. ``weights=False``: the network its config describes, with
    fresh weights (a dry run on fake tensors, which cannot hold the file's)."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"decoder.autoencoder: {folder} has no config.json; give a train-tokenizer VQGAN "
            "folder (final/tokenizer) or a diffusers VQModel / AutoencoderKL folder"
        )
    try:
        meta = json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"decoder.autoencoder: {config} is not valid JSON ({exc})") from None
    if meta.get("component") == "tokenizer":
        from unclip.nets.token_components import load_tokenizer, read_component_config

        cfg = read_component_config(folder, "tokenizer")
        if cfg.type != "vqgan":
            raise ValueError(
                f"decoder.autoencoder: {folder} holds a {cfg.type} tokenizer; a latent decoder "
                "needs continuous latents: train a vqgan tokenizer (or give an AutoencoderKL)"
            )
        tokenizer = load_tokenizer(folder)[0] if weights else cfg.build()
        return cast(VQModel, tokenizer.model), bool(tokenizer.l2_codes)
    kind = meta.get("_class_name")
    if kind not in AUTOENCODERS:
        raise ValueError(
            f"decoder.autoencoder: {config} describes a {kind!r}, not one of "
            f"{', '.join(AUTOENCODERS)} (or a train-tokenizer VQGAN folder)"
        )
    if not weights:
        return AUTOENCODERS[kind].from_config(meta), False
    from unclip.io.weights import safe_model_from_pretrained

    model = safe_model_from_pretrained(
        AUTOENCODERS[kind].from_pretrained, folder, "decoder.autoencoder"
    )
    return model.eval(), False
