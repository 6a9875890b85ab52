"""The components of the token families as self-describing folders: an image tokenizer (DALL-E's
dVAE or DALL-E Mega's VQGAN) and a token transformer (DALL-E's or Mega's), each built from a
config with a ``type`` and one section per kind, and saved as ``config.json`` +
``model.safetensors`` (+ a short ``README.md`` card).

    cfg = TokenizerConfig(type="dvae", dvae=DVAEConfig(image_size=32, num_codes=64, n_hid=16))
    tok = cfg.build()
    save_component(tok, "out/tokenizer", "tokenizer", cfg)
    tok, cfg = load_tokenizer("out/tokenizer")

Both tokenizers expose ``encode(images [B, 3, H, W] in [-1, 1]) → tokens [B, h, w]`` and
``decode(tokens) → images``; both transformers the sampling interface of
:mod:`unclip.nets.token_common`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import torch

from unclip.io.safety import pickle_refusal, pickles_in
from unclip.io.weights import check_state, load_safetensors, read_json, safetensors_shapes
from unclip.nets.dalle_transformer import DalleConfig, DalleTransformer
from unclip.nets.dvae import DVAEConfig
from unclip.nets.mega_transformer import MegaConfig, MegaTransformer
from unclip.nets.text_encoder import check_tokenizer
from unclip.nets.token_common import parameter_count
from unclip.nets.vqgan import VQGANConfig
from unclip.utils.config import ConfigError, from_dict, to_dict

__all__ = [
    "TokenizerConfig",
    "TokenModelConfig",
    "save_component",
    "load_tokenizer",
    "load_token_model",
    "tokenizer_facts",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def _one_section(owner: str, kind: str, sections: dict) -> None:
    """The section named by ``type`` must be there and the others absent."""
    if sections[kind] is None:
        raise ConfigError(f"{owner}.type is {kind!r} but there is no '{owner}.{kind}:' section")
    extra = [k for k, v in sections.items() if v is not None and k != kind]
    if extra:
        raise ConfigError(
            f"{owner}.type is {kind!r} but the config also has '{owner}.{extra[0]}:'; remove it"
        )


@dataclass
class TokenizerConfig:
    """An image tokenizer: ``type`` ``dvae`` (DALL-E) or ``vqgan`` (DALL-E Mega) and its section."""

    type: Literal["dvae", "vqgan"] = "dvae"
    dvae: Optional[DVAEConfig] = None
    vqgan: Optional[VQGANConfig] = None

    def __post_init__(self) -> None:
        _one_section("tokenizer", self.type, {"dvae": self.dvae, "vqgan": self.vqgan})

    @property
    def model(self):
        return getattr(self, self.type)

    def build(self) -> torch.nn.Module:
        return self.model.build()


def tokenizer_facts(cfg: TokenizerConfig) -> dict:
    """``{"image_size", "grid", "num_codes"}`` of a tokenizer config."""
    m = cfg.model
    return {"image_size": m.image_size, "grid": m.grid, "num_codes": m.num_codes}


@dataclass
class TokenModelConfig:
    """A token transformer: ``type`` ``dalle`` or ``mega`` and its section; ``text_tokenizer``
    names the caption BPE (:data:`unclip.nets.text_encoder.TOKENIZERS`), whose vocabulary the
    section's ``text_vocab_size`` must cover."""

    type: Literal["dalle", "mega"] = "dalle"
    dalle: Optional[DalleConfig] = None
    mega: Optional[MegaConfig] = None
    text_tokenizer: str = "open_clip_bpe"

    def __post_init__(self) -> None:
        _one_section("transformer", self.type, {"dalle": self.dalle, "mega": self.mega})
        try:
            vocab = check_tokenizer(self.text_tokenizer)["vocab_size"]
        except ValueError as exc:
            raise ConfigError(f"transformer.text_tokenizer: {exc}") from None
        if self.type == "mega" and self.text_tokenizer == "open_clip_bpe":
            # the empty caption Mega's super-conditioning runs is [start, end, padding …] in the
            # caption tokenizer's own ids
            want = {"text_bos_id": 49406, "text_eos_id": 49407, "text_pad_id": 0}
            for key, value in want.items():
                if getattr(self.mega, key) != value:
                    raise ConfigError(
                        f"transformer.mega.{key}={getattr(self.mega, key)} does not match the "
                        f"open_clip_bpe caption tokenizer; set it to {value}"
                    )
        if self.model.text_vocab_size < vocab:
            raise ConfigError(
                f"transformer.{self.type}.text_vocab_size={self.model.text_vocab_size} is smaller "
                f"than the {self.text_tokenizer} vocabulary ({vocab}); set it to {vocab}"
            )

    @property
    def model(self):
        return getattr(self, self.type)

    def build(self) -> Union[DalleTransformer, MegaTransformer]:
        return self.model.build()

    def caption_ids(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions → ``(ids [B, text_len], mask [B, text_len])`` (start, BPE tokens, end; the
        mask is false on the zero padding after the end token)."""
        from unclip.nets.text_encoder import caption_tokenizer

        ids = caption_tokenizer(self.text_tokenizer, self.model.text_len)(prompts)
        return ids, ids != 0


_SCHEMAS = {"tokenizer": TokenizerConfig, "transformer": TokenModelConfig}


def save_component(module: torch.nn.Module, folder, component: str, cfg) -> Path:
    """Write ``folder/config.json`` (``{"component", "config"}``), ``model.safetensors`` (fp32
    unless the module is in another dtype) and a ``README.md`` naming what it is."""
    from safetensors.torch import save_file

    if component not in _SCHEMAS:
        raise ValueError(f"component must be one of {', '.join(_SCHEMAS)}, got {component!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(
        json.dumps({"component": component, "config": to_dict(cfg)}, indent=2)
    )
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE))
    n = parameter_count(module)
    loader = "load_tokenizer" if component == "tokenizer" else "load_token_model"
    (folder / "README.md").write_text(
        f"# {component}: {cfg.type}\n\n{n:,} parameters. Load with "
        f"`unclip.nets.token_components.{loader}(folder)`.\n\n"
        f"```json\n{json.dumps(to_dict(cfg.model), indent=2)}\n```\n"
    )
    return folder


def read_component_config(folder, component: str):
    """The checked config of the ``component`` saved in ``folder`` (its ``config.json`` alone;
    the weights are not read): a one-line error naming the file when it is missing, describes
    another component or holds a setting the strict loader refuses."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{component}: {folder} is not a folder; give the {component} folder (config.json "
            "+ model.safetensors)"
        )
    file = folder / CONFIG_FILE
    meta = read_json(file, component)
    if meta.get("component") != component:
        raise ValueError(
            f"{file} describes a {meta.get('component')!r} component, not a "
            f"{component}; give the {component} folder"
        )
    if not isinstance(meta.get("config"), dict):
        raise ValueError(
            f"{component}: {file} has no 'config' mapping (the {component}'s settings, which "
            "save_component writes); re-export the folder"
        )
    try:
        return from_dict(_SCHEMAS[component], meta["config"], source=str(file))
    except ValueError as exc:  # a section's own check (a size out of its bounds) names no file
        if str(file) in str(exc):
            raise
        raise ConfigError(f"{file}: {exc}") from None


