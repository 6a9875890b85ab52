"""A latent decoder: a UNet over autoencoder latents conditioned on the CLIP image embedding, and
the frozen autoencoder that maps images to latents and back (Kandinsky 2.2's decoder and MoVQ).

    decoder = LatentDecoder(unet, movq)
    eps = decoder(x_t, t, image_embed)          # x_t [B, C, h, w], image_embed [B, D]
    images = decoder.decode(x_0)                # [B, 3, H, W] in [-1, 1] (roughly; not clamped)

The UNet is diffusers' ``UNet2DConditionModel`` with ``addition_embed_type="image"`` and
``encoder_hid_dim_type="image_proj"``: the image embedding is added to the time embedding and
projected to the cross-attention tokens, so no text reaches the decoder. An inpainting UNet reads
``[x_t; masked image latents; mask]`` (``2C + 1`` channels); a learned-variance UNet outputs
``2C`` channels (mean, variance), of which only the scheduler reads the second half. The
autoencoder is diffusers' ``VQModel`` (MoVQ): latents are its pre-quantisation encoder output,
decoded without quantising, as diffusers' Kandinsky 2.2 pipelines do.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models import UNet2DConditionModel, VQModel

from unclip.nets.autoencoder import latent_geometry

__all__ = ["LatentDecoder", "latent_size"]


def latent_size(height: int, width: int, scale_factor: int) -> tuple[int, int]:
    """The latent ``(h, w)`` for an image of ``height × width`` pixels, as diffusers' Kandinsky 2.2
    pipelines compute it: each side rounded up to a multiple of ``scale_factor²`` pixels, then
    divided by ``scale_factor`` (so the UNet's own downsampling divides it evenly)."""

    def side(n: int) -> int:
        return -(-n // scale_factor**2) * scale_factor

    return side(height), side(width)


class LatentDecoder(torch.nn.Module):
    """``unet`` (denoiser over latents) and ``movq`` (the frozen autoencoder) as one decoder.

    ``latent_channels`` C, ``scale_factor`` (pixels per latent side), ``inpaint`` (the UNet reads
    ``2C + 1`` channels) and ``learned_variance`` (it outputs ``2C``) come from their configs."""

    def __init__(self, unet: UNet2DConditionModel, movq: VQModel):
        super().__init__()
        self.unet = unet
        self.movq = movq
        c = self.latent_channels
        c_in, c_out = unet.config["in_channels"], unet.config["out_channels"]
        if c_in not in (c, 2 * c + 1):
            raise ValueError(
                f"unet: in_channels {c_in} fits neither the autoencoder's "
                f"{c} latent channels nor inpainting's {2 * c + 1}; pair it with its own movq"
            )
        if c_out not in (c, 2 * c):
            raise ValueError(
                f"unet: out_channels {c_out} must be {c} (epsilon) or {2 * c} "
                "(epsilon and variance) for the autoencoder's latents"
            )

    @property
    def latent_channels(self) -> int:
        return latent_geometry(self.movq)[0]

    @property
    def scale_factor(self) -> int:
        return latent_geometry(self.movq)[1]

    @property
    def inpaint(self) -> bool:
        return int(self.unet.config["in_channels"]) == 2 * self.latent_channels + 1

    @property
    def learned_variance(self) -> bool:
        return int(self.unet.config["out_channels"]) == 2 * self.latent_channels

    @property
    def embed_dim(self) -> int:
        """The width of the image embedding the UNet is conditioned on."""
        return int(self.unet.config["encoder_hid_dim"])

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """Latent ``(h, w)`` of a ``height × width`` image (:func:`latent_size`)."""
        return latent_size(height, width, self.scale_factor)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        image_embed: torch.Tensor,
        mask_inputs: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The UNet's output ``[B, C or 2C, h, w]`` at ``x_t [B, C, h, w]``, timestep ``t``,
        conditioned on ``image_embed [B, D]``; an inpainting UNet also reads ``mask_inputs
        [B, C + 1, h, w]`` (the masked image's latents, then the mask: 1 where the image is
        kept)."""
        if self.inpaint:
            if mask_inputs is None:
                raise ValueError(
                    "this is an inpainting decoder: it needs an image and a mask (use inpaint)"
                )
            x_t = torch.cat([x_t, mask_inputs.to(x_t.dtype)], dim=1)
        elif mask_inputs is not None:
            raise ValueError("mask_inputs given to a decoder that does not inpaint")
        return self.unet(
            sample=x_t,
            timestep=t,
            encoder_hidden_states=None,
            added_cond_kwargs={"image_embeds": image_embed.to(x_t.dtype)},
            return_dict=False,
        )[0]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``images [B, 3, H, W]`` in [-1, 1] → latents ``[B, C, H/f, W/f]`` (the encoder's
        output before quantisation, as diffusers' Kandinsky 2.2 image-to-image uses it)."""
        param = next(self.movq.parameters())
        return self.movq.encode(images.to(param.device, param.dtype)).latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` → images ``[B, 3, h·f, w·f]``, nominally in [-1, 1] (not
        clamped), decoded without quantising (diffusers' ``force_not_quantize=True``)."""
        param = next(self.movq.parameters())
        return self.movq.decode(latents.to(param.device, param.dtype), force_not_quantize=True)[0]
