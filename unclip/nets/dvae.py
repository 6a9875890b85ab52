"""DALL-E's discrete VAE (Ramesh et al. 2021, "Zero-Shot Text-to-Image Generation", §2.1 and
appendix A): 256 × 256 RGB images ↔ 32 × 32 grids of tokens over 8,192 codes.

Encoder: a 7 × 7 convolution, four groups of bottleneck resblocks (widths ``n_hid · 1, 2, 4, 8``)
with 2 × 2 max-pooling between groups (8× downsampling), then ReLU and a 1 × 1 convolution to the
``K`` code logits. Decoder: a 1 × 1 convolution from the ``K``-way (relaxed) one-hot codes, four
groups (widths ``n_hid · 8, 4, 2, 1``) with nearest 2× upsampling between them, then ReLU and a
1 × 1 convolution to the logit-Laplace parameters ``μ, ln b`` of each colour channel (or to the
pixels themselves under a plain L1 / L2 reconstruction term, ``recon``). The paper's
stabilisers are kept: 1 × 1 convolutions on both sides of the relaxation (a small receptive field
there made the relaxed bound generalise better to the true one), and each resblock's residual
branch multiplied by ``1 / n_layers²`` (``n_layers`` = resblocks per stack) so training starts
stable.

Training maximises the relaxed evidence lower bound (§2.1, eq. 1): the gumbel-softmax relaxation
(Jang et al. 2016; Maddison et al. 2016) of the posterior over codes at temperature ``τ``, the
reconstruction term under the paper's logit-Laplace distribution (appendix A.3), and ``β`` times
the KL divergence from the posterior to the uniform prior over the ``K`` codes
(:meth:`DVAE.loss`). ``DVAEConfig.recon`` picks the reconstruction term: ``logit_laplace``
(the paper's) or a stated substitute, ``l1`` / ``mse`` (mean absolute / squared error of pixels in
``[-1, 1]``, the decoder's three output channels read as the pixels). With its learned scale
``b`` the logit-Laplace charges a pixel about ``1 + ln |error|`` once ``b`` fits the error, so flat
backgrounds earn most of the likelihood and a small object's few wrong pixels cost little; the
plain terms charge those pixels linearly or quadratically (the shapes config uses ``mse``).
:func:`dvae_schedule` anneals ``τ`` from 1 to 1/16 and raises ``β`` from 0
to 6.6 with the paper's schedule (appendix A.2) rescaled to a run's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from unclip.nets.token_common import MAX_CODES, MAX_GRID, check_decoded, check_sizes

__all__ = [
    "LOGIT_LAPLACE_EPS",
    "RECON_TERMS",
    "DVAEConfig",
    "DVAE",
    "DVAELoss",
    "DVAESchedule",
    "dvae_schedule",
    "logit_laplace_nll",
]

#: the logit-Laplace pixel squeeze: [0, 1] → [ε, 1 - ε] (appendix A.3: ε = 0.1)
LOGIT_LAPLACE_EPS = 0.1

#: reconstruction terms: the paper's logit-Laplace, or plain L1 / L2 on pixels in [-1, 1]
RECON_TERMS = ("logit_laplace", "l1", "mse")


@dataclass
class DVAEConfig:
    """The dVAE. Defaults: the paper's (appendix A.1; 256 px → 32 × 32 tokens over 8,192
    codes): ``n_hid`` 256, two resblocks per group, four groups."""

    image_size: int = 256
    num_codes: int = 8192
    n_hid: int = 256
    blocks_per_group: int = 2
    #: the decoder's first width (after the 1 × 1 convolution from the codes)
    n_init: int = 128
    #: resblock groups per stack (the paper's four: 8× downsampling); ``g`` groups downsample
    #: by ``2^(g-1)``, e.g. three for 4× (32 px → 8 × 8 tokens, where 8× would leave 4 × 4)
    groups: int = 4
    #: the reconstruction term, one of :data:`RECON_TERMS` (see the module doc)
    recon: str = "logit_laplace"

    def __post_init__(self) -> None:
        if self.recon not in RECON_TERMS:
            raise ValueError(
                f"dvae: recon must be one of {', '.join(RECON_TERMS)}, got {self.recon!r}"
            )
        check_sizes(
            "dvae",
            self,
            {
                "image_size": (8, 4096),
                "num_codes": (2, MAX_CODES),
                "n_hid": (1, 8192),
                "n_init": (1, 8192),
                "blocks_per_group": (1, 64),
                "groups": (1, 8),
            },
        )
        self._check_grid()

    def _check_grid(self) -> None:
        if self.image_size % self.downsampling:
            raise ValueError(
                f"dvae: image_size must be a multiple of {self.downsampling} ({self.groups} "
                f"groups), got {self.image_size}"
            )
        check_sizes("dvae", self, {"grid": (1, MAX_GRID)})

    @property
    def downsampling(self) -> int:
        return 2 ** (self.groups - 1)

    @property
    def grid(self) -> int:
        """Tokens per side: ``image_size / downsampling``."""
        return self.image_size // self.downsampling

    def build(self) -> DVAE:
        self.__post_init__()  # fields set after the config was made are checked too
        return DVAE(self)


class DVAEBlock(nn.Module):
    """``x ↦ id(x) + (1 / n_layers²) · res(x)``, ``res`` a bottleneck of width ``n_out / 4``:
    encoder ``3×3, 3×3, 3×3, 1×1`` convolutions, decoder ``1×1, 3×3, 3×3, 3×3``, each after a
    ReLU; ``id`` a 1 × 1 convolution when the width changes."""

    def __init__(self, n_in: int, n_out: int, n_layers: int, decoder: bool):
        super().__init__()
        hid = max(1, n_out // 4)
        self.id_path = nn.Conv2d(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        kernels = (1, 3, 3, 3) if decoder else (3, 3, 3, 1)
        widths = (n_in, hid, hid, hid, n_out)
        layers = []
        for k, a, b in zip(kernels, widths[:-1], widths[1:]):
            layers += [nn.ReLU(), nn.Conv2d(a, b, k, padding=k // 2)]
        self.res_path = nn.Sequential(*layers)
        self.post_gain = 1.0 / n_layers**2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.id_path(x) + self.post_gain * self.res_path(x)


def _stack(widths, n_in, blocks, n_layers, decoder) -> nn.Sequential:
    """Groups of resblocks (the paper has four); 2 × 2 max-pooling (encoder) or nearest 2×
    upsampling (decoder) between consecutive groups."""
    mods: list[nn.Module] = []
    for g, w in enumerate(widths):
        for i in range(blocks):
            mods.append(DVAEBlock(n_in if i == 0 else w, w, n_layers, decoder))
        n_in = w
        if g < len(widths) - 1:
            mods.append(nn.Upsample(scale_factor=2) if decoder else nn.MaxPool2d(2))
    return nn.Sequential(*mods)


class DVAELoss(NamedTuple):
    """Scalars, all per image dimension (divided by ``3 · H · W``) so ``β`` keeps the paper's
    meaning: ``loss = recon + kl_weight · kl`` is the negative relaxed ELB per dimension;
    ``recon`` the logit-Laplace negative log-likelihood (or the plain term's error), ``kl`` the
    summed per-token KL to the uniform prior."""

    loss: torch.Tensor
    recon: torch.Tensor
    kl: torch.Tensor


class DVAE(nn.Module):
    """DALL-E's discrete VAE (see the module doc). Images are ``[B, 3, H, W]`` in ``[-1, 1]``."""

    def __init__(self, config: DVAEConfig):
        super().__init__()
        self.config = c = config
        n_layers = c.groups * c.blocks_per_group
        widths = [c.n_hid * 2**g for g in range(c.groups)]  # the paper's n_hid · 1, 2, 4, 8
        self.encoder = nn.Sequential(
            nn.Conv2d(3, c.n_hid, 7, padding=3),
            _stack(widths, c.n_hid, c.blocks_per_group, n_layers, False),
            nn.ReLU(),
            nn.Conv2d(widths[-1], c.num_codes, 1),
        )
        self.decoder_in = nn.Conv2d(c.num_codes, c.n_init, 1)
        self.decoder = nn.Sequential(
            _stack(widths[::-1], c.n_init, c.blocks_per_group, n_layers, True),
            nn.ReLU(),
            # μ and ln b per colour channel for the logit-Laplace, the pixels otherwise
            nn.Conv2d(c.n_hid, 2 * 3 if c.recon == "logit_laplace" else 3, 1),
        )

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[-1, 1]`` → code logits ``[B, K, H/f, W/f]``."""
        return self.encoder(images)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[-1, 1]`` → tokens ``[B, H/f, W/f]`` (the posterior's
        most likely code, as the paper tokenises the transformer's training images)."""
        return self.logits(images).argmax(1)

    def _params(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder input ``[B, d_init, h, w]`` → ``μ, ln b`` of the logit-Laplace, each
        ``[B, 3, H, W]`` (under ``l1`` / ``mse``: the unclamped pixels and an empty ``ln b``)."""
        out = self.decoder(z)
        return out[:, :3], out[:, 3:]

    def _images(self, mu: torch.Tensor) -> torch.Tensor:
        """The reconstruction in ``[-1, 1]``: the logit-Laplace's squeezed pixel ``sigmoid(μ)``
        mapped back, or the plain terms' pixels clamped."""
        if self.config.recon != "logit_laplace":
            return mu.clamp(-1, 1)
        x = (torch.sigmoid(mu) - LOGIT_LAPLACE_EPS) / (1 - 2 * LOGIT_LAPLACE_EPS)
        return x.clamp(0, 1) * 2 - 1

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Tokens ``[B, h, w]`` → images ``[B, 3, fh, fw]`` in ``[-1, 1]``. The 1 × 1
        convolution of a one-hot code is its weight column, so the codes are looked up.
        ``check``: NaN/inf pixels are a one-line ``ValueError`` (:func:`check_decoded`); off
        where a diverging run's metrics should show them instead."""
        w = self.decoder_in.weight[:, :, 0, 0]  # [d_init, K]
        bias = cast(torch.Tensor, self.decoder_in.bias)  # decoder_in is built with a bias
        z = F.embedding(tokens, w.T) + bias  # [B, h, w, d_init]
        images = self._images(self._params(z.permute(0, 3, 1, 2))[0])
        return check_decoded("dvae", images, self) if check else images

    def forward(
        self,
        images: torch.Tensor,
        temperature: float,
        kl_weight: float,
        generator: Optional[torch.Generator] = None,
    ) -> DVAELoss:
        """Training forward: :meth:`loss` (so a distributed wrapper's forward runs it)."""
        return self.loss(images, temperature, kl_weight, generator)

    def loss(
        self,
        images: torch.Tensor,
        temperature: float,
        kl_weight: float,
        generator: Optional[torch.Generator] = None,
    ) -> DVAELoss:
        """The negative relaxed ELB of ``images [B, 3, H, W]`` in ``[-1, 1]`` (§2.1):
        codes relaxed by gumbel-softmax at ``temperature`` (``τ``), reconstruction under the
        logit-Laplace distribution (or ``config.recon``'s plain term), ``kl_weight`` (``β``)
        times the KL to the uniform prior."""
        if temperature <= 0:
            raise ValueError(f"dvae: temperature must be > 0, got {temperature!r}")
        logits = self.logits(images).float()  # [B, K, h, w]
        u = torch.rand(
            logits.shape, generator=generator, device=generator.device if generator else None
        ).to(logits.device)
        gumbel = -torch.log((-torch.log(u.clamp(1e-20, 1.0))).clamp_min(1e-20))
        soft = ((logits + gumbel) / temperature).softmax(1)
        mu, log_b = self._params(self.decoder_in(soft.to(images.dtype)))
        n_dims = images[0].numel()
        recon_kind = self.config.recon
        if recon_kind == "logit_laplace":
            per_dim = logit_laplace_nll(images, mu.float(), log_b.float())
        elif recon_kind == "l1":
            per_dim = (mu.float() - images.float()).abs()
        else:
            per_dim = (mu.float() - images.float()).pow(2)
        recon = per_dim.flatten(1).sum(1)
        log_q = logits.log_softmax(1)
        # KL(q ‖ U(K)) = Σ_k q_k log q_k + log K, per token, summed over the grid
        kl = ((log_q.exp() * log_q).sum(1) + math.log(self.config.num_codes)).flatten(1).sum(1)
        recon, kl = recon.mean() / n_dims, kl.mean() / n_dims
        return DVAELoss(recon + kl_weight * kl, recon, kl)


def logit_laplace_nll(images: torch.Tensor, mu: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Per-dimension negative log-likelihood ``[B, 3, H, W]`` of ``images`` in ``[-1, 1]`` under
    the logit-Laplace distribution (appendix A.3): pixels are squeezed to ``x ∈ [ε, 1 - ε]`` and

        f(x | μ, b) = exp(−|logit(x) − μ| / b) / (2 b x (1 − x)),

    a Laplace on ``logit(x)``, so its support is (0, 1) like the pixels'."""
    x = (images.float() + 1) / 2 * (1 - 2 * LOGIT_LAPLACE_EPS) + LOGIT_LAPLACE_EPS
    logit_x = torch.log(x) - torch.log1p(-x)
    return (
        (logit_x - mu).abs() * torch.exp(-log_b)
        + log_b
        + math.log(2.0)
        + torch.log(x)
        + torch.log1p(-x)
    )


class DVAESchedule(NamedTuple):
    """Settings at one step: relaxation ``temperature`` (τ), ``kl_weight`` (β), ``lr``."""

    temperature: float
    kl_weight: float
    lr: float


#: the paper's schedule (appendix A.2), in updates of its 3,000,000-update run
_PAPER_STEPS = 3_000_000
_TAU_STEPS, _KL_STEPS, _LR_STEPS = 150_000, 5_000, 1_200_000


def _cosine(step: float, span: float, start: float, end: float) -> float:
    """Cosine from ``start`` (step 0) to ``end`` (step ``span`` and after)."""
    frac = min(max(step / span, 0.0), 1.0) if span > 0 else 1.0
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * frac))


def dvae_schedule(
    step: int,
    total_steps: int,
    tau_end: float = 1 / 16,
    kl_weight_end: float = 6.6,
    lr_start: float = 1e-4,
    lr_end: float = 1.25e-6,
    tau_steps: Optional[int] = None,
    kl_steps: Optional[int] = None,
) -> DVAESchedule:
    """The dVAE's settings at ``step`` of a ``total_steps`` run: the paper's cosine schedules
    (appendix A.2: τ 1 → 1/16 over the first 150,000 updates, β 0 → 6.6 over the first 5,000,
    step size 1e-4 → 1.25e-6 over the first 1,200,000, of 3,000,000) with every span scaled
    by ``total_steps / 3,000,000``; each holds its end value after its span. ``tau_steps`` /
    ``kl_steps``: the temperature's / KL weight's span in steps instead of the scaled one."""
    if total_steps < 1:
        raise ValueError(f"dvae_schedule: total_steps must be >= 1, got {total_steps!r}")
    scale = total_steps / _PAPER_STEPS
    tau_span = _TAU_STEPS * scale if tau_steps is None else tau_steps
    kl_span = _KL_STEPS * scale if kl_steps is None else kl_steps
    return DVAESchedule(
        temperature=_cosine(step, tau_span, 1.0, tau_end),
        kl_weight=_cosine(step, kl_span, 0.0, kl_weight_end),
        lr=_cosine(step, _LR_STEPS * scale, lr_start, lr_end),
    )
