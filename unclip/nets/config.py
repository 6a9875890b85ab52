"""Configs of the networks: the diffusion and autoregressive priors (:class:`PriorConfig`,
:class:`ARPriorOptions`), the decoder (:class:`DecoderConfig`) and the upsamplers
(:class:`UpsamplerConfig`); ``cfg.build(...)`` builds what a config describes. The CLIP's config,
:class:`~unclip.nets.clip.ClipConfig`, lives with the CLIP, which reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from unclip.utils.config import ConfigError, to_dict


@dataclass
class ARPriorOptions:
    """The autoregressive prior's code (paper §2.1; see docs/ar_prior.md).

    ``pca_dims``: principal components of the CLIP image embedding kept (paper: 319 of 1024;
    None: all ``D``), fitted on ``fit_samples`` training embeddings at the start of training.
    ``num_buckets``: codes per component (paper: 1024), with per-component quantile bucket edges.
    ``dot_buckets``: buckets of the text–image cosine, the "dot-product token".
    """

    pca_dims: Optional[int] = None
    num_buckets: int = 1024
    dot_buckets: int = 32
    fit_samples: int = 4096

    def __post_init__(self) -> None:
        if self.pca_dims is not None and self.pca_dims < 1:
            raise ConfigError(
                f"prior.ar.pca_dims must be an integer >= 1 (or null: every dimension), got "
                f"{self.pca_dims!r}"
            )
        if self.num_buckets < 2:
            raise ConfigError(
                f"prior.ar.num_buckets must be an integer >= 2 (paper: 1024), got "
                f"{self.num_buckets!r}"
            )
        if self.dot_buckets < 1:
            raise ConfigError(
                f"prior.ar.dot_buckets must be an integer >= 1, got {self.dot_buckets!r}"
            )
        if self.fit_samples < 2:
            raise ConfigError(
                f"prior.ar.fit_samples must be an integer >= 2 (more than pca_dims), got "
                f"{self.fit_samples!r}"
            )


@dataclass
class PriorConfig:
    """The prior over CLIP image embeddings: ``type`` ``diffusion`` (paper §2.2) or ``ar`` (§2.1).

    ``diffusion``: diffusers ``PriorTransformer``; the transformer sees [text tokens
    (num_embeddings), text_embed, time, x_t, prediction token] and predicts x_0 (the un-noised,
    normalised image embedding). ``ar``: a causal transformer of the same size
    (``num_layers``, ``num_attention_heads``, ``attention_head_dim``, ``dropout``) predicting the
    PCA-quantised image embedding one code at a time (:class:`~unclip.nets.ar_prior.UnCLIPARPrior`),
    with the code settings in ``ar`` (:class:`ARPriorOptions`; only for ``type: ar``).
    ``embed_scale`` (diffusion only): the diffusion runs on ``embed_scale ·`` the unit-norm image
    embedding, the paper's fixed 17.2 (Ramesh et al. 2022, Appendix C), instead of each
    dimension standardised by statistics of the training embeddings (``null``, as in Karlo); it
    is stored as those statistics (mean 0, std ``1/embed_scale``). The CLIP supplies the widths
    (``embed_dim``, ``text_width``, ``context_length``); :meth:`build` makes the network.

    DALL-E Mega's transformer recipe for either prior (:mod:`unclip.nets.blocks`):
    ``normformer`` adds NormFormer's LayerNorms after attention and after the feed-forward's
    activation and a learned scale per attention head (Shleifer et al. 2021); ``ff_activation``
    ``geglu``/``swiglu`` makes the feed-forward a GLU with 2/3 of the hidden width, the same
    parameter count (Shazeer 2020). The defaults (off, ``gelu``) are diffusers'
    ``PriorTransformer`` exactly; either option makes a diffusion prior that diffusers'
    ``UnCLIPPipeline`` cannot load (export refuses it).

    ``text_encoder`` (diffusion only) chooses what gives the transformer its caption tokens:
    ``clip``, the frozen CLIP's token states (the small models), or ``transformer``, the prior's
    own trainable caption transformer over ``text_context_length`` token ids of
    ``text_tokenizer`` (the paper's: its own text encoder over 256 tokens), sized by
    ``text_encoder_width``, ``text_encoder_layers`` and ``text_encoder_heads``
    (:class:`~unclip.nets.text_encoder.CaptionTransformer`, the decoder's). Its token states,
    projected to the embedding width, take the CLIP token states' place; the CLIP text embedding
    stays the transformer's text-embedding input, as in the paper's sequence (§2.2).
    """

    type: Literal["diffusion", "ar"] = "diffusion"
    num_layers: int = 24
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    dropout: float = 0.0
    normformer: bool = False
    ff_activation: Literal["gelu", "geglu", "swiglu"] = "gelu"
    ar: Optional[ARPriorOptions] = None
    embed_scale: Optional[float] = None
    text_encoder: Literal["clip", "transformer"] = "clip"
    text_encoder_width: int = 2048
    text_encoder_layers: int = 24
    text_encoder_heads: int = 32
    text_context_length: int = 256
    text_tokenizer: Literal["open_clip_bpe"] = "open_clip_bpe"

    def __post_init__(self) -> None:
        _check_dropout("prior.dropout", self.dropout)
        if self.text_encoder == "transformer":
            if self.type == "ar":
                raise ConfigError(
                    "prior.text_encoder: transformer is built for the diffusion prior; the "
                    "autoregressive prior reads CLIP token states (set prior.text_encoder: clip)"
                )
            _check_text_encoder("prior", self)
        if self.embed_scale is not None:
            if not self.embed_scale > 0:
                raise ConfigError(f"prior.embed_scale must be > 0 or null, got {self.embed_scale}")
            if self.type == "ar":
                raise ConfigError(
                    "prior.embed_scale applies to the diffusion prior (the autoregressive prior "
                    "codes embeddings by PCA); remove it or set prior.type: diffusion"
                )
        if self.type == "diffusion" and self.ar is not None:
            raise ConfigError(
                "prior.ar configures the autoregressive prior; set prior.type: ar or remove the "
                "'ar:' section"
            )
        if self.type == "ar" and self.ar is None:
            self.ar = ARPriorOptions()

    def build(self, clip):
        """The prior this config describes (:class:`~unclip.nets.prior.UnCLIPPrior` or
        :class:`~unclip.nets.ar_prior.UnCLIPARPrior`), sized for ``clip``."""
        skip = ("type", "ar", "embed_scale")  # embed_scale is stored as the statistics
        arch = {k: v for k, v in to_dict(self).items() if k not in skip}
        if self.type == "ar":
            from unclip.nets.ar_prior import UnCLIPARPrior

            arch = {k: v for k, v in arch.items() if not k.startswith("text_")}
            opts = to_dict(self.ar)
            opts.pop("fit_samples")  # a training setting: how many embeddings the fit reads
            return UnCLIPARPrior.from_clip(clip, **arch, **opts)
        from unclip.nets.prior import UnCLIPPrior

        return UnCLIPPrior.from_clip(clip, **arch)


@dataclass
class DecoderConfig:
    """Base decoder (diffusers ``UNet2DConditionModel``) conditioned on the CLIP image embedding.

    Paper §2.1: the image embedding is projected and added to the timestep embedding and projected
    into ``num_image_tokens`` extra context tokens placed beside the caption tokens.
    ``coord_channels`` adds x/y coordinate input channels (CoordConv; not in the paper or Karlo);
    ``embed_scale`` multiplies the CLIP embeddings before projection (sqrt(D) for unit-norm ones).

    ``text_encoder`` chooses what encodes the caption: ``clip`` (the frozen CLIP's token states and
    pooled text embedding; the small models) or ``transformer``, the paper's decoder's own
    trainable transformer (GLIDE's: width 2048, 24 layers, 32 heads, 256 tokens), sized by
    ``text_encoder_width``, ``text_encoder_layers``, ``text_encoder_heads`` and
    ``text_context_length``, over token ids of ``text_tokenizer`` (``open_clip_bpe``: open_clip's
    CLIP BPE, shipped with the package). Its final token's state is projected into the time
    embedding and its token states are the context beside the image tokens. ``dropout``: in the
    UNet's residual blocks during training (paper: 0.1).
    ``learned_variance``: 6 output channels, the mean parameter and a per-channel variance
    interpolation (Improved DDPM; the paper's and Karlo's decoder), trained with
    ``diffusion.vlb_weight`` (see :mod:`unclip.diffusion.vlb`).
    ``autoencoder``: a folder with a frozen autoencoder (a ``train-tokenizer`` VQGAN, or a
    diffusers ``VQModel`` / ``AutoencoderKL``) makes this a latent decoder, whose diffusion runs on
    its latents (``sample_size`` is still the side of the images; the UNet's grid is
    ``sample_size / f``); ``latent_scale`` overrides the latents' default scale
    (:mod:`unclip.nets.autoencoder`).
    :meth:`build` makes the network, sized for a CLIP.
    """

    sample_size: int = 64
    block_out_channels: list[int] = field(default_factory=lambda: [320, 640, 960, 1280])
    layers_per_block: int = 3
    down_block_types: list[str] = field(
        default_factory=lambda: [
            "ResnetDownsampleBlock2D",
            "SimpleCrossAttnDownBlock2D",
            "SimpleCrossAttnDownBlock2D",
            "SimpleCrossAttnDownBlock2D",
        ]
    )
    up_block_types: list[str] = field(
        default_factory=lambda: [
            "SimpleCrossAttnUpBlock2D",
            "SimpleCrossAttnUpBlock2D",
            "SimpleCrossAttnUpBlock2D",
            "ResnetUpsampleBlock2D",
        ]
    )
    mid_block_type: str = "UNetMidBlock2DSimpleCrossAttn"
    attention_head_dim: int = 64
    num_image_tokens: int = 4
    learned_variance: bool = False
    norm_num_groups: int = 32
    use_text_tokens: bool = True
    coord_channels: bool = False
    embed_scale: float = 1.0
    text_encoder: Literal["clip", "transformer"] = "clip"
    text_encoder_width: int = 2048
    text_encoder_layers: int = 24
    text_encoder_heads: int = 32
    text_context_length: int = 256
    text_tokenizer: Literal["open_clip_bpe"] = "open_clip_bpe"
    dropout: float = 0.0
    autoencoder: Optional[str] = None
    latent_scale: Optional[float] = None

    def __post_init__(self) -> None:
        _check_dropout("decoder.dropout", self.dropout)
        if self.text_encoder == "transformer":
            _check_text_encoder("decoder", self)
        if self.latent_scale is not None and self.autoencoder is None:
            raise ValueError(
                "decoder.latent_scale scales an autoencoder's latents: set decoder.autoencoder "
                "too, or drop latent_scale"
            )

    def build(self, clip):
        """The :class:`~unclip.nets.decoder.UnCLIPDecoder` this config describes, sized for
        ``clip``; with ``autoencoder`` (a folder, :func:`~unclip.nets.autoencoder.
        load_autoencoder`) a latent decoder holding that autoencoder's weights."""
        from unclip.nets.decoder import UnCLIPDecoder

        kwargs = to_dict(self)
        path, scale = kwargs.pop("autoencoder"), kwargs.pop("latent_scale")
        if path is None:
            return UnCLIPDecoder.from_clip(clip, **kwargs)
        from unclip.nets.autoencoder import autoencoder_config, load_autoencoder
        from unclip.utils.devices import under_fake_tensors

        # a dry run (unclip plan) builds on fake tensors, which cannot take the file's weights
        weights = not under_fake_tensors()
        model, l2_codes = load_autoencoder(path, weights=weights)
        decoder = UnCLIPDecoder.from_clip(
            clip,
            autoencoder=autoencoder_config(model),
            autoencoder_l2_codes=l2_codes,
            latent_scale=scale,
            **kwargs,
        )
        if weights:
            decoder.latent_space.model.load_state_dict(model.state_dict())
        return decoder


@dataclass
class UpsamplerConfig:
    """Super-resolution stage (diffusers ``UNet2DModel``): low-res image upsampled and concatenated.

    ``noise_level`` is the fixed noise level (a diffusion timestep) of the low-res image at
    sampling. How the low-res conditioning is corrupted during training is a training setting (the
    stage config's ``upsampler_train:`` section). ``add_attention``: self-attention in the UNet's
    mid block (the paper's upsamplers are convolution-only: false), in heads of
    ``attention_head_dim`` channels (default 8, diffusers' and that of weights saved before the
    setting; 32 or 64 run several times faster on a CPU). ``dropout``: in the residual blocks
    during training (paper: 0.1 in the first upsampler). :meth:`build` makes the network.
    """

    sample_size: int = 256
    low_res_size: int = 64
    block_out_channels: list[int] = field(default_factory=lambda: [320, 640, 960, 1280])
    layers_per_block: int = 3
    down_block_types: list[str] = field(
        default_factory=lambda: ["DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D"]
    )
    up_block_types: list[str] = field(
        default_factory=lambda: ["UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"]
    )
    norm_num_groups: int = 32
    noise_level: int = 0
    add_attention: bool = True
    dropout: float = 0.0
    attention_head_dim: int = 8

    def __post_init__(self) -> None:
        _check_dropout("upsampler.dropout", self.dropout)
        width = self.block_out_channels[-1] if self.block_out_channels else 0
        if self.add_attention and (self.attention_head_dim < 1 or width % self.attention_head_dim):
            raise ConfigError(
                f"upsampler.attention_head_dim ({self.attention_head_dim}) must divide the mid "
                f"block's {width} channels (the last of upsampler.block_out_channels)"
            )

    def build(self):
        """The :class:`~unclip.nets.decoder.UnCLIPUpsampler` this config describes."""
        from unclip.nets.decoder import UnCLIPUpsampler

        return UnCLIPUpsampler(**to_dict(self))


def _check_text_encoder(section: str, cfg) -> None:
    """The caption transformer's sizes of a ``prior`` or ``decoder`` section."""
    for key in ("text_encoder_width", "text_encoder_layers", "text_encoder_heads"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{section}.{key} must be at least 1, got {getattr(cfg, key)}")
    if cfg.text_encoder_width % cfg.text_encoder_heads:
        raise ConfigError(
            f"{section}.text_encoder_width ({cfg.text_encoder_width}) must be divisible by "
            f"{section}.text_encoder_heads ({cfg.text_encoder_heads})"
        )
    if cfg.text_context_length < 2:
        raise ConfigError(
            f"{section}.text_context_length must be at least 2 (start and end tokens), got "
            f"{cfg.text_context_length}"
        )


def _check_dropout(key: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key} must be in [0, 1), got {value!r}")
