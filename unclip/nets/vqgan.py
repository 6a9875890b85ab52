"""The VQGAN image tokenizer of DALL-E Mega (Esser et al. 2021, "Taming Transformers for
High-Resolution Image Synthesis"), on diffusers' ``VQModel``: 256 × 256 images ↔ 16 × 16 tokens
(f16) over 16,384 codes at full scale.

:class:`VQGAN` wraps a ``VQModel`` (``.model``, which saves and loads as diffusers does) with
``encode(images) → tokens [B, h, w]`` and ``decode(tokens) → images``. :class:`VQGANLoss` is the
training objective (Esser et al. 2021, eq. 4–5, after van den Oord et al. 2017):

    L = |x − x̂|₁ + w_p · perceptual(x, x̂) + ‖sg[E(x)] − z_q‖² + β ‖E(x) − sg[z_q]‖²
        + w_adv · (−D(x̂))

The codebook and commitment terms are computed here from the encoder output and the chosen code
vectors, not taken from ``VectorQuantizer``'s own loss, which (in its default ``legacy`` mode)
puts ``β`` on the codebook term instead of the commitment term. The perceptual term
(:class:`PerceptualLoss`, LPIPS-like: Zhang et al. 2018) and the adversarial term (a PatchGAN
discriminator, :class:`PatchDiscriminator`, with the hinge loss) are switches: off, or built from
a local weights file. The adversarial weight is fixed (taming's adaptive weight, the ratio of
the gradient norms at the decoder's last layer, is not implemented).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.vq_model import VQModel
from torch import nn

from unclip.nets.token_common import (
    MAX_CODES,
    MAX_GRID,
    check_decoded,
    check_sizes,
    check_weights,
)

__all__ = [
    "VQGANConfig",
    "VQGAN",
    "VQGANLoss",
    "PerceptualLoss",
    "PatchDiscriminator",
    "discriminator_hinge_loss",
    "load_state_file",
    "check_state_file",
]


@dataclass
class VQGANConfig:
    """The VQGAN. Defaults: the f16, 16,384-code model DALL-E Mega used (taming's
    ``vqgan_imagenet_f16_16384``: widths 128·(1, 1, 2, 2, 4), two resblocks per level, attention
    at the 16 × 16 level, 256-dimensional latents and codes)."""

    image_size: int = 256
    block_out_channels: tuple[int, ...] = (128, 128, 256, 256, 512)
    layers_per_block: int = 2
    #: attention blocks at the lowest resolution (taming's ``attn_resolutions=[16]``)
    attention_at_lowest: bool = True
    latent_channels: int = 256
    num_codes: int = 16384
    norm_num_groups: int = 32
    #: β, the commitment weight
    commitment_weight: float = 0.25
    #: the perceptual term: a local weights file (see PerceptualLoss) or None (off)
    perceptual_weights: Optional[str] = None
    perceptual_weight: float = 1.0
    #: the adversarial term: a local weights file for the discriminator, "init" (a fresh one)
    #: or None (off)
    discriminator_weights: Optional[str] = None
    adversarial_weight: float = 0.1
    discriminator_layers: int = 3
    #: look codes up by cosine: encoder outputs and code vectors are L2-normalised before the
    #: nearest-code search and the decoder reads the normalised code (Yu et al. 2021,
    #: "Vector-quantized Image Modeling with Improved VQGAN"). Off in taming's VQGAN, which
    #: DALL-E Mega used; on, far more of a small codebook stays in use
    l2_codes: bool = False

    def __post_init__(self) -> None:
        widths = self.block_out_channels
        if not isinstance(widths, (list, tuple)) or not 1 <= len(widths) <= 8:
            raise ValueError(
                f"vqgan.block_out_channels must be a list of 1 … 8 widths (one per level), got "
                f"{widths!r}"
            )
        self.block_out_channels = tuple(widths)
        check_sizes(
            "vqgan",
            self,
            {
                "image_size": (8, 4096),
                "num_codes": (2, MAX_CODES),
                "layers_per_block": (1, 64),
                "latent_channels": (1, 8192),
                "norm_num_groups": (1, 1024),
                "discriminator_layers": (1, 8),
            },
        )
        for i, width in enumerate(widths):
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8192:
                raise ValueError(
                    f"vqgan.block_out_channels[{i}] must be an integer in 1 … 8,192, got {width!r}"
                )
            if width % self.norm_num_groups:  # GroupNorm splits each level's channels evenly
                raise ValueError(
                    f"vqgan.block_out_channels[{i}]={width} is not a multiple of "
                    f"norm_num_groups={self.norm_num_groups}"
                )
        check_weights(
            "vqgan", self, ("commitment_weight", "perceptual_weight", "adversarial_weight")
        )
        if self.image_size % self.downsampling:
            raise ValueError(
                f"vqgan: image_size must be a multiple of {self.downsampling} ({len(widths)} "
                f"levels), got {self.image_size}"
            )
        check_sizes("vqgan", self, {"grid": (1, MAX_GRID)})

    @property
    def downsampling(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def grid(self) -> int:
        return self.image_size // self.downsampling

    def build(self) -> VQGAN:
        """The tokenizer network (its loss: :meth:`build_loss`)."""
        self.__post_init__()  # fields set after the config was made are checked too
        n = len(self.block_out_channels)
        down = ["DownEncoderBlock2D"] * n
        up = ["UpDecoderBlock2D"] * n
        if self.attention_at_lowest:
            down[-1], up[0] = "AttnDownEncoderBlock2D", "AttnUpDecoderBlock2D"
        model = VQModel(
            in_channels=3,
            out_channels=3,
            down_block_types=tuple(down),
            up_block_types=tuple(up),
            block_out_channels=tuple(self.block_out_channels),
            layers_per_block=self.layers_per_block,
            latent_channels=self.latent_channels,
            sample_size=self.image_size,
            num_vq_embeddings=self.num_codes,
            norm_num_groups=self.norm_num_groups,
            vq_embed_dim=self.latent_channels,
            lookup_from_codebook=True,
        )
        return VQGAN(model, l2_codes=self.l2_codes)

    def build_loss(self) -> VQGANLoss:
        perceptual = None
        if self.perceptual_weights is not None:
            perceptual = PerceptualLoss.from_file(self.perceptual_weights)
        disc = None
        if self.discriminator_weights is not None:
            disc = PatchDiscriminator(num_layers=self.discriminator_layers)
            if self.discriminator_weights != "init":
                disc.load_state_dict(load_state_file(self.discriminator_weights))
        return VQGANLoss(
            self.commitment_weight,
            perceptual,
            self.perceptual_weight,
            disc,
            self.adversarial_weight,
        )


class VQGAN(nn.Module):
    """A ``VQModel`` as an image tokenizer. Images are ``[B, 3, H, W]`` in ``[-1, 1]``."""

    def __init__(self, model: VQModel, l2_codes: bool = False):
        super().__init__()
        self.model = model
        self.l2_codes = l2_codes

    def codebook(self) -> torch.Tensor:
        """The code vectors ``[K, C]`` as the decoder reads them (normalised with ``l2_codes``)."""
        weight = self.model.quantize.embedding.weight
        return F.normalize(weight, dim=1) if self.l2_codes else weight

    def quantize(self, images: torch.Tensor):
        """``(z_e, z_q, tokens)``: the encoder output ``[B, C, h, w]`` (normalised per position
        with ``l2_codes``), its nearest code vectors ``[B, C, h, w]`` (no straight-through), the
        codes ``[B, h, w]``."""
        z_e = self.model.encode(images).latents
        if self.l2_codes:
            z_e = F.normalize(z_e, dim=1)
        b, ch, h, w = z_e.shape
        flat = z_e.permute(0, 2, 3, 1).reshape(-1, ch)
        codebook = self.codebook()
        tokens = torch.cdist(flat, codebook).argmin(1)
        z_q = codebook[tokens].view(b, h, w, ch).permute(0, 3, 1, 2)
        return z_e, z_q, tokens.view(b, h, w)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` → tokens ``[B, H/f, W/f]`` (long)."""
        return self.quantize(images)[2]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Tokens ``[B, h, w]`` → images ``[B, 3, f·h, f·w]``, clamped to ``[-1, 1]``.
        ``check``: NaN/inf pixels are a one-line ``ValueError`` (:func:`check_decoded`)."""
        z_q = self.codebook()[tokens].permute(0, 3, 1, 2)
        out = self.model.decoder(self.model.post_quant_conv(z_q)).clamp(-1, 1)
        return check_decoded("vqgan", out, self) if check else out

    def forward(self, images: torch.Tensor):
        """Training forward: :meth:`reconstruct` (so a distributed wrapper's forward runs it)."""
        return self.reconstruct(images)

    def reconstruct(self, images: torch.Tensor):
        """Training forward: ``(x̂ [B, 3, H, W], z_e, z_q)`` with the straight-through estimator
        (the decoder's gradient reaches the encoder as if quantisation were the identity)."""
        z_e, z_q, _ = self.quantize(images)
        x_hat = self.model.post_quant_conv(z_e + (z_q - z_e).detach())
        x_hat = self.model.decoder(x_hat)
        # z_q is a view of the gathered codebook rows: FSDP2 warns on views a forward returns
        # (an in-place op on one would skip its backward hook), so hand back a tensor of its own
        return x_hat, z_e, z_q.clone()


class VQGANLoss(nn.Module):
    """The generator's objective (see the module doc). ``forward(vqgan, images)`` → dict of
    scalars: ``loss`` and its terms ``recon``, ``codebook``, ``commitment`` and, when on,
    ``perceptual`` and ``adversarial``; and ``reconstruction``, ``x̂ [B, 3, H, W]`` detached,
    for the discriminator's step, whose loss is :func:`discriminator_hinge_loss`."""

    def __init__(
        self,
        commitment_weight: float = 0.25,
        perceptual: Optional[PerceptualLoss] = None,
        perceptual_weight: float = 1.0,
        discriminator: Optional[PatchDiscriminator] = None,
        adversarial_weight: float = 0.1,
    ):
        super().__init__()
        self.commitment_weight = commitment_weight
        self.perceptual = perceptual
        self.perceptual_weight = perceptual_weight
        self.discriminator = discriminator
        self.adversarial_weight = adversarial_weight
        if perceptual is not None:
            perceptual.requires_grad_(False)

    def forward(self, vqgan: VQGAN, images: torch.Tensor) -> dict:
        """``vqgan``: the tokenizer, or a distributed wrapper of it (its forward reconstructs)."""
        x_hat, z_e, z_q = vqgan(images)
        terms = {
            "recon": (images - x_hat).abs().mean(),
            "codebook": F.mse_loss(z_q, z_e.detach()),
            "commitment": F.mse_loss(z_e, z_q.detach()),
        }
        loss = terms["recon"] + terms["codebook"] + self.commitment_weight * terms["commitment"]
        if self.perceptual is not None:
            terms["perceptual"] = self.perceptual(images, x_hat)
            loss = loss + self.perceptual_weight * terms["perceptual"]
        if self.discriminator is not None:
            terms["adversarial"] = -self.discriminator(x_hat).mean()
            loss = loss + self.adversarial_weight * terms["adversarial"]
        terms["loss"] = loss
        terms["reconstruction"] = x_hat.detach()
        return terms


def discriminator_hinge_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """The discriminator's hinge loss: ``mean(relu(1 − D(x))) + mean(relu(1 + D(x̂)))``, halved
    (as taming)."""
    return 0.5 * (F.relu(1 - real_logits).mean() + F.relu(1 + fake_logits).mean())


class PatchDiscriminator(nn.Module):
    """PatchGAN discriminator (Isola et al. 2017), as taming uses it: ``[B, 3, H, W]`` →
    per-patch logits ``[B, 1, h, w]``; 4 × 4 convolutions, stride 2 in the first ``num_layers``,
    BatchNorm and LeakyReLU(0.2) between them."""

    def __init__(self, in_channels: int = 3, width: int = 64, num_layers: int = 3):
        super().__init__()
        mods = [nn.Conv2d(in_channels, width, 4, 2, 1), nn.LeakyReLU(0.2)]
        ch = width
        for i in range(1, num_layers + 1):
            out = width * min(2**i, 8)
            stride = 2 if i < num_layers else 1
            mods += [
                nn.Conv2d(ch, out, 4, stride, 1, bias=False),
                nn.BatchNorm2d(out),
                nn.LeakyReLU(0.2),
            ]
            ch = out
        mods.append(nn.Conv2d(ch, 1, 4, 1, 1))
        self.net = nn.Sequential(*mods)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


#: VGG16 ``features`` indices after which LPIPS reads activations (relu1_2 … relu5_3)
_VGG_TAPS = (3, 8, 15, 22, 29)
_VGG_WIDTHS = (64, 128, 256, 512, 512)


class PerceptualLoss(nn.Module):
    """LPIPS-like distance (Zhang et al. 2018) on torchvision's VGG16 ``features``: at the five
    ReLU taps the activations are unit-normalised over channels, their squared difference
    weighted per channel (``lin0`` … ``lin4``, LPIPS's learned layers; 1 when the file has none),
    averaged over space and summed over taps. Images in ``[-1, 1]``, normalised as VGG expects.

    Weights come from a local ``.safetensors`` file only (:meth:`from_file`; a pickle is refused
    before it is opened) with torchvision's ``features.*`` keys and optional ``lin{i}.weight``
    ``[1, C, 1, 1]``; a missing, corrupt or mis-shaped file is one line naming it."""

    shift: torch.Tensor  # buffers registered in __init__
    scale: torch.Tensor

    def __init__(self):
        super().__init__()
        from torchvision.models import vgg16

        self.features = vgg16(weights=None).features[: _VGG_TAPS[-1] + 1]
        for i, ch in enumerate(_VGG_WIDTHS):
            self.register_buffer(f"lin{i}", torch.ones(1, ch, 1, 1))
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1))

    @classmethod
    def check_file(cls, path: str, what: str = "perceptual weights") -> None:
        """Refuse, reading only the file's header, weights :meth:`from_file` could not load: a
        missing, pickle, truncated or corrupt file (:func:`check_state_file`), a VGG16 feature
        weight missing or of another shape, an LPIPS ``lin{i}.weight`` of another shape. One
        ``ValueError`` line naming the file."""
        from unclip.io.weights import safetensors_shapes

        check_state_file(path, what)
        got = safetensors_shapes(path, what)
        with torch.device("meta"):  # the shapes, with no memory taken
            net = cls()
        want = {f"features.{k}": tuple(v.shape) for k, v in net.features.state_dict().items()}
        for i in range(len(_VGG_TAPS)):
            if f"lin{i}.weight" in got:
                want[f"lin{i}.weight"] = tuple(getattr(net, f"lin{i}").shape)
        for key, shape in want.items():
            if key not in got:
                raise ValueError(
                    f"{what}: {path} has no VGG16 {key!r} (expected torchvision's vgg16 state "
                    "dict keys)"
                )
            if tuple(got[key]) != shape:
                raise ValueError(
                    f"{what}: {path}: {key!r} has shape {tuple(got[key])}, VGG16/LPIPS's is {shape}"
                )

    @classmethod
    def from_file(cls, path: str) -> PerceptualLoss:
        cls.check_file(path)
        state = load_state_file(path, "perceptual weights")
        net = cls()
        net.features.load_state_dict({k: state[f"features.{k}"] for k in net.features.state_dict()})
        for i in range(len(_VGG_TAPS)):
            if f"lin{i}.weight" in state:
                getattr(net, f"lin{i}").copy_(state[f"lin{i}.weight"].abs())
        return net.eval()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean distance over the batch of ``x, y [B, 3, H, W]`` (scalar)."""
        h = torch.cat([x, y]).float()
        h = (h - self.shift) / self.scale
        total = h.new_zeros(())
        tap = 0
        for i, layer in enumerate(self.features):
            h = layer(h)
            if i == _VGG_TAPS[tap]:
                fx, fy = F.normalize(h, dim=1, eps=1e-10).chunk(2)
                total = total + ((fx - fy) ** 2 * getattr(self, f"lin{tap}")).sum(1).mean()
                tap += 1
        return total


def check_state_file(path: str, what: str) -> None:
    """Refuse, in one ``ValueError`` line naming ``path`` and reading only its header, a weights
    file ``what`` (``perceptual weights``) that is missing, not a ``.safetensors`` file (a pickle
    is refused before it is opened: loading one can run code) or truncated or corrupt."""
    from unclip.io.safety import PICKLE_SUFFIXES, pickle_refusal
    from unclip.io.weights import check_safetensors

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: {path} does not exist; give the path of a local file")
    if p.suffix in PICKLE_SUFFIXES:
        raise pickle_refusal(p, what)
    if p.suffix != ".safetensors":
        raise ValueError(f"{what}: {path} is not a .safetensors file; give one")
    check_safetensors(p, what)


def load_state_file(path: str, what: str = "weights") -> dict:
    """The tensors of the local ``.safetensors`` file ``path``, checked by
    :func:`check_state_file` first (no pickle is ever opened)."""
    from unclip.io.weights import load_safetensors

    check_state_file(path, what)
    return load_safetensors(path, what)
