"""Image stages: the base decoder conditioned on CLIP image embeddings, and the upsamplers.

:class:`UnCLIPDecoder` (Ramesh et al. 2022, §2.1) wraps diffusers' ``UNet2DConditionModel``. The
CLIP image embedding ``image_embed [B, D]`` is projected and added to the timestep embedding and
projected into ``num_image_tokens`` extra context tokens concatenated before the (projected,
normalised) caption token states; the pooled text embedding is also added to the timestep embedding
(as in GLIDE and Karlo). A learned null image embedding replaces ``image_embed`` for the
unconditional pass and for dropout in training; the null caption is the CLIP encoding of the empty
string. With ``text_encoder="transformer"`` the decoder encodes the caption itself, as the paper's
decoder (GLIDE's) does: a trainable :class:`~unclip.nets.text_encoder.CaptionTransformer` over the
caption's token ids (``text`` is then ids ``[B, L]`` from :meth:`UnCLIPDecoder.tokenize`, the null
caption the empty string's ids); its token states replace the CLIP ones and its final token's
state replaces the pooled CLIP text embedding.

:class:`UnCLIPUpsampler` wraps ``UNet2DModel``: the low-res image is upsampled (bicubic) and
concatenated to ``x_t`` (6 input channels); the noise level of the low-res conditioning augmentation
is an input (sinusoidal features → MLP, added to the time embedding). Convolution-only blocks by
default. An optional second network can run the final step (Karlo's ``super_res_last``). Karlo's
upsampler has no noise-level input, no mid-block attention (``add_attention=False``) and does not
clamp the bicubic-upsampled conditioning (``clamp_low_res=False``); those flags let converted
weights sample exactly as in diffusers.

:func:`degrade` implements the training-time low-res corruption: Gaussian blur (first upsampler) or
a BSR-style random degradation (second upsampler; Zhang et al. 2021).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models import ModelMixin, UNet2DConditionModel, UNet2DModel
from diffusers.models.embeddings import TimestepEmbedding, Timesteps

from unclip.nets.attention import checkpoint
from unclip.nets.autoencoder import LatentSpace
from unclip.nets.text_encoder import CaptionTransformer, caption_tokenizer
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.utils.precision import KeepFp32Mixin

__all__ = [
    "Caption",
    "TEXT_ENCODERS",
    "UnCLIPDecoder",
    "UnCLIPUpsampler",
    "degrade",
    "drop_captions",
    "encode_captions",
    "gaussian_blur",
    "upsample_low_res",
]

#: what a decoder conditions on for the caption (``text_encoder``): frozen CLIP token states, or
#: its own trainable transformer over the caption's tokens (the paper's decoder)
TEXT_ENCODERS = ("clip", "transformer")

#: a decoder's caption input: a CLIP :class:`TextEncoding`, or token ids ``[B, L]`` for a decoder
#: with its own text encoder
Caption = Union[TextEncoding, torch.Tensor]


def check_dropout(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {value!r}")
    return value


def coordinate_grid(x: torch.Tensor) -> torch.Tensor:
    """``[B, 2, H, W]`` pixel-centre coordinates (x then y, each in (-1, 1)) in ``x``'s dtype and
    device."""
    b, _, h, w = x.shape
    ys = (torch.arange(h, device=x.device, dtype=torch.float32) + 0.5) / h * 2 - 1
    xs = (torch.arange(w, device=x.device, dtype=torch.float32) + 0.5) / w * 2 - 1
    grid = torch.stack([xs.view(1, w).expand(h, w), ys.view(h, 1).expand(h, w)])
    return grid.to(x.dtype).unsqueeze(0).expand(b, -1, -1, -1)


# ignore: diffusers types ModelMixin.to through functools.wraps, its class defaults by None
class UnCLIPDecoder(KeepFp32Mixin, ModelMixin, ConfigMixin):  # type: ignore[misc]
    """Base decoder:
    ``forward(x_t [B,3,H,W], t, image_embed [B,D], text, drop_image [B]?) → [B,C,H,W]``.

    ``C`` is 3 (eps/x_0/v) or 6 with ``learned_variance`` (Karlo's mean + variance interpolation).
    ``coord_channels``: two fixed input channels with each pixel's x and y coordinate (CoordConv),
    so the convolutional UNet, which has no positional encoding, knows where in the image it is;
    this makes "on the left" / "above" learnable far sooner. Off for the paper/Karlo layout.
    ``embed_scale`` multiplies the image and text embeddings before their projections: unit-norm
    CLIP embeddings of width D have components of about 1/sqrt(D), so their conditioning starts far
    weaker than the timestep embedding and the layer-normalised caption tokens, and the decoder
    learns to ignore it; sqrt(D) gives unit-scale components.
    ``text_encoder``: ``"clip"`` (frozen CLIP token states and pooled embedding, ``text`` a
    :class:`TextEncoding`) or ``"transformer"`` (the paper's own caption transformer of
    ``text_encoder_width/layers/heads`` over ``text_context_length`` tokens of ``text_tokenizer``;
    ``text`` token ids). ``dropout``: in the UNet's residual blocks during training (paper: 0.1).
    ``autoencoder`` (a diffusers ``VQModel`` / ``AutoencoderKL`` config, with
    ``autoencoder_l2_codes`` and ``latent_scale``; see :mod:`unclip.nets.autoencoder`) makes it a
    latent decoder: ``x_t`` is then the frozen autoencoder's latents ``[B, C, s/f, s/f]``
    (:attr:`sample_shape`), :meth:`to_latents` and :meth:`to_images` map images to them and
    back (through :attr:`latent_space`), and ``sample_size`` stays the side of the images it
    makes. The autoencoder's weights travel in the decoder's own file.
    """

    _supports_gradient_checkpointing = True
    #: never adapted by LoRA (unclip.nets.lora): the frozen autoencoder of a latent decoder
    _lora_excluded = ("latent_space",)

    if TYPE_CHECKING:
        # diffusers' FrozenDict of the registered arguments, whose fields it also sets as attributes
        config: Any

    @register_to_config
    def __init__(
        self,
        embed_dim: int = 768,
        text_width: int = 768,
        sample_size: int = 64,
        block_out_channels: tuple = (320, 640, 960, 1280),
        layers_per_block: int = 3,
        down_block_types: tuple = (
            "ResnetDownsampleBlock2D",
            "SimpleCrossAttnDownBlock2D",
            "SimpleCrossAttnDownBlock2D",
            "SimpleCrossAttnDownBlock2D",
        ),
        up_block_types: tuple = (
            "SimpleCrossAttnUpBlock2D",
            "SimpleCrossAttnUpBlock2D",
            "SimpleCrossAttnUpBlock2D",
            "ResnetUpsampleBlock2D",
        ),
        mid_block_type: str = "UNetMidBlock2DSimpleCrossAttn",
        attention_head_dim: int = 64,
        num_image_tokens: int = 4,
        norm_num_groups: int = 32,
        cross_attention_dim: Optional[int] = None,
        use_text_tokens: bool = True,
        learned_variance: bool = False,
        coord_channels: bool = False,
        embed_scale: float = 1.0,
        text_encoder: str = "clip",
        text_encoder_width: int = 2048,
        text_encoder_layers: int = 24,
        text_encoder_heads: int = 32,
        text_context_length: int = 256,
        text_tokenizer: str = "open_clip_bpe",
        dropout: float = 0.0,
        autoencoder: Optional[dict] = None,
        autoencoder_l2_codes: bool = False,
        latent_scale: Optional[float] = None,
    ):
        super().__init__()
        if text_encoder not in TEXT_ENCODERS:
            raise ValueError(
                f"decoder text_encoder must be one of {list(TEXT_ENCODERS)}, got {text_encoder!r}"
            )
        # a latent decoder: the diffusion runs on a frozen autoencoder's latents (named apart from
        # the ``autoencoder`` config entry, which diffusers' attribute lookup would return)
        self.latent_space = (
            None
            if autoencoder is None
            else LatentSpace(dict(autoencoder), autoencoder_l2_codes, latent_scale)
        )
        channels, grid = 3, sample_size
        if self.latent_space is not None:
            channels, f = self.latent_space.channels, self.latent_space.factor
            if sample_size % f:
                raise ValueError(
                    f"decoder sample_size {sample_size} is not a multiple of the autoencoder's "
                    f"{f} pixels per latent"
                )
            grid = sample_size // f
        cross = cross_attention_dim or block_out_channels[-1]
        time_dim = block_out_channels[0] * 4
        self.unet = UNet2DConditionModel(
            sample_size=grid,
            in_channels=channels + 2 if coord_channels else channels,
            out_channels=2 * channels if learned_variance else channels,
            down_block_types=tuple(down_block_types),
            up_block_types=tuple(up_block_types),
            mid_block_type=mid_block_type,
            block_out_channels=tuple(block_out_channels),
            layers_per_block=layers_per_block,
            cross_attention_dim=cross,
            attention_head_dim=attention_head_dim,
            norm_num_groups=norm_num_groups,
            class_embed_type="identity",
            resnet_time_scale_shift="scale_shift",
            dropout=check_dropout(dropout),
        )
        self.text_transformer = None
        token_width, pooled_width = text_width, embed_dim
        if text_encoder == "transformer":
            self.text_transformer = CaptionTransformer.for_tokenizer(
                text_tokenizer,
                text_context_length,
                text_encoder_width,
                text_encoder_layers,
                text_encoder_heads,
            )
            token_width = pooled_width = text_encoder_width
        self.null_image_embed = torch.nn.Parameter(torch.zeros(embed_dim))
        self.image_to_time = torch.nn.Linear(embed_dim, time_dim)
        self.text_to_time = torch.nn.Linear(pooled_width, time_dim)
        self.image_to_tokens = torch.nn.Linear(embed_dim, num_image_tokens * cross)
        self.text_tokens_proj = torch.nn.Linear(token_width, cross) if use_text_tokens else None
        self.text_tokens_norm = torch.nn.LayerNorm(cross) if use_text_tokens else None

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        """diffusers' checkpointing (the UNet's residual blocks, the caption transformer's layers)
        plus every attention layer of the UNet: diffusers' ``SimpleCrossAttn`` blocks checkpoint
        only their resnets, so the attention layers' saved activations, and the half-precision
        weight copies autocast keeps for them, would dominate the decoder's training memory
        (measured with ``unclip plan``, docs/full_scale.md)."""
        # recomputed with the attention the forward ran (unclip.nets.attention.checkpoint)
        super().enable_gradient_checkpointing(gradient_checkpointing_func or checkpoint)
        from diffusers.models.attention_processor import Attention

        for module in self.unet.modules():
            if isinstance(module, Attention) and "forward" not in vars(module):
                # an instance attribute over the class's method; disable_... deletes it again
                checkpointed = types.MethodType(_checkpointed_forward, module)
                module.forward = checkpointed  # type: ignore[method-assign]

    def disable_gradient_checkpointing(self) -> None:
        super().disable_gradient_checkpointing()
        for module in self.unet.modules():
            vars(module).pop("forward", None)

    @property
    def out_image_channels(self) -> int:
        return 3

    @property
    def is_latent(self) -> bool:
        """True for a latent decoder (its diffusion runs on :attr:`latent_space`'s latents)."""
        return self.latent_space is not None

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """``(C, h, w)`` of what the diffusion samples: the image ``(3, s, s)`` at
        ``sample_size``, or for a latent decoder its latents ``(C, s/f, s/f)``."""
        if self.latent_space is None:
            s = self.config.sample_size
            return 3, s, s
        g = self.config.sample_size // self.latent_space.factor
        return self.latent_space.channels, g, g

    def to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, s, s]`` → what the diffusion runs on (the images themselves for a
        pixel decoder)."""
        return images if self.latent_space is None else self.latent_space.encode(images)

    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """The diffusion's samples → images ``[B, 3, s, s]`` (not clamped; the samples
        themselves for a pixel decoder)."""
        return x if self.latent_space is None else self.latent_space.decode(x)

    @property
    def has_text_encoder(self) -> bool:
        """True when the decoder encodes captions itself (``text_encoder="transformer"``)."""
        return self.text_transformer is not None

    def tokenize(self, prompts: Union[str, Sequence[str]]) -> torch.Tensor:
        """Captions → this decoder's caption token ids ``[B, text_context_length]``."""
        if not self.has_text_encoder:
            raise ValueError(
                "this decoder conditions on CLIP token states (text_encoder: clip); encode "
                "captions with the pipeline's CLIP (encode_text) instead"
            )
        c = self.config
        return caption_tokenizer(c.text_tokenizer, c.text_context_length)(prompts)

    def null_caption(self, batch: int) -> torch.Tensor:
        """The empty caption's token ids repeated ``batch`` times (the unconditional input)."""
        return self.tokenize([""]).expand(batch, -1)

    def caption_ids(self, text, batch: int) -> torch.Tensor:
        """Token ids ``[batch, L]`` for a decoder with its own text encoder from captions (strings),
        ids, or None (the empty caption)."""
        if text is None:
            return self.null_caption(batch)
        if isinstance(text, torch.Tensor):
            return text
        if isinstance(text, TextEncoding):
            raise ValueError(
                "this decoder encodes captions with its own text transformer (text_encoder: "
                "transformer), not CLIP token states; pass the captions as strings"
            )
        return self.tokenize(check_prompts(text))

    def _caption_states(self, text: Caption):
        """Caption token states ``[B, L, W]``, their mask ``[B, L]`` and the pooled caption vector
        added to the time embedding (``L``: the CLIP's context, or for the decoder's own caption
        transformer the batch's longest caption, see :class:`CaptionTransformer`)."""
        if self.text_transformer is None:
            if not isinstance(text, TextEncoding):
                raise TypeError(
                    "this decoder conditions on CLIP token states (text_encoder: clip): pass a "
                    f"TextEncoding (CLIP.encode_text), got {type(text).__name__}"
                )
            text_embed = text.text_embed.to(self.dtype)
            if self.config.embed_scale != 1.0:
                text_embed = text_embed * self.config.embed_scale
            return text.text_tokens, text.text_mask, text_embed
        if not isinstance(text, torch.Tensor) or text.dtype != torch.long:
            raise TypeError(
                "this decoder encodes captions with its own text transformer (text_encoder: "
                "transformer): pass caption token ids from decoder.tokenize(captions), got "
                f"{type(text).__name__}"
            )
        states, mask, final = self.text_transformer(text.to(self.device))
        return states, mask, final

    def condition(
        self,
        image_embed: torch.Tensor,
        text: Caption,
        drop_image: Optional[torch.Tensor] = None,
    ):
        """Context tokens ``[B, n+L, X]``, their mask ``[B, n+L]`` and the additive time
        embedding (``L`` as in :meth:`_caption_states`)."""
        b = image_embed.shape[0]
        image_embed = image_embed.to(self.dtype)
        if drop_image is not None:
            null = self.null_image_embed.to(image_embed).expand(b, -1)
            image_embed = torch.where(
                drop_image.view(b, 1).to(image_embed.device), null, image_embed
            )
        text_tokens, text_mask, text_embed = self._caption_states(text)
        if self.config.embed_scale != 1.0:
            image_embed = image_embed * self.config.embed_scale
        time_add = self.image_to_time(image_embed) + self.text_to_time(text_embed.to(self.dtype))
        n = self.config.num_image_tokens
        tokens = self.image_to_tokens(image_embed).view(b, -1, n).transpose(1, 2)  # [B, n, X]
        mask = torch.ones(b, n, dtype=torch.bool, device=image_embed.device)
        if self.text_tokens_proj is not None and self.text_tokens_norm is not None:  # both or none
            txt = self.text_tokens_norm(self.text_tokens_proj(text_tokens.to(self.dtype)))
            tokens = torch.cat([tokens, txt], dim=1)
            mask = torch.cat([mask, text_mask.to(mask.device).bool()], dim=1)
        return tokens, mask, time_add

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        image_embed: Optional[torch.Tensor] = None,
        text: Optional[Caption] = None,
        drop_image: Optional[torch.Tensor] = None,
        cond: Optional[tuple] = None,
    ) -> torch.Tensor:
        """Predict the target for ``x_t``; pass ``cond`` (from :meth:`condition`) to reuse
        conditioning."""
        if cond is None:
            if image_embed is None or text is None:
                raise TypeError("forward needs image_embed and text, or cond from condition()")
            cond = self.condition(image_embed, text, drop_image)
        tokens, mask, time_add = cond
        x = x_t.to(self.dtype)
        if self.config.coord_channels:
            x = torch.cat([x, coordinate_grid(x)], dim=1)
        return self.unet(
            x,
            t,
            encoder_hidden_states=tokens,
            class_labels=time_add,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]

    @classmethod
    def from_clip(cls, clip, **kwargs) -> UnCLIPDecoder:
        """A decoder sized for ``clip`` (a :class:`~unclip.nets.clip.CLIP`)."""
        return cls(embed_dim=clip.embed_dim, text_width=clip.text_width, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader restricted to safetensors weights (pickles can run code: refused)."""
        from unclip.io.weights import safe_model_from_pretrained

        return safe_model_from_pretrained(
            super().from_pretrained, pretrained_model_name_or_path, "decoder", **kwargs
        )


def encode_captions(config, clip, prompts: Sequence[str]) -> Caption:
    """Captions as a decoder with ``config`` (a :class:`~unclip.nets.config.DecoderConfig` or a
    decoder's ``config``) takes them: ``clip.encode_text`` for ``text_encoder: clip``, else token
    ids from the decoder's tokenizer (what its own text transformer reads)."""
    if getattr(config, "text_encoder", "clip") == "clip":
        return clip.encode_text(prompts)
    return caption_tokenizer(config.text_tokenizer, config.text_context_length)(prompts)


def drop_captions(text: Caption, null: Caption, drop: torch.Tensor) -> Caption:
    """``text [B]`` with the rows where ``drop [B]`` is True replaced by the empty caption ``null``
    (one row, or B), for classifier-free guidance training."""
    if isinstance(text, torch.Tensor) != isinstance(null, torch.Tensor):
        raise TypeError(
            f"drop_captions needs text and null of one kind, got {type(text).__name__} and "
            f"{type(null).__name__}: encode both with encode_captions"
        )
    if isinstance(text, torch.Tensor) and isinstance(null, torch.Tensor):
        return torch.where(drop[:, None], null.to(text.device), text)
    assert isinstance(text, TextEncoding) and isinstance(null, TextEncoding)  # checked above
    null = null.to(device=text.text_mask.device)
    return TextEncoding(
        torch.where(drop[:, None], null.text_embed, text.text_embed),
        torch.where(drop[:, None, None], null.text_tokens, text.text_tokens),
        torch.where(drop[:, None], null.text_mask, text.text_mask),
    )


def _checkpointed_forward(module: torch.nn.Module, *args, **kwargs):
    """The module class's ``forward`` under activation checkpointing while it trains with gradients
    (recomputed in backward; the result and the gradients are unchanged). Bound to an instance as
    its ``forward``: a bound method follows the module through ``copy.deepcopy``."""
    forward = type(module).forward
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, module, *args, module=module, **kwargs)
    return forward(module, *args, **kwargs)


# ignore: diffusers types ModelMixin.to through functools.wraps, its class defaults by None
class UnCLIPUpsampler(KeepFp32Mixin, ModelMixin, ConfigMixin):  # type: ignore[misc]
    """Super-resolution stage ``low_res_size → sample_size``.

    ``forward(x_t [B,3,H,W], t, low_res_up [B,3,H,W], noise_level [B]) → [B,3,H,W]`` where
    ``low_res_up`` is the (corrupted, noised) low-res image already upsampled to ``H×W``.
    ``add_attention``: self-attention in the UNet's mid block (the paper's upsamplers have none),
    in heads of ``attention_head_dim`` channels (diffusers' ``UNet2DModel`` default, 8, also what
    weights saved without the setting were trained with; wider heads compute the same number of
    FLOPs much faster on a CPU, see benchmarks/README.md).
    ``dropout``: in the residual blocks during training (paper: 0.1 in the first upsampler).
    """

    if TYPE_CHECKING:
        # diffusers' FrozenDict of the registered arguments, whose fields it also sets as attributes
        config: Any

    @register_to_config
    def __init__(
        self,
        sample_size: int = 256,
        low_res_size: int = 64,
        block_out_channels: tuple = (320, 640, 960, 1280),
        layers_per_block: int = 3,
        down_block_types: tuple = ("DownBlock2D",) * 4,
        up_block_types: tuple = ("UpBlock2D",) * 4,
        norm_num_groups: int = 32,
        noise_level_conditioning: bool = True,
        noise_level: int = 0,
        final_step_model: bool = False,
        resnet_time_scale_shift: str = "scale_shift",
        add_attention: bool = True,
        clamp_low_res: bool = True,
        dropout: float = 0.0,
        attention_head_dim: int = 8,
    ):
        super().__init__()
        if sample_size <= low_res_size:
            raise ValueError(
                f"upsampler sample_size ({sample_size}) must exceed low_res_size ({low_res_size})"
            )
        width = block_out_channels[-1]
        if add_attention and (attention_head_dim < 1 or width % attention_head_dim):
            raise ValueError(
                f"upsampler attention_head_dim ({attention_head_dim}) must divide the mid block's "
                f"{width} channels (the last of block_out_channels)"
            )

        def make():
            return UNet2DModel(
                sample_size=sample_size,
                in_channels=6,
                out_channels=3,
                down_block_types=tuple(down_block_types),
                up_block_types=tuple(up_block_types),
                block_out_channels=tuple(block_out_channels),
                layers_per_block=layers_per_block,
                norm_num_groups=norm_num_groups,
                class_embed_type="identity" if noise_level_conditioning else None,
                resnet_time_scale_shift=resnet_time_scale_shift,
                add_attention=add_attention,
                attention_head_dim=attention_head_dim,
                dropout=check_dropout(dropout),
            )

        self.unet = make()
        self.final_unet = make() if final_step_model else None
        if noise_level_conditioning:
            # sinusoidal features of the noise level → MLP, added to the time embedding
            self.noise_level_proj = Timesteps(
                block_out_channels[0], flip_sin_to_cos=True, downscale_freq_shift=0
            )
            self.noise_level_embedding = TimestepEmbedding(
                block_out_channels[0], block_out_channels[0] * 4
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader restricted to safetensors weights (pickles can run code: refused)."""
        from unclip.io.weights import safe_model_from_pretrained

        return safe_model_from_pretrained(
            super().from_pretrained, pretrained_model_name_or_path, "upsampler", **kwargs
        )

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        low_res_up: torch.Tensor,
        noise_level: Optional[torch.Tensor] = None,
        final_step: bool = False,
    ) -> torch.Tensor:
        unet = self.final_unet if (final_step and self.final_unet is not None) else self.unet
        x = torch.cat([x_t, low_res_up.to(x_t)], dim=1).to(self.dtype)
        labels = None
        if self.config.noise_level_conditioning:
            if noise_level is None:
                noise_level = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            noise_level = noise_level.to(x.device).reshape(-1).expand(x.shape[0])
            labels = self.noise_level_embedding(self.noise_level_proj(noise_level).to(self.dtype))
        return unet(x, t, class_labels=labels, return_dict=False)[0]


# --------------------------------------------------------------------------------------------------
# low-res conditioning
# --------------------------------------------------------------------------------------------------
def upsample_low_res(low: torch.Tensor, size: int, clamp: bool = True) -> torch.Tensor:
    """Bicubic (antialiased) resize of ``[B, 3, h, w]`` to ``size × size``, clamped to [-1, 1]
    unless ``clamp=False`` (Karlo/diffusers keep the bicubic overshoot)."""
    up = F.interpolate(
        low.float(), size=(size, size), mode="bicubic", align_corners=False, antialias=True
    )
    return up.clamp(-1, 1) if clamp else up


def gaussian_blur(
    x: torch.Tensor, sigma: torch.Tensor, kernel_size: Optional[int] = None
) -> torch.Tensor:
    """Per-sample Gaussian blur of ``x [B, C, H, W]`` with ``sigma [B]`` (pixels; 0 = identity),
    separable, over ``kernel_size`` taps (odd; default: 3σ on each side of the centre, at least
    one), the weights renormalised to sum to 1."""
    if kernel_size is None:
        radius = max(1, int(math.ceil(3 * float(sigma.max()))))
    elif kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd number >= 1, got {kernel_size}")
    else:
        radius = kernel_size // 2
    coords = torch.arange(-radius, radius + 1, dtype=torch.float32, device=x.device)
    s = sigma.to(x.device).float().clamp_min(1e-4).view(-1, 1)
    k = torch.exp(-0.5 * (coords.view(1, -1) / s) ** 2)
    k = k / k.sum(dim=1, keepdim=True)  # [B, K]
    b, c, h, w = x.shape
    y = x.float().reshape(1, b * c, h, w)
    kh = k.repeat_interleave(c, dim=0).view(b * c, 1, 1, -1)
    kv = k.repeat_interleave(c, dim=0).view(b * c, 1, -1, 1)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="reflect"), kh, groups=b * c)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="reflect"), kv, groups=b * c)
    return y.view(b, c, h, w).to(x.dtype)


def degrade(
    high: torch.Tensor,
    low_res_size: int,
    mode: str,
    generators,
    blur_sigma=(0.4, 0.6),
    blur_kernel_size: Optional[int] = None,
) -> torch.Tensor:
    """Training-time low-res conditioning from a high-res crop ``[B, 3, H, W]`` in [-1, 1].

    ``mode="blur"``: antialiased downsample then a Gaussian blur with σ ~ U(blur_sigma) over
    ``blur_kernel_size`` taps (:func:`gaussian_blur`; first upsampler). ``mode="bsr"``: a
    BSR-style chain per sample — blur with random σ, downsample through a random intermediate size
    and interpolation mode, additive Gaussian noise of random strength and a random JPEG-like
    quantisation (second upsampler). ``mode="none"``: downsample only. Random draws come from
    ``generators`` (one per sample). Returns ``[B, 3, low_res_size, low_res_size]``.
    """
    b = high.shape[0]
    low = F.interpolate(
        high.float(),
        size=(low_res_size, low_res_size),
        mode="bicubic",
        antialias=True,
        align_corners=False,
    )
    if mode == "none":
        return low.clamp(-1, 1)
    u = torch.stack([torch.rand(6, generator=g) for g in generators])  # [B, 6]
    if mode == "blur":
        lo, hi = blur_sigma
        return gaussian_blur(low, lo + (hi - lo) * u[:, 0], blur_kernel_size).clamp(-1, 1)
    if mode != "bsr":
        raise ValueError(f"unknown low-res corruption {mode!r}; use blur, bsr or none")
    out = []
    for i in range(b):
        x = high[i : i + 1].float()
        x = gaussian_blur(x, (0.2 + 2.8 * u[i, 0]).view(1) * (x.shape[-1] / low_res_size) ** 0.5)
        mid = int(low_res_size * (1.0 + 1.0 * float(u[i, 1])))
        mode_i = ("bilinear", "bicubic", "area")[int(u[i, 2] * 3) % 3]
        kw = {"align_corners": False} if mode_i != "area" else {}
        x = F.interpolate(x, size=(mid, mid), mode=mode_i, **kw)
        x = F.interpolate(
            x,
            size=(low_res_size, low_res_size),
            mode="bicubic",
            antialias=True,
            align_corners=False,
        )
        g = generators[i]
        x = x + (float(u[i, 3]) * 0.1) * torch.randn(x.shape, generator=g)
        levels = 16 + int(u[i, 4] * 240)  # coarse colour quantisation, a cheap stand-in for JPEG
        x = torch.round((x.clamp(-1, 1) + 1) / 2 * levels) / levels * 2 - 1
        out.append(x)
    return torch.cat(out).clamp(-1, 1)
