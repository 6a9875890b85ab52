"""LoRA adapters on the pipeline's stages (Hu et al. 2021, "LoRA: Low-Rank Adaptation"), with peft.

A LoRA adapter adds a trainable low-rank update ``ΔW = (alpha / rank) · B A`` beside chosen layers
of a stage's network (by default its attention projections) while the base weights stay frozen, so a
fine-tune is a few hundred kilobytes instead of a whole component. The adapter is injected into the
stage component itself (:class:`~unclip.nets.prior.UnCLIPPrior`,
:class:`~unclip.nets.decoder.UnCLIPDecoder`, :class:`~unclip.nets.decoder.UnCLIPUpsampler`) with
peft's ``inject_adapter_in_model``, so module names are those of the component's state dict
(``unet.down_blocks.1.attentions.0.to_q``) and a target may also name unCLIP's own layers.

Usage on a pipeline (the methods of :class:`unclip.pipeline.lora.LoraMixin`)::

    pipe = UnCLIPPipeline.from_pretrained()
    pipe.load_lora("runs/pink/final/decoder_lora")        # the stage is read from the folder
    pipe.set_lora_scale(0.5)                              # strength; 0 gives the base's images
    pipe.merge_lora()                                     # fold into the weights (plain weights)
    pipe.unload_lora()                                    # or: remove, the base again bit for bit

An adapter folder (written by training with ``train.lora``, :func:`save_adapter`) holds
``adapter_model.safetensors`` and ``adapter_config.json`` in peft's own format (peft's
``LoraConfig.from_pretrained`` reads it) and ``unclip_lora.json``: the stage it adapts, the
component class, a fingerprint of the base weights it was trained on and of the conditioning CLIP.

peft is an optional dependency (``pip install 'unclip[lora]'``), imported only when an adapter is
used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union, cast

import torch

from unclip.io.weights import load_safetensors

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

__all__ = [
    "ADAPTER_WEIGHTS",
    "ADAPTER_CONFIG",
    "LORA_META",
    "DEFAULT_TARGET_MODULES",
    "AdapterFolder",
    "require_peft",
    "adaptable_names",
    "default_target_modules",
    "check_target_modules",
    "add_adapter",
    "adapter_state_dict",
    "load_adapter_state",
    "set_adapter_scale",
    "merge_adapters",
    "fuse_adapters",
    "drop_adapter_layers",
    "unfuse_adapters",
    "remove_adapter",
    "base_fingerprint",
    "HALF_FINGERPRINTS",
    "save_adapter",
    "read_adapter",
    "parse_lora_spec",
]

#: peft's file names, so an adapter folder is also a peft adapter folder
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: what peft does not record: the stage, the component class, the base it was trained on
LORA_META = "unclip_lora.json"
LORA_FORMAT = "unclip-lora"

#: the layers adapted when ``target_modules`` is not given, per component class: the attention
#: projections. The decoder's ``SimpleCrossAttn`` blocks read the caption tokens through
#: ``add_k_proj``/``add_v_proj`` (their ``to_k``/``to_v`` see the image features only), so those
#: are included for the decoder: without them an adapter could not change how a caption is read.
DEFAULT_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "UnCLIPPrior": ("to_q", "to_k", "to_v", "to_out.0"),
    "UnCLIPDecoder": ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"),
    "UnCLIPUpsampler": ("to_q", "to_k", "to_v", "to_out.0"),
    # Kandinsky 2.2: its UNet reads the image embedding's tokens through add_k_proj/add_v_proj
    # as unclip's decoder reads captions
    "UNet2DConditionModel": ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"),
    "PriorTransformer": ("to_q", "to_k", "to_v", "to_out.0"),
}

#: layer types peft's LoRA can adapt (and that these networks contain)
_ADAPTABLE = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)
_Adaptable = Union[torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d]


def require_peft():
    """The ``peft`` module, or an ``ImportError`` saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            "LoRA adapters need the peft package: pip install 'unclip[lora]' (or pip install peft)"
        ) from None
    return peft


