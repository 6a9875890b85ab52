"""Training configs of the token families: an image tokenizer run (``unclip train-tokenizer``) and
a token transformer run over a frozen tokenizer's codes (``unclip train-tokens``).

    tokenizer: {type: dvae, dvae: {image_size: 32, num_codes: 64, n_hid: 16}}
    data: {source: shapes, resolution: 32, batch_size: 8}
    train: {output_dir: runs/tiny-dvae, max_steps: 20, ...}

    transformer: {type: dalle, dalle: {num_layers: 2, width: 32, ...}}
    tokenizer: runs/tiny-dvae/final/tokenizer
    data: ...; train: ...; sampling: {temperature: 1.0, candidates: 1}

Both reuse :class:`~unclip.train.config.DataConfig` and :class:`~unclip.train.config.TrainConfig`
(the loop, optimizers, checkpoints and resume of every stage). ``data.resolution`` must be the
tokenizer's ``image_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from unclip.nets.token_components import TokenizerConfig, TokenModelConfig
from unclip.nets.vqgan import PerceptualLoss
from unclip.sampling.tokens import TokenSampling
from unclip.train.config import (
    DataConfig,
    TrainConfig,
    check_range,
    load_config_naming_source,
)
from unclip.utils.config import ConfigError

__all__ = [
    "TokenizerTrainConfig",
    "TokenModelTrainConfig",
    "load_tokenizer_train_config",
    "load_token_model_train_config",
]


def _check_data(data: DataConfig, image_size: int, what: str) -> None:
    if data.source == "embeddings":
        raise ConfigError(f"data.source 'embeddings' holds no images; {what} trains on images")
    if data.resolution != image_size:
        raise ConfigError(
            f"data.resolution={data.resolution} but the {what} works at {image_size} px; set "
            f"data.resolution={image_size}"
        )


@dataclass
class TokenizerTrainConfig:
    """``unclip train-tokenizer``: the tokenizer, its data and optimisation. The dVAE's
    relaxation temperature anneals from 1 to ``tau_end`` and its KL weight rises from 0 to
    ``kl_weight_end`` on the paper's schedule scaled to ``train.max_steps``
    (:func:`unclip.nets.dvae.dvae_schedule`), or over ``tau_steps`` / ``kl_steps`` steps when
    set: scaled to a short run the paper's spans shrink to a few steps, too few for the network
    to learn before the relaxation hardens or the KL term pulls the codes to uniform. The step
    size follows ``train.lr`` and its warmup–cosine schedule, as in every stage."""

    tokenizer: TokenizerConfig = field(default_factory=lambda: TokenizerConfig("dvae"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tau_end: float = 1 / 16
    kl_weight_end: float = 6.6
    tau_steps: Optional[int] = None
    kl_steps: Optional[int] = None

    def __post_init__(self) -> None:
        _check_data(self.data, self.tokenizer.model.image_size, "tokenizer")
        check_range("tau_end", self.tau_end, 0 < self.tau_end <= 1, "in (0, 1]")
        check_range(
            "kl_weight_end",
            self.kl_weight_end,
            0 <= self.kl_weight_end < math.inf,
            "a finite number >= 0",
        )
        for name in ("tau_steps", "kl_steps"):
            value = getattr(self, name)
            ok = value is None or (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            )
            check_range(name, value, ok, "an integer >= 1 or null")
        vqgan = self.tokenizer.vqgan  # set when type is vqgan (TokenizerConfig checks)
        if self.tokenizer.type == "vqgan" and vqgan is not None and vqgan.perceptual_weights:
            # a config error before the run claims its folder (only the file's header is read)
            PerceptualLoss.check_file(
                vqgan.perceptual_weights, "tokenizer.vqgan.perceptual_weights"
            )
        if self.tokenizer.type == "vqgan" and vqgan is not None and vqgan.discriminator_weights:
            raise ConfigError(
                "tokenizer.vqgan.discriminator_weights: the adversarial term needs the "
                "discriminator's own optimizer step, which train-tokenizer does not run; leave "
                "it null (the perceptual term, perceptual_weights, is supported)"
            )


@dataclass
class TokenModelTrainConfig:
    """``unclip train-tokens``: a token transformer over the codes of the frozen tokenizer in
    folder ``tokenizer`` (``<run>/final/tokenizer`` of ``unclip train-tokenizer``) and the
    captions' BPE ids. ``train.text_drop_prob``: the share of captions replaced by the empty one
    (trains super-conditioning; DALL-E Mega used it, DALL-E did not: set 0). ``sampling``: the
    exported pipeline's defaults. ``rerank_clip``: a CLIP folder shipped with the pipeline to
    rerank ``sampling.candidates`` (e.g. ``unclip/bundled/shapes/clip``; null: none).
    ``upsamplers``: upsampler folders the exported pipeline runs after the tokenizer decoder, in
    order (e.g. ``[unclip/bundled/shapes/sr64, unclip/bundled/shapes/sr128]`` for 32 → 128 px;
    each copied into the pipeline folder with its settings); empty: none.
    ``tokenizer_sha256``: the SHA-256 of the tokenizer's weights file, which ``train-tokens``
    fills in when it starts, so the run's ``config.yaml`` and every checkpoint's record which
    tokenizer the codes came from and a resume over another one is refused; a value given here
    must match the tokenizer's (null: any)."""

    transformer: TokenModelConfig = field(default_factory=lambda: TokenModelConfig("dalle"))
    tokenizer: str = "runs/tokenizer/final/tokenizer"
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sampling: TokenSampling = field(default_factory=TokenSampling)
    rerank_clip: Optional[str] = None
    upsamplers: list[str] = field(default_factory=list)
    tokenizer_sha256: Optional[str] = None

    def __post_init__(self) -> None:
        value = self.tokenizer_sha256
        ok = value is None or (
            isinstance(value, str)
            and len(value) == 64
            and all(c in "0123456789abcdef" for c in value)
        )
        check_range("tokenizer_sha256", value, ok, "64 lowercase hex digits or null")


def load_tokenizer_train_config(path, overrides=()) -> TokenizerTrainConfig:
    """Load and check a ``train-tokenizer`` config (YAML file or dict) with dotted overrides."""
    return load_config_naming_source(path, overrides, TokenizerTrainConfig)


def load_token_model_train_config(path, overrides=()) -> TokenModelTrainConfig:
    """Load and check a ``train-tokens`` config (YAML file or dict) with dotted overrides."""
    return load_config_naming_source(path, overrides, TokenModelTrainConfig)
