"""Configuration schemas and a strict YAML loader.

Every training run is described by one :class:`StageConfig` (a YAML file plus dotted command-line
overrides such as ``train.lr=3e-4``). Loading is strict: an unknown or misspelt key is an error that
names the key, the file and the closest valid key; values are type-checked; the resolved config is
printable (:func:`to_yaml`) and saved beside every checkpoint (:func:`save_config`).

Example::

    from unclip.config import load_config, to_yaml
    cfg = load_config("configs/tiny/prior.yaml", overrides=["train.lr=3e-4", "data.batch_size=4"])
    print(to_yaml(cfg))
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

__all__ = [
    "ClipConfig",
    "PriorConfig",
    "DecoderConfig",
    "UpsamplerConfig",
    "DiffusionConfig",
    "SamplingConfig",
    "DataConfig",
    "TrainConfig",
    "StageConfig",
    "ConfigError",
    "load_config",
    "from_dict",
    "to_dict",
    "to_yaml",
    "save_config",
    "apply_overrides",
]


class ConfigError(ValueError):
    """A configuration file or override is invalid (unknown key, wrong type, bad value)."""


# --------------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------------
@dataclass
class ClipConfig:
    """The frozen CLIP: an open_clip model name plus a pretrained tag or a local weights file/folder.

    ``model_cfg`` builds a custom (e.g. tiny) open_clip model from a config dict instead of a named one
    (keys as in open_clip's model JSON files: ``embed_dim``, ``vision_cfg``, ``text_cfg``). Nothing is
    downloaded unless ``pretrained`` is a hub tag such as ``"openai"``.
    """

    model_name: str = "ViT-L-14"
    pretrained: Optional[str] = None
    model_cfg: Optional[dict] = None


@dataclass
class PriorConfig:
    """Diffusion prior over CLIP image embeddings (diffusers ``PriorTransformer``), paper §2.2.

    The transformer sees [text tokens (num_embeddings), text_embed, time, x_t, prediction token] and
    predicts x_0 (the un-noised, normalised image embedding).
    """

    num_layers: int = 24
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    dropout: float = 0.0


@dataclass
class DecoderConfig:
    """Base decoder (diffusers ``UNet2DConditionModel``) conditioned on the CLIP image embedding, paper §2.1.

    The image embedding is projected and added to the timestep embedding and projected into
    ``num_image_tokens`` extra context tokens placed beside the caption tokens.
    """

    sample_size: int = 64
    block_out_channels: list[int] = field(default_factory=lambda: [512, 1024, 1536, 2048])
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
    norm_num_groups: int = 32
    use_text_tokens: bool = True
    coord_channels: bool = (
        False  # x/y coordinate input channels (CoordConv); not in the paper or Karlo
    )
    embed_scale: float = (
        1.0  # multiplies the CLIP embeddings before projection (sqrt(D) for unit-norm ones)
    )


@dataclass
class UpsamplerConfig:
    """Super-resolution stage (diffusers ``UNet2DModel``): low-res image upsampled and concatenated.

    ``corruption`` is the conditioning augmentation applied to the low-res image during training
    (``"blur"``: Gaussian blur, first upsampler; ``"bsr"``: BSR-style degradation, second upsampler);
    ``noise_level`` is the fixed noise level (a diffusion timestep) of the low-res image at sampling.
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
    corruption: Literal["blur", "bsr", "none"] = "blur"
    blur_sigma: list[float] = field(default_factory=lambda: [0.4, 0.6])
    max_noise_level: int = 250
    noise_level: int = 0
    train_crop_size: Optional[int] = None


@dataclass
class DiffusionConfig:
    """Noise schedule and training target shared by every stage."""

    num_train_timesteps: int = 1000
    beta_schedule: Literal["squaredcos_cap_v2", "linear", "scaled_linear"] = "squaredcos_cap_v2"
    prediction_type: Literal["epsilon", "sample", "v_prediction"] = "epsilon"
    min_snr_gamma: Optional[float] = None


@dataclass
class SamplingConfig:
    """Sampling settings of one stage: scheduler name, number of steps, guidance scale.

    ``scheduler`` is one of ``ddpm``, ``ddim``, ``dpm++`` (DPM-Solver++ multistep), ``unclip``.
    ``best_of``: for the prior, that many embedding candidates per image, keeping the one with the highest
    dot product with the text embedding (paper: 2); for the decoder, that many base-resolution images per
    prompt (each from its own prior sample), keeping the one the CLIP scores closest to the prompt before
    upsampling (CLIP reranking, as DALL-E); upsamplers take 1.
    """

    scheduler: str = "ddim"
    steps: int = 25
    guidance_scale: float = 4.0
    best_of: int = 1


@dataclass
class DataConfig:
    """Where training pairs come from.

    ``source``: ``shapes`` (generated on the fly), ``folder`` (images + same-stem ``.txt`` captions),
    ``webdataset`` (img2dataset tar shards, local paths, brace patterns or ``pipe:`` URLs) or
    ``embeddings`` (precomputed ``.npy`` shards written by ``unclip embed``; prior only).
    ``embeddings_path``: with ``source`` ``webdataset`` or ``folder``, the ``unclip embed`` output for exactly
    those images; each sample then carries its precomputed ``image_embed``/``text_embed`` (matched by key,
    tar shard ``i`` ↔ embedding shard ``i``) instead of running CLIP on it, and the shards are checked to
    line up (``ValueError`` naming the shard and key otherwise); see :mod:`unclip.train.data.paired`.
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
    ``powersgd_rank > 0`` compresses DDP gradients with PowerSGD of that rank (Accelerate's DDP comm hook)
    after ``powersgd_start_step`` steps of plain all-reduce. ``max_consecutive_nonfinite``: training stops
    after that many optimizer steps in a row were skipped for a non-finite loss or gradient.
    ``init_weights``: start from these weights instead of a random initialisation (fine-tuning): a
    component folder (e.g. ``final/decoder`` of an earlier run, or ``decoder/`` of a pipeline folder) or a
    ``.safetensors`` file; the model config must match. ``--resume`` still wins: a checkpoint, when one
    is found, replaces them.
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
class StageConfig:
    """One training run of one stage: ``prior``, ``decoder`` (base) or ``upsampler``."""

    stage: Literal["prior", "decoder", "upsampler"] = "prior"
    clip: ClipConfig = field(default_factory=ClipConfig)
    prior: Optional[PriorConfig] = None
    decoder: Optional[DecoderConfig] = None
    upsampler: Optional[UpsamplerConfig] = None
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        section = {"prior": self.prior, "decoder": self.decoder, "upsampler": self.upsampler}[
            self.stage
        ]
        if section is None:
            raise ConfigError(
                f"stage is {self.stage!r} but the config has no '{self.stage}:' section; "
                f"add one (see configs/tiny/{self.stage}.yaml for an example)"
            )

    @property
    def model(self):
        """The model section of this stage."""
        return getattr(self, self.stage)


# --------------------------------------------------------------------------------------------------
# Strict conversion dict <-> dataclass
# --------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


_SCALARS = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert it (nested dataclasses, int→float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(value, non_none[0], where, source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{source}: '{where}' must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source}: '{where}' must be one of {list(args)}, got {value!r}{hint}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(
                f"{source}: '{where}' must be a mapping of {tp.__name__} fields, got {value!r}"
            )
        return from_dict(tp, value, source=source, prefix=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: '{where}' must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        return [_convert(v, item_tp, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{where}' must be a mapping, got {value!r}")
        return dict(value)
    if tp in _SCALARS:
        what, accepted = _SCALARS[tp]
        if not isinstance(value, accepted) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{source}: '{where}' must be {what}, got {value!r}")
        return float(value) if tp is float else value
    raise TypeError(f"unsupported annotation {tp!r} at {where}")  # internal: schema bug


def from_dict(cls: type, data: dict, *, source: str = "<dict>", prefix: str = ""):
    """Build dataclass ``cls`` from ``data`` strictly: unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix or cls.__name__}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = (
                f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            )
            raise ConfigError(
                f"{source}: unknown key '{where}'{hint} (valid keys here: {', '.join(names)})"
            )
        kwargs[key] = _convert(value, hints[key], where, source)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field without default
        raise ConfigError(f"{source}: {prefix or cls.__name__}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """Plain dict/list form of a config (safe for YAML and JSON)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def to_yaml(obj: Any) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def save_config(obj: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(obj))
    os.replace(tmp, path)


def apply_overrides(
    data: dict, overrides: list[str] | tuple[str, ...], source: str = "command line"
) -> dict:
    """Apply dotted ``key.sub=value`` overrides to a plain dict; values are parsed as YAML scalars."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"{source}: override {item!r} must look like 'section.key=value' (e.g. train.lr=3e-4)"
            )
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"{source}: override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, str):  # YAML reads '3e-4' as a string; accept it as a number
            try:
                value = float(value) if any(c in value for c in ".eE") else value
            except ValueError:
                pass
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{source}: cannot set {dotted!r}: '{k}' is not a section")
            node[k] = child = dict(child)
            node = child
        node[keys[-1]] = value
    return data


def load_config(
    path: str | os.PathLike | dict | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    schema: type = StageConfig,
):
    """Load a YAML file (or a dict) into ``schema`` with dotted overrides applied, strictly.

    Raises :class:`ConfigError` naming the key, the file and the closest valid key on a misspelling.
    """
    if path is None:
        data, source = {}, "<defaults>"
    elif isinstance(path, dict):
        data, source = to_dict(path), "<dict>"
    else:
        source = str(path)
        if not Path(path).is_file():
            raise ConfigError(
                f"config file not found: {source}; pass the path of a YAML file (see configs/)"
            )
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: top level must be a mapping of sections, got {type(data).__name__}"
            )
    if overrides:
        data = apply_overrides(data, list(overrides))
        source = f"{source} (with overrides)"
    return from_dict(schema, data, source=source)