# --------------------------------------------------------------------------------------------------
# which layers
# --------------------------------------------------------------------------------------------------
def _short_name(name: str) -> str:
    """The name a target uses for a layer: its last part, or the last two when the last is an index
    (``to_out.0``)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _matches(name: str, target: str) -> bool:
    # peft's rule for a list of targets: the whole name, or its tail after a dot
    return name == target or name.endswith("." + target)


def _frozen_parts(model: torch.nn.Module) -> tuple[str, ...]:
    """The submodules of ``model`` that LoRA never adapts (a latent decoder's frozen
    autoencoder, whose attention layers share the UNet's names), from the class's
    ``_lora_excluded``."""
    return tuple(n for n in getattr(model, "_lora_excluded", ()) if getattr(model, n, None))


def _exclusion(model: torch.nn.Module) -> Optional[str]:
    """peft's ``exclude_modules`` pattern for :func:`_frozen_parts` (None: nothing excluded)."""
    parts = _frozen_parts(model)
    return "|".join(rf"{re.escape(n)}\..*" for n in parts) if parts else None


def _layers(model: torch.nn.Module) -> dict[str, _Adaptable]:
    """``{name: base layer}`` of every adaptable layer of ``model``; a layer that already carries
    adapters counts once, under its own name, with its base layer."""
    tuner = _tuner_layer_class()
    out: dict[str, _Adaptable] = {}
    inside: Optional[str] = None
    frozen = tuple(f"{n}." for n in _frozen_parts(model))
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside + "."):
            continue
        if name.startswith(frozen):
            continue
        inside = None
        if tuner is not None and isinstance(module, tuner):
            # peft wraps only the layers it can adapt
            out[name] = cast(_Adaptable, module.get_base_layer())
            inside = name
        elif isinstance(module, _ADAPTABLE):
            out[name] = module
    return out


def _tuner_layer_class():
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return BaseTunerLayer


def adaptable_names(model: torch.nn.Module) -> list[str]:
    """The short names (as ``target_modules`` takes them) of the layers LoRA can adapt."""
    return sorted({_short_name(n) for n in _layers(model)})


def default_target_modules(model: torch.nn.Module) -> list[str]:
    """:data:`DEFAULT_TARGET_MODULES` of ``model``'s class, restricted to the names it has (an
    upsampler without mid-block attention has none: a ``ValueError`` asks for targets)."""
    kind = type(model).__name__
    if kind not in DEFAULT_TARGET_MODULES:
        raise ValueError(
            f"no default LoRA targets for a {kind}; give target_modules (layers: "
            f"{', '.join(adaptable_names(model))})"
        )
    names = set(adaptable_names(model))
    found = [t for t in DEFAULT_TARGET_MODULES[kind] if t in names]
    if not found:
        raise ValueError(
            f"this {kind} has no attention layers to adapt by default; give target_modules "
            f"(layers: {', '.join(sorted(names))})"
        )
    return found


def check_target_modules(
    model: torch.nn.Module, targets: Optional[Sequence[str]], key: str = "target_modules"
) -> list[str]:
    """``targets`` (None: :func:`default_target_modules`), each checked to name at least one
    adaptable layer of ``model``; a ``ValueError`` names ``key``, the target and the layers there
    are."""
    if targets is None:
        return default_target_modules(model)
    targets = list(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"{key} must be a non-empty list of layer names, got {targets!r}")
    layers = list(_layers(model))
    for t in targets:
        if not any(_matches(n, t) for n in layers):
            raise ValueError(
                f"{key}: {t!r} matches no layer of the {type(model).__name__} that LoRA can adapt "
                f"(Linear or Conv); its layers: {', '.join(adaptable_names(model))}"
            )
    return targets


