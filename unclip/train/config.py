"""Training configuration: one :class:`StageConfig` per training run of one stage.

A stage config is the architecture and sampling sections of :mod:`unclip.config` plus what only
training needs: the data (:class:`DataConfig`), the optimisation recipe (:class:`TrainConfig`) and,
for an upsampler, how its low-res conditioning is made (:class:`UpsamplerTrainConfig`). It is a YAML
file plus dotted command-line overrides such as ``train.lr=3e-4``, loaded strictly.

Example::

    from unclip.config import to_yaml
    from unclip.train.config import load_stage_config
    cfg = load_stage_config("configs/tiny/prior.yaml", ["train.lr=3e-4", "data.batch_size=4"])
    print(to_yaml(cfg))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from unclip.config import (
    ClipConfig,
    ConfigError,
    DecoderConfig,
    DiffusionConfig,
    PriorConfig,
    SamplingConfig,
    UpsamplerConfig,
    load_config,
)

__all__ = [
    "DataConfig",
    "TrainConfig",
    "UpsamplerTrainConfig",
    "StageConfig",
    "STAGES",
    "load_stage_config",
]

STAGES = ("prior", "decoder", "upsampler")


@dataclass
class DataConfig:
    """Where training pairs come from.

    ``source``: ``shapes`` (generated on the fly), ``folder`` (images + same-stem ``.txt``
    captions),
    ``webdataset`` (img2dataset tar shards, local paths, brace patterns or ``pipe:`` URLs) or
    ``embeddings`` (precomputed ``.npy`` shards written by ``unclip embed``; prior only).
    ``embeddings_path``: with ``source`` ``webdataset`` or ``folder``, the ``unclip embed`` output
    for exactly those images; each sample then carries its precomputed
    ``image_embed``/``text_embed`` (matched by key, tar shard ``i`` ↔ embedding shard ``i``) instead
    of running CLIP on it, and the shards are checked to line up (``ValueError`` naming the shard
    and key otherwise); see :mod:`unclip.train.data.paired`.
    """

    source: Literal["shapes", "folder", "webdataset", "embeddings"] = "shapes"
    path: Optional[str] = None
    embeddings_path: Optional[str] = None
    resolution: int = 64
    batch_size: int = 8
    num_workers: int = 0
    shuffle_buffer: int = 1000
    shapes_seed: int = 0
    shapes_split: Literal["train", "heldout", "all"] = "train"
    shapes_two_object_prob: float = 0.3
    shapes_resolution: Optional[int] = None


@dataclass
class TrainConfig:
    """The optimisation recipe: AdamW, linear warmup then cosine decay to ``min_lr``, clipping, EMA.

    ``grad_accum_steps`` micro-batches of ``data.batch_size`` per process make one optimizer step.
    ``powersgd_rank > 0`` compresses DDP gradients with PowerSGD of that rank (Accelerate's DDP comm
    hook) after ``powersgd_start_step`` steps of plain all-reduce. ``max_consecutive_nonfinite``:
    training stops after that many optimizer steps in a row were skipped for a non-finite loss or
    gradient. ``init_weights``: start from these weights instead of a random initialisation
    (fine-tuning): a component folder (e.g. ``final/decoder`` of an earlier run, or ``decoder/`` of
    a pipeline folder) or a ``.safetensors`` file; the model config must match. ``--resume`` still
    wins: a checkpoint, when one is found, replaces them. ``sample_every``: write a grid of samples
    from the EMA weights to ``samples/`` every that many steps (stages that have a sample grid; 0:
    never).
    """

    output_dir: str = "runs/experiment"
    seed: int = 0
    init_weights: Optional[str] = None
    max_steps: int = 100_000
    lr: float = 1.1e-4
    min_lr: float = 1e-6
    warmup_steps: int = 10_000
    weight_decay: float = 0.06
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.96])
    adam_eps: float = 1e-8
    grad_accum_steps: int = 8
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = "auto"
    ema: bool = True
    ema_decay: float = 0.9999
    ema_warmup: bool = True
    text_drop_prob: float = 0.1
    image_embed_drop_prob: float = 0.1
    gradient_checkpointing: bool = False
    powersgd_rank: int = 0
    powersgd_start_step: int = 1000
    checkpoint_every: int = 1000
    keep_last: int = 3
    log_every: int = 10
    sample_every: int = 0
    max_consecutive_nonfinite: int = 20
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    progress: bool = True


@dataclass
class UpsamplerTrainConfig:
    """How an upsampler's training inputs are made (paper §2.1 and appendix; Ho et al. 2021).

    Each training image is cropped to ``crop_size`` (default: the upsampler's ``sample_size``; the
    network is fully convolutional, so it samples at full size), downsampled by the upsampler's
    ``sample_size / low_res_size`` and corrupted (``corruption``: ``blur``, a Gaussian blur with σ
    drawn from ``blur_sigma``, first upsampler; ``bsr``, BSR-style degradation, second upsampler;
    ``none``), then noised to a random level in ``[0, max_noise_level]`` that the network is told.
    """

    crop_size: Optional[int] = None
    corruption: Literal["blur", "bsr", "none"] = "blur"
    blur_sigma: list[float] = field(default_factory=lambda: [0.4, 0.6])
    max_noise_level: int = 250


@dataclass
class StageConfig:
    """One training run of one stage: ``prior``, ``decoder`` (base) or ``upsampler``.

    The section named by ``stage`` describes the network; ``upsampler_train`` applies to the
    ``upsampler`` stage only (its defaults are used when the section is left out).
    """

    stage: Literal["prior", "decoder", "upsampler"] = "prior"
    clip: ClipConfig = field(default_factory=ClipConfig)
    prior: Optional[PriorConfig] = None
    decoder: Optional[DecoderConfig] = None
    upsampler: Optional[UpsamplerConfig] = None
    upsampler_train: Optional[UpsamplerTrainConfig] = None
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if getattr(self, self.stage) is None:
            raise ConfigError(
                f"stage is {self.stage!r} but the config has no '{self.stage}:' section; "
                f"add one (see configs/tiny/{self.stage}.yaml for an example)"
            )
        if self.upsampler_train is not None and self.stage != "upsampler":
            raise ConfigError(
                f"'upsampler_train:' applies to stage 'upsampler' only, but stage is "
                f"{self.stage!r}; remove the section"
            )
        if self.stage == "upsampler" and self.upsampler_train is None:
            self.upsampler_train = UpsamplerTrainConfig()

    @property
    def model(self):
        """The model section of this stage."""
        return getattr(self, self.stage)


def load_stage_config(
    path: str | os.PathLike | dict | None,
    overrides: list[str] | tuple[str, ...] = (),
    stages: tuple[str, ...] = STAGES,
) -> StageConfig:
    """Load a stage config (YAML file or dict) with dotted ``overrides``, strictly.

    ``stages``: the stages the caller trains; a config of another stage is a ``ValueError``.
    """
    cfg = load_config(path, overrides, schema=StageConfig)
    if cfg.stage not in stages:
        raise ValueError(
            f"{path}: stage is {cfg.stage!r} but this command trains {' or '.join(stages)}"
        )
    return cfg