def _load(folder, component: str):
    """The one loading path of both components, validating before it builds: ``config.json``
    present, naming this component and holding a ``config`` that the strict loader accepts (a
    known ``type``, every field checked); the weights ``model.safetensors`` only (a pickle is
    refused before it is opened), their names and shapes read from the file's header and
    matched against the module the config describes, built on the meta device; only then the
    network is built and the tensors read. Each failure is one line naming the file and what
    was expected."""
    folder = Path(folder)
    cfg = read_component_config(folder, component)
    file = folder / CONFIG_FILE
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if pickles_in(folder):
            raise pickle_refusal(pickles_in(folder)[0], component, folder)
        raise FileNotFoundError(f"{component}: {weights} is missing; re-export the folder")
    shapes = safetensors_shapes(weights, component)
    try:
        with torch.device("meta"):  # the shapes the config implies, with no memory taken
            expected = cfg.build().state_dict()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{file}: {exc}") from None
    check_state(component, expected, shapes, weights)
    model = cfg.build()
    model.load_state_dict(load_safetensors(weights, component))
    return model.eval(), cfg


def load_tokenizer(folder) -> tuple[torch.nn.Module, TokenizerConfig]:
    """The tokenizer saved in ``folder`` (eval mode) and its config."""
    return _load(folder, "tokenizer")


def load_token_model(folder) -> tuple[torch.nn.Module, TokenModelConfig]:
    """The token transformer saved in ``folder`` (eval mode) and its config."""
    return _load(folder, "transformer")
