"""unCLIP's CLIP: an open_clip model with its tokenizer, text encoder (pooled + token states) and
image encoder. The pipeline uses it frozen; the shapes CLIP trainer trains the same class.

Shapes (``D`` = CLIP embedding size, ``L`` = context length, ``W`` = text transformer width):

* ``encode_text(prompts)`` → :class:`TextEncoding` with ``text_embed [B, D]`` (unit norm),
  ``text_tokens [B, L, W]`` (final-layer token states after the final LayerNorm) and
  ``text_mask [B, L]`` (True on real tokens up to the end token, start/end tokens included).
* ``encode_image(images)`` → ``image_embed [B, D]`` (unit norm). ``images`` is a PIL image, a list
  of them (open_clip's own preprocessing) or a float tensor ``[B, 3, H, W]`` in ``[-1, 1]`` (resized
  on the shorter side with bicubic antialiasing, centre-cropped and normalised the same way).

Loading never downloads unless ``pretrained`` is an open_clip hub tag (e.g. ``"openai"``)::

    clip = CLIP.from_config(ClipConfig("ViT-L-14", pretrained="/models/vit-l-14.safetensors"))
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=TINY_CFG))   # custom, random init

Weights converted from diffusers/Karlo (:mod:`unclip.interop.diffusers`) set
``normalize_embeds=False`` (Karlo feeds the raw projected CLIP embeddings to its prior and decoder),
use :class:`CompatTokenizer` (the text handling of transformers' ``CLIPTokenizer``) and, without an
image tower in the source folder, ``has_vision=False`` (``encode_image`` then raises).

``FrozenCLIP`` is another name for :class:`CLIP`, kept so existing code keeps working.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import open_clip
import torch
import torch.nn.functional as F
from open_clip.model import CLIP as OpenCLIPModel
from open_clip.model import CustomTextCLIP
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image

from unclip.nets.clip_features import _feature_map, named_submodule
from unclip.nets.clip_tokenizer import _make_tokenizer
from unclip.nets.clip_weights import (
    KEPT_TOKENS_KEY,
    WEIGHTS_NAME,
    _load_safetensors,
    _token_table_key,
    load_pretrained_weights,
)
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.utils.files import write_folder
from unclip.utils.images import resize_crop_tensor

__all__ = [
    "CLIP",
    "FrozenCLIP",
    "closed_vocabulary_ids",
    "build_open_clip_model",
    "tiny_clip_config",
]

CONFIG_NAME = "config.json"


def build_open_clip_model(model_cfg: dict) -> torch.nn.Module:
    """A randomly initialised open_clip model (its ``CLIP`` or ``CustomTextCLIP``) for
    ``model_cfg``."""
    cfg = copy.deepcopy(model_cfg)
    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in cfg.get("text_cfg", {})
    cfg.pop("preprocess_cfg", None)
    cls = CustomTextCLIP if custom_text else OpenCLIPModel
    return cls(**cfg)


class CLIP(torch.nn.Module):
    """An open_clip model with the tokenizer and preprocessing unCLIP needs (see module doc).

    The wrapped model starts in eval mode with gradients off, as the pipeline uses it; a trainer
    turns them back on."""

    #: open_clip's CLIP or CustomTextCLIP; open_clip ships no types, so its towers (``visual``,
    #: ``text``) and methods (``encode_image``, ...) are untyped
    model: Any

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        model_name: str,
        model_cfg: dict,
        pretrained: str | None = None,
        *,
        normalize_embeds: bool = True,
        has_vision: bool = True,
        tokenizer_cfg: dict | None = None,
    ):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_cfg = model_cfg
        self.pretrained = pretrained
        # L2-normalise text/image embeddings (Karlo: False)
        self.normalize_embeds = bool(normalize_embeds)
        # False: the image tower is a placeholder without weights
        self.has_vision = bool(has_vision)
        # None: open_clip's SimpleTokenizer; else CompatTokenizer kwargs
        self.tokenizer_cfg = tokenizer_cfg
        # closed vocabulary: the token ids whose embedding rows the weights file holds (None: all
        # of them); see save_pretrained(keep_tokens=...)
        self.kept_token_ids: torch.Tensor | None = None
        # False after drop_text_tower(): encode_text then raises
        self.has_text = True
        visual = model.visual
        size = getattr(visual, "image_size", model_cfg.get("vision_cfg", {}).get("image_size", 224))
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        pp = getattr(visual, "preprocess_cfg", None) or {}
        self.image_mean = tuple(pp.get("mean", open_clip.OPENAI_DATASET_MEAN))
        self.image_std = tuple(pp.get("std", open_clip.OPENAI_DATASET_STD))
        self.preprocess = open_clip.image_transform(
            self.image_size, is_train=False, mean=self.image_mean, std=self.image_std
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: ClipConfig) -> CLIP:
        """Build from a :class:`ClipConfig` (model name + tag/local path, or a custom
        ``model_cfg``)."""
        if cfg.model_cfg is not None:
            model_cfg = copy.deepcopy(cfg.model_cfg)
        else:
            model_cfg = open_clip.get_model_config(cfg.model_name)
            if model_cfg is None:
                raise ValueError(
                    f"unknown open_clip model name {cfg.model_name!r}; use one of "
                    f"open_clip.list_models() (e.g. 'ViT-L-14') or give clip.model_cfg for a "
                    f"custom architecture"
                )
        model = build_open_clip_model(model_cfg)
        kept = None
        if cfg.pretrained:
            kept = load_pretrained_weights(model, cfg.model_name, cfg.pretrained)
        tokenizer = _make_tokenizer(cfg.model_name, model_cfg)
        clip = cls(model, tokenizer, cfg.model_name, model_cfg, cfg.pretrained)
        # a closed-vocabulary file: the same CLIP as from_pretrained gives (fingerprint, warnings)
        clip.kept_token_ids = kept
        return clip

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool | None = None,
        torch_dtype: torch.dtype | str | None = None,
        variant: str | None = None,
    ) -> CLIP:
        """Load a folder written by :meth:`save_pretrained` (``config.json`` +
        ``model.safetensors``), or a Hub repo id's (``org/name``, ``subfolder``: e.g. ``"clip"``
        of a pipeline repo; see :func:`unclip.io.hub.resolve_folder` for ``revision``,
        ``cache_dir``, ``local_files_only``). ``torch_dtype``: cast the weights after loading;
        ``variant``: read ``model.<variant>.safetensors``."""
        from unclip.io.hub import resolve_folder
        from unclip.io.weights import variant_file
        from unclip.utils.precision import parse_dtype

        dtype = parse_dtype(torch_dtype)
        path = resolve_folder(
            path,
            subfolder=subfolder,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            variant=variant,
            what="clip",
        )
        cfg_file = path / CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"CLIP folder {path} has no {CONFIG_NAME}; expected a folder written by "
                f"CLIP.save_pretrained"
            )
        from unclip.io.safety import pickle_refusal, pickles_in
        from unclip.io.weights import read_json

        meta = read_json(cfg_file, "clip")
        model = build_open_clip_model(meta["model_cfg"])
        weights = path / variant_file(WEIGHTS_NAME, variant)
        if variant and not weights.is_file():
            raise FileNotFoundError(f"CLIP weights of variant {variant!r} missing: {weights}")
        kept = None
        if weights.is_file():
            kept = _load_safetensors(model, weights)
        elif pickles_in(path):
            raise pickle_refusal(pickles_in(path)[0], "clip", path)
        elif meta.get("pretrained"):
            load_pretrained_weights(model, meta["model_name"], meta["pretrained"])
        else:
            raise FileNotFoundError(
                f"CLIP weights missing: provide {weights} (or set 'pretrained' in {cfg_file})"
            )
        tok_cfg = meta.get("tokenizer")
        clip = cls(
            model,
            _make_tokenizer(meta["model_name"], meta["model_cfg"], tok_cfg),
            meta["model_name"],
            meta["model_cfg"],
            meta.get("pretrained"),
            normalize_embeds=meta.get("normalize_embeds", True),
            has_vision=meta.get("has_vision", True),
            tokenizer_cfg=tok_cfg,
        )
        clip.kept_token_ids = kept
        return clip.to(dtype=dtype) if dtype is not None else clip

    def save_pretrained(
        self,
        path: str | os.PathLike,
        save_weights: bool = True,
        keep_tokens: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Write ``config.json`` and (by default) ``model.safetensors`` to the folder ``path``.

        The folder is written as ``<path>.tmp`` and then takes the place of ``path`` (an existing
        one is replaced whole), so ``path`` never holds a half-written CLIP, also when the disk
        fills up or the process is killed.

        ``keep_tokens``: store only these rows of the token-embedding table (a closed vocabulary,
        e.g. the words of a procedural caption world; :func:`closed_vocabulary_ids`), with their
        ids. For a small CLIP the 49408-row table is most of the file (6.3 of 7.4 MB for the shapes
        CLIP). Loading puts the rows back in place and zeros elsewhere, so prompts made of kept
        tokens encode exactly as before and :meth:`tokenize` warns about any other token. A CLIP
        loaded from such a file saves the same rows again unless ``keep_tokens`` says otherwise.
        """
        path = Path(path)
        ids = (
            self.kept_token_ids
            if keep_tokens is None
            else torch.as_tensor(keep_tokens, dtype=torch.int64)
        )
        if ids is not None:
            ids = torch.unique(ids.to(torch.int64).flatten())  # sorted
            vocab = self.model.state_dict()[_token_table_key(self.model.state_dict())].shape[0]
            if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(
                    f"keep_tokens must be a non-empty set of token ids in [0, {vocab}), got "
                    f"{ids.numel()} ids in [{ids.min() if ids.numel() else '-'}, "
                    f"{ids.max() if ids.numel() else '-'}]"
                )
        write_folder(path, lambda tmp: self._write_pretrained(tmp, save_weights, ids))

    def _write_pretrained(self, path: Path, save_weights: bool, ids) -> None:
        from safetensors.torch import save_file

        meta = {
            "model_name": self.model_name,
            "model_cfg": self.model_cfg,
            "pretrained": None if save_weights else self.pretrained,
            "normalize_embeds": self.normalize_embeds,
            "has_vision": self.has_vision,
            "tokenizer": self.tokenizer_cfg,
            "kept_tokens": None if ids is None else int(ids.numel()),
        }
        (path / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
        if save_weights:
            state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
            if ids is not None:
                key = _token_table_key(state)
                state[key] = state[key][ids].contiguous()
                state[KEPT_TOKENS_KEY] = ids
            save_file(state, str(path / WEIGHTS_NAME))

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
    ):
        """Upload the folder :meth:`save_pretrained` writes to the Hub model repo ``repo_id``
        (created if needed; :func:`unclip.io.hub.push_folder`); returns the ``CommitInfo``."""
        from unclip.io.hub import push_folder

        return push_folder(
            self.save_pretrained,
            repo_id,
            commit_message=commit_message,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )

    def fingerprint(self, dtype: Optional[torch.dtype] = None) -> str:
        """Short sha256 (16 hex digits) of this CLIP's model name, config and weights: identifies
        the CLIP a component was trained with, or that cached features came from. ``dtype``: of
        the floating weights rounded to it first (what a CLIP cast to it holds).

        Floating weights are hashed as float32 on the CPU and a closed-vocabulary token table only
        by its kept rows, so a CLIP hashes the same before :meth:`save_pretrained` and after
        :meth:`from_pretrained` (also when saved in fp16 from fp16 values)."""
        import hashlib

        h = hashlib.sha256(self.model_name.encode())
        h.update(json.dumps(self.model_cfg, sort_keys=True, default=str).encode())
        state = self.model.state_dict()
        kept = self.kept_token_ids
        table = _token_table_key(state) if kept is not None else None
        for key, value in state.items():
            value = value.detach().cpu()
            if value.is_floating_point():
                value = (value if dtype is None else value.to(dtype)).float()
            if kept is not None and key == table:
                value = value[torch.unique(kept.to(torch.int64).cpu())]
            h.update(key.encode())
            h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ properties
    @property
    def embed_dim(self) -> int:
        """D, the size of the joint CLIP embedding."""
        return int(self.model_cfg["embed_dim"])

    @property
    def text_width(self) -> int:
        """W, the width of the text transformer's token states."""
        return int(self.model_cfg["text_cfg"].get("width", 512))

    @property
    def logit_scale(self) -> float:
        """The temperature its contrastive training learnt: image–text logits are this times the
        cosine (100 for OpenAI's CLIPs, and for CLIPs converted from diffusers/Karlo folders, which
        do not store it)."""
        scale = getattr(self.model, "logit_scale", None)
        return 100.0 if scale is None else float(scale.detach().float().exp())

    @property
    def context_length(self) -> int:
        """L, the tokenizer's context length."""
        return int(self.tokenizer.context_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ text
    def tokenize(self, prompts: Union[str, Sequence[str]], warn: bool = True) -> torch.Tensor:
        """Token ids ``[B, L]``; warns (showing the cut text) when a prompt exceeds the context
        length."""
        prompts = check_prompts(prompts)
        tokens = self.tokenizer(prompts)
        if warn and self.kept_token_ids is not None:
            unknown = ~torch.isin(tokens, self.kept_token_ids)
            if unknown.any():
                words = sorted(
                    {self.tokenizer.decode([int(i)]).strip() for i in tokens[unknown].tolist()}
                )
                warnings.warn(
                    f"this CLIP keeps a closed vocabulary ({self.kept_token_ids.numel()} tokens); "
                    f"{words} are outside it and read as zero embeddings, so prompts with them are "
                    f"not understood",
                    stacklevel=3,
                )
        if warn and isinstance(self.tokenizer, SimpleTokenizer):
            limit = self.context_length - 2  # start and end tokens
            for p in prompts:
                ids = self.tokenizer.encode(p)
                if len(ids) > limit:
                    kept = self.tokenizer.decode(ids[:limit]).strip()
                    cut = self.tokenizer.decode(ids[limit:]).strip()
                    warnings.warn(
                        f"prompt truncated to {self.context_length} tokens: kept {kept!r}, "
                        f"cut {cut!r}",
                        stacklevel=3,
                    )
        return tokens

    def drop_text_tower(self) -> CLIP:
        """Free the text tower's weights (in place; returns ``self``) for a job that only
        embeds images, such as a Kandinsky decoder run: ``encode_text`` then raises. The image
        tower, the embedding size and the tokenizer stay."""
        m = self.model
        if isinstance(m, OpenCLIPModel):
            for name in ("transformer", "token_embedding", "ln_final"):
                setattr(m, name, None)
            for name in ("positional_embedding", "text_projection"):
                setattr(m, name, None)
        else:
            m.text = None
        self.has_text = False
        return self

    @torch.no_grad()
    def encode_text(self, prompts: Union[str, Sequence[str], torch.Tensor]) -> TextEncoding:
        """Encode prompts (or token ids ``[B, L]``) → :class:`TextEncoding` (see module doc for
        shapes)."""
        if not self.has_text:
            raise ValueError(
                "this CLIP's text tower was dropped (drop_text_tower: a job that embeds images "
                "only); load the CLIP again to encode text"
            )
        ids = prompts if isinstance(prompts, torch.Tensor) else self.tokenize(prompts)
        ids = ids.to(self.device)
        m = self.model
        if isinstance(m, OpenCLIPModel):
            cast = m.transformer.get_cast_dtype()
            x = m.token_embedding(ids).to(cast) + m.positional_embedding.to(cast)
            x = m.transformer(x, attn_mask=m.attn_mask)
            tokens = m.ln_final(x)
            pooled = open_clip.transformer.text_global_pool(
                tokens, ids, m.text_pool_type, eos_token_id=getattr(m, "text_eos_id", None)
            )
            if m.text_projection is not None:
                pooled = (
                    m.text_projection(pooled)
                    if isinstance(m.text_projection, torch.nn.Linear)
                    else pooled @ m.text_projection
                )
        else:  # CustomTextCLIP with an open_clip TextTransformer
            text = m.text
            old = getattr(text, "output_tokens", False)
            text.output_tokens = True
            try:
                pooled, tokens = text(ids)
            finally:
                text.output_tokens = old
        if isinstance(self.tokenizer, SimpleTokenizer):
            # real tokens: everything up to the first end token
            is_eot = ids == self.tokenizer.eot_token_id
            last = torch.where(is_eot.any(1), is_eot.int().argmax(1), ids.shape[1] - 1)
            mask = torch.arange(ids.shape[1], device=ids.device)[None] <= last[:, None]
        else:
            pad_id = getattr(self.tokenizer, "pad_id", 0) or 0
            mask = ids != pad_id
        pooled = F.normalize(pooled.float(), dim=-1) if self.normalize_embeds else pooled.float()
        return TextEncoding(pooled, tokens.float(), mask)

    # ------------------------------------------------------------------ images
    def preprocess_tensor(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] → CLIP input (shorter side resize, centre crop,
        normalise)."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"image tensor must be [B, 3, H, W], got {tuple(images.shape)}")
        x = resize_crop_tensor((images.float() + 1) / 2, self.image_size).clamp(0, 1)
        mean = torch.tensor(self.image_mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    @torch.no_grad()
    def encode_image(self, images) -> torch.Tensor:
        """PIL image(s) or a ``[B, 3, H, W]`` tensor in [-1, 1] → ``image_embed [B, D]`` (unit
        norm)."""
        if not self.has_vision:
            raise ValueError(
                f"CLIP {self.model_name!r} has no image-tower weights (it was converted from a "
                f"text-to-image diffusers/Karlo folder without image_encoder/), so it cannot embed "
                f"images (variations, reranking, CLIP scores); convert a folder that has "
                f"image_encoder/ (the image-variations layout) or pass image embeddings directly"
            )
        if isinstance(images, Image.Image):
            images = [images]
        if isinstance(images, torch.Tensor):
            pixels = self.preprocess_tensor(images.to(self.device))
        elif (
            isinstance(images, (list, tuple))
            and images
            and all(isinstance(i, Image.Image) for i in images)
        ):
            pixels = torch.stack([self.preprocess(i.convert("RGB")) for i in images]).to(
                self.device
            )
        else:
            raise TypeError(
                "images must be a PIL image, a non-empty list of PIL images, or a float tensor "
                "[B, 3, H, W] in [-1, 1]"
            )
        feats = self.model.encode_image(pixels.to(self.dtype))
        return F.normalize(feats.float(), dim=-1) if self.normalize_embeds else feats.float()

    @torch.no_grad()
    def layer_features(self, images: torch.Tensor, layer: str, key: str = "layer") -> torch.Tensor:
        """The image tower's output at its module ``layer`` for ``images [B, 3, H, W]`` in [-1, 1],
        as a ``[B, C, h, w]`` float feature map (the tower runs up to that layer only): a
        ModifiedResNet stage (``layer1``..``layer4``) as it is, a ViT block's
        (``transformer.resblocks.<i>``) patch tokens laid out on the patch grid. ``key`` names the
        setting in error messages."""
        if not self.has_vision:
            raise ValueError(
                f"{key}: CLIP {self.model_name!r} has no image-tower weights (it was converted "
                "from a text-to-image folder without image_encoder/), so it has no image "
                "features; use a CLIP with its image tower"
            )
        module = named_submodule(self.model.visual, layer, key)
        captured = []

        class _Enough(Exception):
            pass

        def grab(_module, _args, output):
            captured.append(output)
            raise _Enough

        handle = module.register_forward_hook(grab)
        try:
            self.model.visual(self.preprocess_tensor(images.to(self.device)).to(self.dtype))
        except _Enough:
            pass
        finally:
            handle.remove()
        if not captured:
            raise ValueError(f"{key}={layer!r} did not run in the CLIP's image tower")
        out = _feature_map(self.model.visual, captured[0])
        if out is None:
            got = captured[0]
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(
                f"{key}={layer!r} outputs {shape}, not a feature map; name a convolutional "
                "stage of a ModifiedResNet (layer1..layer4) or a block of a ViT "
                "(transformer.resblocks.<i>)"
            )
        return out.float()


def closed_vocabulary_ids(clip: CLIP, words: Sequence[str]) -> torch.Tensor:
    """The token ids a closed vocabulary of ``words`` can produce with ``clip``'s tokenizer (every
    word's tokens, the start/end tokens and the padding), for
    ``CLIP.save_pretrained(keep_tokens=...)``. The CLIP tokenizer splits text into words before BPE,
    so any sentence of these words (and ``,``) tokenizes to these ids."""
    words = [w for w in words if w.strip()]
    if not words:
        raise ValueError("closed_vocabulary_ids needs at least one word")
    return torch.unique(clip.tokenizer(words))


def tiny_clip_config(
    embed_dim: int = 32,
    width: int = 32,
    layers: int = 2,
    image_size: int = 32,
    context_length: int = 32,
    vocab_size: int = 49408,
) -> dict:
    """An open_clip model config for tests and small demos (a few hundred thousand parameters)."""
    return {
        "embed_dim": embed_dim,
        "vision_cfg": {
            "image_size": image_size,
            "layers": layers,
            "width": width,
            "patch_size": 8,
            "head_width": 16,
        },
        "text_cfg": {
            "context_length": context_length,
            "vocab_size": vocab_size,
            "width": width,
            "heads": max(1, width // 16),
            "layers": layers,
        },
    }


#: Another name for :class:`CLIP`, kept so existing code keeps working.
FrozenCLIP = CLIP


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
