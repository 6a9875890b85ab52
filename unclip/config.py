"""Architecture and sampling configuration schemas, and a strict YAML loader.

The schemas here describe what a pipeline is made of: the frozen CLIP (:class:`ClipConfig`), the
networks (:class:`PriorConfig`, :class:`DecoderConfig`, :class:`UpsamplerConfig`, each with a
``build`` method returning the model it describes), the noise schedule (:class:`DiffusionConfig`)
and the sampling settings (:class:`SamplingConfig`). Training runs add their own sections on top of
these (:mod:`unclip.train.config`).

Loading is strict: an unknown or misspelt key is an error that names the key, the file and the
closest valid key; values are type-checked; the resolved config is printable (:func:`to_yaml`) and
saved beside every checkpoint (:func:`save_config`).

Example::

    from unclip.config import DecoderConfig, load_config, to_yaml
    cfg = load_config({"sample_size": 32}, ["layers_per_block=2"], schema=DecoderConfig)
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
    "ARPriorOptions",
    "DecoderConfig",
    "UpsamplerConfig",
    "DiffusionConfig",
    "SamplingConfig",
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
    """The frozen CLIP: an open_clip model name plus a pretrained tag or local weights.

    ``model_cfg`` builds a custom (e.g. tiny) open_clip model from a config dict instead of a named
    one (keys as in open_clip's model JSON files: ``embed_dim``, ``vision_cfg``, ``text_cfg``).
    Nothing is downloaded unless ``pretrained`` is a hub tag such as ``"openai"``.
    """

    model_name: str = "ViT-L-14"
    pretrained: Optional[str] = None
    model_cfg: Optional[dict] = None


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
    PCA-quantised image embedding one code at a time (:class:`~unclip.ar_prior.UnCLIPARPrior`),
    with the code settings in ``ar`` (:class:`ARPriorOptions`; only for ``type: ar``). The CLIP
    supplies the widths (``embed_dim``, ``text_width``, ``context_length``); :meth:`build` makes
    the network.

    DALL-E Mega's transformer recipe for either prior (:mod:`unclip.transformer_blocks`):
    ``normformer`` adds NormFormer's LayerNorms after attention and after the feed-forward's
    activation and a learned scale per attention head (Shleifer et al. 2021); ``ff_activation``
    ``geglu``/``swiglu`` makes the feed-forward a GLU with 2/3 of the hidden width, the same
    parameter count (Shazeer 2020). The defaults (off, ``gelu``) are diffusers'
    ``PriorTransformer`` exactly; either option makes a diffusion prior that diffusers'
    ``UnCLIPPipeline`` cannot load (export refuses it).
    """

    type: Literal["diffusion", "ar"] = "diffusion"
    num_layers: int = 24
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    dropout: float = 0.0
    normformer: bool = False
    ff_activation: Literal["gelu", "geglu", "swiglu"] = "gelu"
    ar: Optional[ARPriorOptions] = None

    def __post_init__(self) -> None:
        _check_dropout("prior.dropout", self.dropout)
        if self.type == "diffusion" and self.ar is not None:
            raise ConfigError(
                "prior.ar configures the autoregressive prior; set prior.type: ar or remove the "
                "'ar:' section"
            )
        if self.type == "ar" and self.ar is None:
            self.ar = ARPriorOptions()

    def build(self, clip):
        """The prior this config describes (:class:`~unclip.prior.UnCLIPPrior` or
        :class:`~unclip.ar_prior.UnCLIPARPrior`), sized for ``clip``."""
        arch = {k: v for k, v in to_dict(self).items() if k not in ("type", "ar")}
        if self.type == "ar":
            from unclip.ar_prior import UnCLIPARPrior

            opts = to_dict(self.ar)
            opts.pop("fit_samples")  # a training setting: how many embeddings the fit reads
            return UnCLIPARPrior.from_clip(clip, **arch, **opts)
        from unclip.prior import UnCLIPPrior

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
    ``diffusion.vlb_weight`` (see :mod:`unclip.vlb`).
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

    def __post_init__(self) -> None:
        _check_dropout("decoder.dropout", self.dropout)
        if self.text_encoder == "transformer":
            for key in ("text_encoder_width", "text_encoder_layers", "text_encoder_heads"):
                if getattr(self, key) < 1:
                    raise ConfigError(f"decoder.{key} must be at least 1, got {getattr(self, key)}")
            if self.text_encoder_width % self.text_encoder_heads:
                raise ConfigError(
                    f"decoder.text_encoder_width ({self.text_encoder_width}) must be divisible by "
                    f"decoder.text_encoder_heads ({self.text_encoder_heads})"
                )
            if self.text_context_length < 2:
                raise ConfigError(
                    "decoder.text_context_length must be at least 2 (start and end tokens), got "
                    f"{self.text_context_length}"
                )

    def build(self, clip):
        """The :class:`~unclip.decoder.UnCLIPDecoder` this config describes, sized for ``clip``."""
        from unclip.decoder import UnCLIPDecoder

        return UnCLIPDecoder.from_clip(clip, **to_dict(self))


@dataclass
class UpsamplerConfig:
    """Super-resolution stage (diffusers ``UNet2DModel``): low-res image upsampled and concatenated.

    ``noise_level`` is the fixed noise level (a diffusion timestep) of the low-res image at
    sampling. How the low-res conditioning is corrupted during training is a training setting (the
    stage config's ``upsampler_train:`` section). ``add_attention``: self-attention in the UNet's
    mid block (the paper's upsamplers are convolution-only: false). ``dropout``: in the residual
    blocks during training (paper: 0.1 in the first upsampler). :meth:`build` makes the network.
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

    def __post_init__(self) -> None:
        _check_dropout("upsampler.dropout", self.dropout)

    def build(self):
        """The :class:`~unclip.decoder.UnCLIPUpsampler` this config describes."""
        from unclip.decoder import UnCLIPUpsampler

        return UnCLIPUpsampler(**to_dict(self))


def _check_dropout(key: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key} must be in [0, 1), got {value!r}")


@dataclass
class DiffusionConfig:
    """Noise schedule and training target shared by every stage.

    ``vlb_weight``: λ of the Improved-DDPM hybrid loss ``L_simple + λ·L_vlb`` (paper: 0.001) that
    trains a decoder's learned variance (``decoder.learned_variance``); 0 trains ``L_simple`` only.
    ``timestep_shift``: s > 1 draws training timesteps more often at high noise, where the
    conditioning decides the image, s < 1 at low noise (``t/T = s·u / (1 + (s − 1)·u)``,
    ``u ~ U(0, 1)``, Stable Diffusion 3's shift formula); 1 (default) draws them uniformly. The
    autoregressive prior draws no timesteps and ignores it.
    """

    num_train_timesteps: int = 1000
    beta_schedule: Literal["squaredcos_cap_v2", "linear", "scaled_linear"] = "squaredcos_cap_v2"
    prediction_type: Literal["epsilon", "sample", "v_prediction"] = "epsilon"
    min_snr_gamma: Optional[float] = None
    vlb_weight: float = 0.0
    timestep_shift: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 < self.timestep_shift < float("inf")):
            raise ConfigError(
                f"diffusion.timestep_shift must be a finite number > 0 (1 draws timesteps "
                f"uniformly, > 1 favours high noise), got {self.timestep_shift!r}"
            )
        if not (0.0 <= self.vlb_weight < float("inf")):
            raise ConfigError(
                f"diffusion.vlb_weight must be a finite number >= 0 (paper: 0.001), got "
                f"{self.vlb_weight!r}"
            )


#: the samplers configured by the library itself (``SamplingConfig.scheduler``); any other
#: diffusers scheduler works too, by alias, class name or instance (see unclip/schedulers.py)
SCHEDULERS = ("ddpm", "ddim", "dpm++", "unclip")


@dataclass
class SamplingConfig:
    """Sampling settings of one stage: scheduler name, number of steps, guidance scale.

    ``scheduler`` is one of ``ddpm``, ``ddim``, ``dpm++`` (DPM-Solver++ multistep), ``unclip``,
    an alias such as ``euler``, ``heun`` or ``unipc``, a diffusers scheduler class name, or a
    diffusers scheduler instance (:mod:`unclip.schedulers`).
    ``best_of``: for the prior, that many embedding candidates per image, keeping the one with the
    highest dot product with the text embedding (paper: 2); for the decoder, that many
    base-resolution images per prompt (each from its own prior sample), keeping the one the CLIP
    scores closest to the prompt before upsampling (CLIP reranking, as DALL-E); upsamplers take 1.
    ``rerank_at`` (decoder only, with ``best_of > 1``): choose among the candidates after this many
    of the ``steps``, by the CLIP score of each candidate's predicted final image at that step, and
    denoise only the chosen ones to the end. The decoder then makes
    ``best_of × rerank_at + steps − rerank_at`` network calls per image instead of
    ``best_of × steps``; ``None`` (default), or ``steps`` or more, chooses among the finished
    images. It takes samplers with one network call per step (not Heun or DPM2).
    ``prune_at`` and ``prune_keep`` (decoder only, with ``rerank_at`` below ``steps``): after step
    ``prune_at`` (below ``rerank_at``) keep only each image's ``prune_keep`` best candidates by the
    same score, and choose one of them after ``rerank_at`` — successive halving of the candidates,
    ``best_of × prune_at + prune_keep × (rerank_at − prune_at) + steps − rerank_at`` network
    calls per image. With ``best_of`` at or below ``prune_keep`` nothing is pruned. Both or
    neither are set (default: neither).
    ``rerank_contrast`` (decoder only): score the candidates by how much the CLIP prefers the
    prompt over alternatives of it (a name registered in :data:`unclip.sampling.RERANK_CONTRASTS`,
    e.g. ``"shapes"``: the prompt's one-attribute variants and swaps) instead of by the plain
    cosine (``None``, default); see :func:`unclip.sampling.rerank_candidates`.
    ``best_of_contrasted`` (decoder only): candidates per image for a prompt that
    ``rerank_contrast`` has alternatives for (under ``"shapes-pairs"``: a two-object prompt), while
    the other prompts take ``best_of``; ``None`` (default): ``best_of`` for every prompt. Prompts
    that are harder to get right can draw more candidates than the rest: the bundled shapes model
    draws 24 for two objects and 12 for one. An override that sets ``best_of`` alone resets it, so
    ``{"decoder": {"best_of": 4}}`` draws 4 for every prompt.

    The autoregressive prior (``prior.type: ar``) samples codes, not noise: it ignores
    ``scheduler`` and ``steps`` and takes ``guidance_scale`` (on its logits), ``best_of`` and four
    settings of its own, which every other stage refuses when set: ``temperature`` (default 1),
    ``top_k`` and ``top_p`` (default: off), ``dot_product_quantile``: the quantile of the training
    text–image cosines its dot-product token asks for (default: drawn from the top half for each
    sample, as the paper samples).
    """

    scheduler: str = "ddim"
    steps: int = 25
    guidance_scale: float = 4.0
    best_of: int = 1
    rerank_at: Optional[int] = None
    rerank_contrast: Optional[str] = None
    best_of_contrasted: Optional[int] = None
    prune_at: Optional[int] = None
    prune_keep: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    dot_product_quantile: Optional[float] = None


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
        if isinstance(value, bool) and any(isinstance(a, str) for a in args):
            raise ConfigError(
                f"{source}: '{where}' must be one of {list(args)}, got the boolean {value!r}: YAML "
                f"reads unquoted no/yes/on/off as booleans, so quote the word (e.g. 'no')"
            )
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
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            # a valid key with letters appended ("lrate") means that key, even where another one
            # shares more letters ("lora")
            close = [c for c in close if str(key).startswith(c)][:1] or close[:1]
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
    if type(obj).__name__.endswith("Scheduler") and hasattr(obj, "config"):
        return type(obj).__name__  # a diffusers scheduler instance: recorded by its class
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


#: training-only DiffusionConfig settings newer than the library versions that refuse unknown
#: keys: files written for sampling (a pipeline's unclip.json, a component's unclip_stage.json)
#: leave them out at their defaults, so that a folder written by this version loads there too
#: (min_snr_gamma, also training-only, is older and always written)
TRAINING_ONLY_DIFFUSION = ("vlb_weight", "timestep_shift")


#: SamplingConfig settings newer than the library versions that refuse unknown keys: saved files
#: leave them out at their defaults for the same reason
NEWER_SAMPLING = ("prune_at", "prune_keep", "best_of_contrasted")


def _without_defaults(obj: Any, cls: type, names: tuple[str, ...]) -> Any:
    values = to_dict(obj)
    if not isinstance(values, dict):
        return values
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {
        k: v for k, v in values.items() if not (k in names and k in defaults and v == defaults[k])
    }


def diffusion_to_save(diffusion: Any) -> Any:
    """``diffusion`` (a :class:`DiffusionConfig` or its dict) as saved with weights: without the
    :data:`TRAINING_ONLY_DIFFUSION` settings that are at their defaults."""
    return _without_defaults(diffusion, DiffusionConfig, TRAINING_ONLY_DIFFUSION)


def sampling_to_save(sampling: Any) -> Any:
    """``sampling`` (a :class:`SamplingConfig` or its dict) as saved with weights: without the
    :data:`NEWER_SAMPLING` settings that are at their defaults."""
    return _without_defaults(sampling, SamplingConfig, NEWER_SAMPLING)


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
    """Apply dotted ``key.sub=value`` overrides to a plain dict (values parsed as YAML scalars)."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"{source}: override {item!r} must look like 'section.key=value' "
                "(e.g. train.lr=3e-4)"
            )
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"{source}: override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            # YAML 1.1 reads no/yes/on/off as booleans; on a command line they are words
            # (train.mixed_precision=no)
            value = raw.strip()
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
    path: str | os.PathLike | dict | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    schema: type,
):
    """Load a YAML file (or a dict; ``None``: the defaults) into dataclass ``schema`` with dotted
    overrides applied, strictly.

    Raises :class:`ConfigError` naming the key, the file and the closest valid key on a misspelling.
    A training run's stage config loads with :func:`unclip.train.config.load_stage_config`.
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