#: the half dtypes whose fingerprints an adapter also records (a pipeline loaded or cast in them)
HALF_FINGERPRINTS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def base_fingerprint(
    model: torch.nn.Module, targets: Sequence[str], dtype: Optional[torch.dtype] = None
) -> str:
    """Short sha256 (16 hex digits) of the base weights of the layers ``targets`` match (as float32,
    by name): identifies the weights an adapter was trained on, with or without adapters loaded.
    ``dtype``: of the weights rounded to it first (what a pipeline cast to it holds)."""
    h = hashlib.sha256()
    for name, layer in sorted(_layers(model).items()):
        if not any(_matches(name, t) for t in targets):
            continue
        h.update(name.encode())
        for p in (layer.weight, getattr(layer, "bias", None)):
            if p is not None:
                value = p.detach() if dtype is None else p.detach().to(dtype)
                value = value.float().cpu().contiguous().reshape(-1)
                h.update(value.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# adapters on one component
# --------------------------------------------------------------------------------------------------
def _tuner_layers(model: torch.nn.Module) -> list[tuple[str, LoraLayer]]:
    tuner = _tuner_layer_class()
    if tuner is None:
        return []
    # adapters are injected only by add_adapter, from a LoraConfig: every tuner layer is LoRA's
    return [(n, cast("LoraLayer", m)) for n, m in model.named_modules() if isinstance(m, tuner)]


def _peft_configs(model: torch.nn.Module) -> dict[str, LoraConfig]:
    """``{adapter name: config}`` as peft keeps it on the model it injected into (an attribute
    peft adds, not one that ``Module`` declares)."""
    return dict(getattr(model, "peft_config", {}) or {})


def _set_peft_configs(model: torch.nn.Module, configs: dict[str, LoraConfig]) -> None:
    setattr(model, "peft_config", configs)  # noqa: B010 (an attribute peft adds to the module)


def config_targets(config: LoraConfig) -> list[str]:
    """The layer names a LoRA ``config`` targets, sorted (peft keeps them as a set)."""
    targets = config.target_modules
    if targets is None or isinstance(targets, str):  # peft's regex form; unclip writes names
        raise ValueError(f"LoRA config: target_modules must list layer names, got {targets!r}")
    return sorted(targets)


def adapter_names(model: torch.nn.Module) -> list[str]:
    """Names of the adapters injected into ``model``."""
    return list(_peft_configs(model))


def _activate(model: torch.nn.Module, trainable: bool) -> None:
    """Make every adapter of ``model`` active (their outputs add up); their weights require grad
    only if ``trainable``."""
    names = adapter_names(model)
    for _, layer in _tuner_layers(model):
        layer.set_adapter(names, inference_mode=not trainable)


def add_adapter(
    model: torch.nn.Module,
    name: str,
    *,
    rank: int,
    alpha: Optional[float] = None,
    dropout: float = 0.0,
    target_modules: Optional[Sequence[str]] = None,
    trainable: bool = False,
    config=None,
):
    """Inject a LoRA adapter ``name`` into ``model`` (in place) and return its peft ``LoraConfig``.

    ``alpha`` defaults to ``rank`` (scale 1). ``config``: a peft ``LoraConfig`` to use as is
    (loading a saved adapter) instead of ``rank``/``alpha``/``dropout``/``target_modules``. Every
    adapter of the model stays active. Every other parameter of ``model`` (the base weights) is
    frozen by peft; ``trainable``: the adapters' weights require grad (training), else nothing
    does. The model keeps its train/eval mode. peft initialises ``B`` to zeros: the model's outputs
    are unchanged until the adapter trains or loads weights."""
    peft = require_peft()
    if name in adapter_names(model):
        raise ValueError(f"the {type(model).__name__} already has an adapter named {name!r}")
    if config is None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        targets = check_target_modules(model, target_modules)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=float(rank if alpha is None else alpha),
            lora_dropout=float(dropout),
            target_modules=targets,
            exclude_modules=_exclusion(model),
        )
    else:
        check_target_modules(model, sorted(config.target_modules))
        mine, theirs = _exclusion(model), config.exclude_modules
        if mine and theirs != mine:
            # the frozen parts stay out whatever else the adapter's own config leaves out
            if isinstance(theirs, str):
                mine = f"{mine}|{theirs}"
            elif theirs:  # a list of names: as patterns that match a module named so
                mine = "|".join([mine, *(rf"(.*\.)?{re.escape(n)}" for n in theirs)])
            config = dataclasses.replace(config, exclude_modules=mine)
    existing = _peft_configs(model)
    training = model.training
    with warnings.catch_warnings():
        # peft warns that a model with adapters gets another one: here that is the intent
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        peft.inject_adapter_in_model(config, model, adapter_name=name)
    # peft's injection leaves only the new adapter in model.peft_config and active
    _set_peft_configs(model, {**existing, name: config})
    _activate(model, trainable)
    model.train(training)  # the new dropout layers follow the component's mode
    return config


