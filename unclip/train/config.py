"""Training configuration: one :class:`StageConfig` per training run of one stage.

A stage config is the architecture and sampling sections (:mod:`unclip.nets.config`,
:mod:`unclip.sampling.settings`) plus what only
training needs: the data (:class:`DataConfig`), the optimisation recipe (:class:`TrainConfig`) and,
for an upsampler, how its low-res conditioning is made (:class:`UpsamplerTrainConfig`). It is a YAML
file plus dotted command-line overrides such as ``train.lr=3e-4``, loaded strictly.

Example::

    from unclip.train.config import load_stage_config
    from unclip.utils.config import to_yaml
    cfg = load_stage_config("configs/tiny/prior.yaml", ["train.lr=3e-4", "data.batch_size=4"])
    print(to_yaml(cfg))
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, TypeVar

from unclip.diffusion.config import DiffusionConfig
from unclip.nets.clip import ClipConfig
from unclip.nets.config import DecoderConfig, PriorConfig, UpsamplerConfig
from unclip.sampling.settings import sampling_for
from unclip.train.optimizers import OPTIMIZERS, PRECONDITIONED
from unclip.utils.config import ConfigError, load_config

__all__ = [
    "DataConfig",
    "LoraTrainConfig",
    "TrainConfig",
    "UpsamplerTrainConfig",
    "RepaConfig",
    "StageConfig",
    "STAGES",
    "load_stage_config",
    "check_range",
    "check_at_least",
    "check_probability",
    "check_decoder_options",
    "load_config_naming_source",
]

STAGES = ("prior", "decoder", "upsampler")

#: the settings of :class:`TrainConfig` that only the preconditioned optimizers (soap, kl_shampoo)
#: take
PRECONDITIONER_KEYS = (
    "precondition_frequency",
    "shampoo_beta",
    "max_precond_dim",
    "precondition_1d",
    "optimizer_compile",
)


def check_range(key: str, value, ok: bool, valid: str) -> None:
    """Raise :class:`ConfigError` ``"<key> must be <valid>, got <value>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} must be {valid}, got {value!r}")


def check_at_least(key: str, value, low) -> None:
    check_range(key, value, value >= low, f"an integer >= {low}")


def check_probability(key: str, value) -> None:
    check_range(key, value, 0.0 <= value <= 1.0, "a probability in [0, 1]")


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
    ``clip_view`` (base decoder): which image the decoder's CLIP image embedding is computed from
    when the sample has no precomputed ``image_embed``: ``training_image`` (the image at
    ``resolution``, enlarged to the CLIP's input size) or ``full`` (the paper's: the original
    image resized and centre-cropped to the CLIP's input size, the view the prior learns from).
    Precomputed embeddings (``embeddings_path``) are of the original images and always win.
    ``allow_pipe``: a ``pipe:`` URL in ``path`` runs its shell command, so a config naming one is
    refused unless this is true (a config file from elsewhere must not run commands unasked).
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
    clip_view: Literal["training_image", "full"] = "training_image"
    allow_pipe: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Range-check every number (:class:`ConfigError` naming the key and the valid range)."""
        check_at_least("data.resolution", self.resolution, 1)
        check_at_least("data.batch_size", self.batch_size, 1)
        check_at_least("data.num_workers", self.num_workers, 0)
        check_at_least("data.shuffle_buffer", self.shuffle_buffer, 0)
        check_at_least("data.shapes_seed", self.shapes_seed, 0)
        check_probability("data.shapes_two_object_prob", self.shapes_two_object_prob)
        if self.shapes_resolution is not None:
            check_at_least("data.shapes_resolution", self.shapes_resolution, 1)
        pipes = [u for u in str(self.path or "").split("::") if u.strip().startswith("pipe:")]
        if pipes and not self.allow_pipe:
            raise ConfigError(
                f"data.path {pipes[0]!r} is a pipe: URL, which runs a shell command: set "
                "data.allow_pipe=true if you trust this config, or give the shards' paths"
            )


@dataclass
class LoraTrainConfig:
    """LoRA fine-tuning (``train.lora``, :mod:`unclip.train.lora`): the stage's network starts from
    ``train.init_weights`` and stays frozen; a low-rank update ``(alpha / rank) · B A`` beside each
    layer named by ``target_modules`` is all that trains (needs peft: ``pip install
    'unclip[lora]'``). The run exports ``<output_dir>/final/<stage>_lora`` (adapter weights only).

    ``rank`` (required): the rank of each update. ``alpha``: its scale numerator (default: the
    rank, i.e. scale 1). ``dropout``: on the adapters' input during training. ``target_modules``:
    layer names, each matched against the end of the layers' names (``to_q`` matches every
    ``....to_q``); default: the attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``,
    and for the decoder ``add_k_proj``/``add_v_proj``, through which it reads the caption).
    """

    rank: int
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Range-check every value (:class:`ConfigError` naming the key); that the targets name
        layers of the network is checked when it is built (:mod:`unclip.train.lora`)."""
        check_at_least("train.lora.rank", self.rank, 1)
        if self.alpha is not None:
            check_range(
                "train.lora.alpha",
                self.alpha,
                0 < self.alpha < math.inf,
                "a positive number (default: the rank)",
            )
        check_range("train.lora.dropout", self.dropout, 0 <= self.dropout < 1, "in [0, 1)")
        targets = self.target_modules
        if targets is not None:
            check_range(
                "train.lora.target_modules",
                targets,
                bool(targets)
                and all(isinstance(t, str) and t.strip() for t in targets)
                and len(set(targets)) == len(targets),
                "a non-empty list of distinct layer names such as [to_q, to_k, to_v, to_out.0] "
                "(leave it out for the stage's attention projections)",
            )