def adapter_state_dict(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The weights of adapter ``name`` under peft's keys (without the adapter name), e.g.
    ``unet.down_blocks.1.attentions.0.to_q.lora_A.weight``."""
    peft = require_peft()
    return peft.get_peft_model_state_dict(model, adapter_name=name)


def load_adapter_state(
    model: torch.nn.Module, name: str, state: dict[str, torch.Tensor], source: str
) -> None:
    """Copy ``state`` (peft keys, as saved) into adapter ``name`` of ``model``; every key must be
    there with the same shape (a ``ValueError`` naming ``source`` and the first mismatches)."""
    peft = require_peft()
    from unclip.io.weights import state_mismatch

    want = {k: tuple(v.shape) for k, v in adapter_state_dict(model, name).items()}
    problems = state_mismatch(want, {k: tuple(v.shape) for k, v in state.items()}, "here", 2)
    if problems:
        raise ValueError(
            f"LoRA adapter {source} does not fit this {type(model).__name__}: {problems}"
            ". It was trained on a stage of another architecture."
        )
    result = peft.set_peft_model_state_dict(model, state, adapter_name=name)
    assert not result.unexpected_keys, result.unexpected_keys


def set_adapter_scale(model: torch.nn.Module, name: str, scale: float) -> None:
    """Scale adapter ``name``'s update: ``ΔW = scale · (alpha / rank) · B A``."""
    for _, layer in _tuner_layers(model):
        layer.set_scale(name, float(scale))


def _restore_base_layers(model: torch.nn.Module, keep) -> None:
    """Put back the plain base layer of every adapted layer for which ``keep(layer)`` is false."""
    for name, layer in _tuner_layers(model):
        if keep(layer):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())


def merge_adapters(model: torch.nn.Module) -> None:
    """Fold every adapter of ``model`` (at its scale) into the base weights and remove the adapter
    layers: the model is plain again (its state dict loads without peft)."""
    names = adapter_names(model)
    for _, layer in _tuner_layers(model):
        # safe_merge: a non-finite merged weight is an error, the weights are left as they were
        layer.merge(safe_merge=True, adapter_names=[n for n in names if n in layer.lora_A])
    _restore_base_layers(model, keep=lambda layer: False)
    _forget_config(model)


def fuse_adapters(model: torch.nn.Module, names: list[str]) -> None:
    """Add adapters ``names`` (at their scales) into the base weights, keeping the adapter layers
    so that :func:`unfuse_adapters` can take them out again (diffusers' ``fuse_lora``)."""
    for _, layer in _tuner_layers(model):
        here = [n for n in names if n in layer.lora_A]
        if here:
            layer.merge(safe_merge=True, adapter_names=here)


def drop_adapter_layers(model: torch.nn.Module) -> None:
    """Put every adapted layer's base layer back, with whatever was fused into its weights, and
    forget the adapters (the model is plain again)."""
    _restore_base_layers(model, keep=lambda layer: False)
    _forget_config(model)


def unfuse_adapters(model: torch.nn.Module) -> None:
    """Subtract every fused adapter from the base weights again (up to float rounding)."""
    for _, layer in _tuner_layers(model):
        if layer.merged:
            layer.unmerge()


def remove_adapter(model: torch.nn.Module, name: str) -> None:
    """Remove adapter ``name`` from ``model``; layers left without adapters become the very base
    layers they wrapped (the outputs are the base's bit for bit once no adapter is left)."""
    for _, layer in _tuner_layers(model):
        if name in layer.lora_A:
            layer.delete_adapter(name)
    config = _peft_configs(model)
    config.pop(name, None)
    _restore_base_layers(model, keep=lambda layer: bool(layer.lora_A))
    if config:
        _set_peft_configs(model, config)
        _activate(model, trainable=False)
    else:
        _forget_config(model)


def _forget_config(model: torch.nn.Module) -> None:
    if "peft_config" in vars(model):
        delattr(model, "peft_config")


# --------------------------------------------------------------------------------------------------
# adapter folders
# --------------------------------------------------------------------------------------------------
@dataclass
class AdapterFolder:
    """A saved adapter: ``config`` (peft ``LoraConfig``), ``state`` (its weights, peft keys),
    ``meta`` (``unclip_lora.json``) and where it was read from."""

    path: Path
    config: LoraConfig
    state: dict
    meta: dict

    @property
    def stage(self) -> str:
        return self.meta["stage"]


def save_adapter(
    model: torch.nn.Module, folder: Union[str, os.PathLike], name: str, meta: dict
) -> None:
    """Write adapter ``name`` of ``model`` to ``folder``: ``adapter_model.safetensors``,
    ``adapter_config.json`` (peft's) and ``unclip_lora.json`` (``meta``: at least ``stage``; the
    component class and the base fingerprint are added)."""
    from safetensors.torch import save_file

    if "stage" not in meta:
        raise ValueError("save_adapter: meta must name the stage the adapter is for")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _peft_configs(model)[name]
    state = {k: v.detach().cpu().contiguous() for k, v in adapter_state_dict(model, name).items()}
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    targets = config_targets(config)
    record = {
        "format": LORA_FORMAT,
        "version": 1,
        **meta,
        "component": type(model).__name__,
        "rank": config.r,
        "alpha": config.lora_alpha,
        "target_modules": targets,
        "base_fingerprint": base_fingerprint(model, targets),
        "base_fingerprints": {
            name: base_fingerprint(model, targets, dtype)
            for name, dtype in HALF_FINGERPRINTS.items()
        },
    }
    (folder / LORA_META).write_text(json.dumps(record, indent=2) + "\n")


def read_adapter(path: Union[str, os.PathLike], weight_name: Optional[str] = None) -> AdapterFolder:
    """Read an adapter folder written by :func:`save_adapter` (safetensors only; a pickled
    ``adapter_model.bin`` is refused). ``weight_name``: the weights file's name in the folder
    when it is not ``adapter_model.safetensors`` (a renamed copy)."""
    peft = require_peft()
    path = Path(path)
    if weight_name is not None:
        if Path(weight_name).name != weight_name or not weight_name.endswith(".safetensors"):
            raise ValueError(
                f"weight_name must be a .safetensors file name inside the adapter folder, got "
                f"{weight_name!r}"
            )
        if not (path / weight_name).is_file():
            raise FileNotFoundError(f"LoRA adapter weights {path / weight_name} not found")
    weights_file = weight_name or ADAPTER_WEIGHTS
    if not path.is_dir():
        raise FileNotFoundError(
            f"LoRA adapter folder not found: {path}; give the folder a run with train.lora "
            "exported (<output_dir>/final/<stage>_lora)"
        )
    for needed in (weights_file, ADAPTER_CONFIG, LORA_META):
        if not (path / needed).is_file():
            if needed == ADAPTER_WEIGHTS and (path / "adapter_model.bin").is_file():
                raise ValueError(
                    f"{path}: adapter_model.bin is a pickle, which can run code when loaded; "
                    f"only {ADAPTER_WEIGHTS} is read"
                )
            raise FileNotFoundError(
                f"{path} is not a LoRA adapter folder: {needed} is missing (expected "
                f"{ADAPTER_WEIGHTS}, {ADAPTER_CONFIG} and {LORA_META})"
            )
    meta = json.loads((path / LORA_META).read_text())
    if meta.get("format") != LORA_FORMAT or "stage" not in meta:
        raise ValueError(f"{path / LORA_META} is not an unclip LoRA record (format {LORA_FORMAT})")
    config = peft.LoraConfig.from_pretrained(str(path))
    # a truncated or corrupt file is a one-line error naming it
    weights = load_safetensors(path / weights_file, "LoRA adapter")
    return AdapterFolder(path, config, weights, meta)


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """``PATH`` or ``PATH:SCALE`` (the command line's ``--lora``) → ``(path, scale)``; a colon is
    read as the scale separator only when what follows it is a number."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0