@dataclass
class TrainConfig:
    """The optimisation recipe: AdamW, linear warmup then cosine decay to ``min_lr``, clipping, EMA.

    ``grad_accum_steps`` micro-batches of ``data.batch_size`` per process make one optimizer step.
    ``powersgd_rank > 0`` compresses DDP gradients with PowerSGD of that rank (Accelerate's DDP comm
    hook) after ``powersgd_start_step`` steps of plain all-reduce. ``max_consecutive_nonfinite``:
    training stops after that many optimizer steps in a row were skipped for a non-finite loss or
    gradient. ``init_weights``: start from these weights instead of a random initialisation
    (fine-tuning): a component folder (e.g. ``final/decoder`` of an earlier run, or ``decoder/`` of
    a pipeline folder) or a ``.safetensors`` file; the model config must match, unless
    ``init_weights_partial``: then the tensors that fit by name and shape are loaded and the rest
    keep their fresh initialisation (e.g. a decoder given its own caption transformer, fine-tuned
    from one that read CLIP token states; the log lists what was left out). ``--resume`` still
    wins: a checkpoint, when one is found, replaces them. ``sample_every``: write a grid of samples
    from the EMA weights to ``samples/`` every that many steps (stages that have a sample grid; 0:
    never). ``optimizer``: ``adamw`` (torch), ``adamw8bit`` (bitsandbytes' 8-bit AdamW: its
    moments take a quarter of the memory; GPU only, ``pip install bitsandbytes``), ``soap`` or
    ``kl_shampoo`` (heavyball's SOAP and KL-Shampoo, ``pip install 'unclip[optim]'``; see
    :mod:`unclip.train.optimizers`), which also take ``precondition_frequency`` (steps between
    refreshes of the preconditioner), ``shampoo_beta`` (running average of its Kronecker factors),
    ``max_precond_dim`` (larger dimensions are not preconditioned), ``precondition_1d`` and
    ``optimizer_compile`` (heavyball's ``torch.compile`` of the update; off: eager). The betas,
    epsilon and weight decay are ``adam_betas``, ``adam_eps`` and ``weight_decay`` for every
    optimizer. ``resblock_grad_scaling`` (decoder and upsamplers): DALL-E's per-resblock gradient
    scaling, a separate gradient scale for each residual block, adapted to its own overflows
    (:mod:`unclip.train.grad_scaling`; docs/training_tricks.md).
    ``powersgd_rank`` applies to DDP launches; an overflowing fp16 step does not disturb its
    error feedback (:func:`unclip.train.distributed.nonfinite_safe_powersgd_hook`).
    ``text_cache_mb`` (priors): megabytes of the frozen CLIP's caption encodings kept between steps,
    so that a caption seen again is not encoded again (exact: :mod:`unclip.train.text_cache`);
    0 turns it off.
    ``lora`` (:class:`LoraTrainConfig`): train a LoRA adapter of ``init_weights`` (required then)
    instead of every weight.
    """

    output_dir: str = "runs/experiment"
    seed: int = 0
    init_weights: Optional[str] = None
    init_weights_partial: bool = False
    max_steps: int = 100_000
    optimizer: Literal["adamw", "adamw8bit", "soap", "kl_shampoo"] = "adamw"
    # SOAP's paper and DALL-E Mega's Shampoo refresh the preconditioner every 10 steps; the other
    # preconditioner defaults are heavyball's
    precondition_frequency: int = 10
    shampoo_beta: float = 0.95
    max_precond_dim: int = 2048
    precondition_1d: bool = False
    optimizer_compile: bool = False
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
    text_cache_mb: float = 256.0
    gradient_checkpointing: bool = False
    resblock_grad_scaling: bool = False
    powersgd_rank: int = 0
    powersgd_start_step: int = 1000
    checkpoint_every: int = 1000
    keep_last: int = 3
    log_every: int = 10
    sample_every: int = 0
    max_consecutive_nonfinite: int = 20
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    progress: bool = True
    lora: Optional[LoraTrainConfig] = None
    #: whether the run's starting weights come from elsewhere than ``init_weights`` (a Kandinsky
    #: run's ``kandinsky.pretrained``), so that an adapter has trained weights to adapt without it
    weights_named_elsewhere: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Range-check every number (:class:`ConfigError` naming the key and the valid range).
        ``checkpoint_every: 0`` checkpoints at the end of the run only; ``sample_every: 0`` never
        samples; ``powersgd_rank: 0`` turns PowerSGD off."""
        check_range("train.seed", self.seed, 0 <= self.seed < 2**63, "an integer in [0, 2**63)")
        check_at_least("train.max_steps", self.max_steps, 1)
        check_range(
            "train.optimizer",
            self.optimizer,
            self.optimizer in OPTIMIZERS,
            "adamw, adamw8bit (8-bit AdamW from bitsandbytes, for GPUs), soap or kl_shampoo "
            "(heavyball)",
        )
        check_range(
            "train.text_cache_mb",
            self.text_cache_mb,
            0 <= self.text_cache_mb < math.inf,
            "a number of megabytes >= 0 (0: off)",
        )
        check_at_least("train.precondition_frequency", self.precondition_frequency, 1)
        check_range(
            "train.shampoo_beta", self.shampoo_beta, 0 <= self.shampoo_beta < 1, "in [0, 1)"
        )
        check_at_least("train.max_precond_dim", self.max_precond_dim, 1)
        if self.optimizer not in PRECONDITIONED:
            for key in PRECONDITIONER_KEYS:
                if getattr(self, key) != TrainConfig.__dataclass_fields__[key].default:
                    raise ConfigError(
                        f"train.{key}={getattr(self, key)!r} applies to train.optimizer soap or "
                        f"kl_shampoo only (the optimizer is {self.optimizer}); remove it"
                    )
        check_range(
            "train.lr", self.lr, 0 < self.lr < math.inf, "a positive finite number (e.g. 1e-4)"
        )
        check_range(
            "train.min_lr",
            self.min_lr,
            0 <= self.min_lr <= self.lr,
            f"a number in [0, train.lr = {self.lr}]",
        )
        check_at_least("train.warmup_steps", self.warmup_steps, 0)
        check_range(
            "train.weight_decay",
            self.weight_decay,
            0 <= self.weight_decay < math.inf,
            "a finite number >= 0",
        )
        check_range(
            "train.adam_betas",
            self.adam_betas,
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            "two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        check_range(
            "train.adam_eps", self.adam_eps, 0 < self.adam_eps < math.inf, "a positive number"
        )
        check_at_least("train.grad_accum_steps", self.grad_accum_steps, 1)
        check_range(
            "train.max_grad_norm",
            self.max_grad_norm,
            self.max_grad_norm > 0,
            "a positive number (inf: no clipping)",
        )
        check_range("train.ema_decay", self.ema_decay, 0 <= self.ema_decay < 1, "in [0, 1)")
        check_probability("train.text_drop_prob", self.text_drop_prob)
        check_probability("train.image_embed_drop_prob", self.image_embed_drop_prob)
        check_at_least("train.powersgd_rank", self.powersgd_rank, 0)
        check_at_least("train.powersgd_start_step", self.powersgd_start_step, 0)
        check_at_least("train.checkpoint_every", self.checkpoint_every, 0)
        check_at_least("train.keep_last", self.keep_last, 1)
        check_at_least("train.log_every", self.log_every, 1)
        check_at_least("train.sample_every", self.sample_every, 0)
        check_at_least("train.max_consecutive_nonfinite", self.max_consecutive_nonfinite, 1)
        if self.init_weights_partial and not self.init_weights:
            raise ConfigError(
                "train.init_weights_partial applies to train.init_weights, which is not set; set "
                "both or neither"
            )
        if self.lora is not None and self.init_weights_partial:
            raise ConfigError(
                "train.lora freezes the loaded weights, so tensors a partial train.init_weights "
                "leaves fresh would never train; fine-tune with init_weights_partial first, then "
                "train an adapter of the result"
            )
        if self.lora is not None:
            self.lora.validate()
            if not self.init_weights and not self.weights_named_elsewhere:
                raise ConfigError(
                    "train.lora adapts trained weights: set train.init_weights to the component "
                    "to adapt (a component folder such as unclip/bundled/shapes/decoder, or a "
                    ".safetensors file)"
                )


@dataclass
class UpsamplerTrainConfig:
    """How an upsampler's training inputs are made (paper §2.1 and appendix; Ho et al. 2021).

    Each training image is cropped to ``crop_size`` (default: the upsampler's ``sample_size``; the
    network is fully convolutional, so it samples at full size), downsampled by the upsampler's
    ``sample_size / low_res_size`` and corrupted (``corruption``: ``blur``, a Gaussian blur with σ
    drawn from ``blur_sigma`` over ``blur_kernel_size`` taps (odd; default 3σ each side of the
    centre: 5 taps at σ 0.4–0.6; the paper's is σ 0.6 with 3), first upsampler; ``bsr``,
    BSR-style degradation, second upsampler;
    ``none``), then noised to a random level in ``[0, max_noise_level]`` that the network is told.
    """

    crop_size: Optional[int] = None
    corruption: Literal["blur", "bsr", "none"] = "blur"
    blur_sigma: list[float] = field(default_factory=lambda: [0.4, 0.6])
    blur_kernel_size: Optional[int] = None
    max_noise_level: int = 250

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Range-check every number (:class:`ConfigError` naming the key and the valid range); the
        noise level is checked against the diffusion schedule by :class:`StageConfig`."""
        if self.crop_size is not None:
            check_at_least("upsampler_train.crop_size", self.crop_size, 1)
        check_range(
            "upsampler_train.blur_sigma",
            self.blur_sigma,
            len(self.blur_sigma) == 2 and 0 <= self.blur_sigma[0] <= self.blur_sigma[1],
            "[low, high] with 0 <= low <= high",
        )
        if self.blur_kernel_size is not None:
            check_range(
                "upsampler_train.blur_kernel_size",
                self.blur_kernel_size,
                self.blur_kernel_size >= 1 and self.blur_kernel_size % 2 == 1,
                "an odd number >= 1, or null for 3 sigma on each side",
            )
        check_at_least("upsampler_train.max_noise_level", self.max_noise_level, 0)


@dataclass
class RepaConfig:
    """Representation alignment of the base decoder to the frozen CLIP's image tower
    (:mod:`unclip.train.repa`): the loss adds ``weight · (1 − cosine)`` between a projection of
    the UNet block ``decoder_layer``'s features (computed on ``x_t``) and the CLIP layer
    ``clip_layer``'s features of the clean image. ``hidden``: width of the 3-layer projection head
    (trained with the decoder, not exported)."""

    weight: float = 0.5
    decoder_layer: str = "mid_block"
    clip_layer: str = "layer2"
    hidden: int = 256

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_range(
            "repa.weight", self.weight, 0 < self.weight < math.inf, "a positive finite number"
        )
        check_at_least("repa.hidden", self.hidden, 1)
        for key in ("decoder_layer", "clip_layer"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"repa.{key} must name a module, got {getattr(self, key)!r}")


@dataclass
class StageConfig:
    """One training run of one stage: ``prior``, ``decoder`` (base) or ``upsampler``.

    The section named by ``stage`` describes the network; ``upsampler_train`` applies to the
    ``upsampler`` stage only (its defaults are used when the section is left out); ``repa``
    (:class:`RepaConfig`) to the ``decoder`` stage only (off when left out).
    """

    stage: Literal["prior", "decoder", "upsampler"] = "prior"
    clip: ClipConfig = field(default_factory=ClipConfig)
    prior: Optional[PriorConfig] = None
    decoder: Optional[DecoderConfig] = None
    upsampler: Optional[UpsamplerConfig] = None
    upsampler_train: Optional[UpsamplerTrainConfig] = None
    repa: Optional[RepaConfig] = None
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: the stage's sampling settings (its sample grids, and the defaults it exports): a mapping
    #: in the file, the stage's own settings type after loading (unclip.sampling.settings)
    sampling: Any = None

    def __post_init__(self) -> None:
        if getattr(self, self.stage) is None:
            raise ConfigError(
                f"stage is {self.stage!r} but the config has no '{self.stage}:' section; "
                f"add one (see configs/tiny/{self.stage}.yaml for an example)"
            )
        ar = self.stage == "prior" and getattr(self.prior, "type", None) == "ar"
        try:
            self.sampling = sampling_for(self.stage, self.sampling, ar=ar, where="sampling")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if self.upsampler_train is not None and self.stage != "upsampler":
            raise ConfigError(
                f"'upsampler_train:' applies to stage 'upsampler' only, but stage is "
                f"{self.stage!r}; remove the section"
            )
        if self.repa is not None and self.stage != "decoder":
            raise ConfigError(
                f"'repa:' aligns the base decoder's features to the CLIP's; stage is "
                f"{self.stage!r}: remove the section"
            )
        if self.repa is not None and self.train.lora is not None:
            raise ConfigError(
                "'repa:' and train.lora are not supported together (the adapter's training and "
                "export do not handle the alignment head); use one or the other"
            )
        if self.stage == "upsampler" and self.upsampler_train is None:
            self.upsampler_train = UpsamplerTrainConfig()
        check_decoder_options(self)
        if self.upsampler_train is not None:
            steps = self.diffusion.num_train_timesteps
            level = self.upsampler_train.max_noise_level
            check_range(
                "upsampler_train.max_noise_level",
                level,
                level < steps,
                f"in [0, diffusion.num_train_timesteps - 1 = {steps - 1}]",
            )

    @property
    def model(self):
        """The model section of this stage."""
        return getattr(self, self.stage)

    # the sections a stage's code reads, present (the stage's own is checked when loading)
    @property
    def prior_section(self) -> PriorConfig:
        return _present(self.prior, "prior")

    @property
    def decoder_section(self) -> DecoderConfig:
        return _present(self.decoder, "decoder")

    @property
    def upsampler_section(self) -> UpsamplerConfig:
        return _present(self.upsampler, "upsampler")

    @property
    def upsampler_train_section(self) -> UpsamplerTrainConfig:
        return _present(self.upsampler_train, "upsampler_train")


_Section = TypeVar("_Section")


def _present(section: Optional[_Section], name: str) -> _Section:
    if section is None:
        raise ConfigError(f"the config has no '{name}:' section; add one")
    return section


def check_decoder_options(cfg: StageConfig) -> None:
    """The settings that only make sense together: a learned decoder variance and the hybrid loss
    that trains it (``diffusion.vlb_weight``), the decoder's CLIP view (``data.clip_view``), and
    per-resblock gradient scaling (``train.resblock_grad_scaling``: UNet stages only)."""
    learned = cfg.stage == "decoder" and cfg.decoder_section.learned_variance
    weight = cfg.diffusion.vlb_weight
    if weight > 0 and not learned:
        raise ConfigError(
            f"diffusion.vlb_weight={weight} trains a learned variance, which only the base "
            f"decoder has (decoder.learned_variance=true); stage {cfg.stage!r} "
            + (
                "has a fixed variance: set decoder.learned_variance=true or "
                if cfg.stage == "decoder"
                else "has none: "
            )
            + "set diffusion.vlb_weight=0"
        )
    if learned and weight == 0:
        raise ConfigError(
            "decoder.learned_variance=true needs diffusion.vlb_weight > 0 (the paper's hybrid "
            "loss uses 0.001): without it the variance half of the output is never trained"
        )
    if cfg.train.resblock_grad_scaling and cfg.stage == "prior":
        raise ConfigError(
            "train.resblock_grad_scaling applies to the decoder and upsampler stages (the "
            "residual blocks of their UNets); stage 'prior' has none: remove it"
        )
    if cfg.data.clip_view != "training_image" and cfg.stage != "decoder":
        raise ConfigError(
            f"data.clip_view={cfg.data.clip_view!r} applies to stage 'decoder' only (stage "
            f"{cfg.stage!r} computes no decoder image embedding); remove it"
        )


def load_config_naming_source(path, overrides, schema):
    """:func:`unclip.utils.config.load_config`, with the file named in the range errors of the
    training sections too (they are raised where the values enter, which does not know the file)."""
    try:
        return load_config(path, overrides, schema=schema)
    except ConfigError as exc:
        where = "<dict>" if isinstance(path, dict) else "<defaults>" if path is None else str(path)
        if where in str(exc):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def load_stage_config(
    path: str | os.PathLike | dict | None,
    overrides: list[str] | tuple[str, ...] = (),
    stages: tuple[str, ...] = STAGES,
) -> StageConfig:
    """Load a stage config (YAML file or dict) with dotted ``overrides``, strictly.

    ``stages``: the stages the caller trains; a config of another stage is a ``ValueError``.
    """
    cfg = load_config_naming_source(path, overrides, StageConfig)
    if cfg.stage not in stages:
        raise ValueError(
            f"{path}: stage is {cfg.stage!r} but this command trains {' or '.join(stages)}"
        )
    return cfg
