"""Loading a CLIP's weights: a safetensors file or folder (pickles refused), open_clip's own
pretrained names, and the closed-vocabulary token tables of a saved CLIP (``keep_tokens``).
"""

from __future__ import annotations

import os
from pathlib import Path

import open_clip
import torch

#: Key of the token ids stored beside a closed-vocabulary token table
#: (``CLIP.save_pretrained(keep_tokens=...)``).
KEPT_TOKENS_KEY = "kept_token_ids"


def _token_table_key(state: dict) -> str:
    keys = [k for k in state if k.endswith("token_embedding.weight")]
    if len(keys) != 1:
        raise ValueError(f"expected one token-embedding table in the CLIP weights, found {keys}")
    return keys[0]


def _load_safetensors(model: torch.nn.Module, file: Path) -> torch.Tensor | None:
    """Load ``file`` into ``model``; returns the kept token ids of a closed-vocabulary file, else
    None."""
    from unclip.io.weights import load_safetensors

    state = load_safetensors(file, "clip")
    kept = state.pop(KEPT_TOKENS_KEY, None)
    if kept is not None:  # a closed-vocabulary table: put its rows in place, zeros elsewhere
        key = _token_table_key(state)
        full = model.state_dict()[key]
        rows = state[key]
        if (
            kept.ndim != 1
            or rows.shape != (kept.numel(), full.shape[1])
            or kept.max() >= full.shape[0]
        ):
            raise ValueError(
                f"CLIP weights {file}: the closed-vocabulary token table {tuple(rows.shape)} with "
                f"{kept.numel()} ids does not fit the model's table {tuple(full.shape)}"
            )
        table = torch.zeros(full.shape, dtype=rows.dtype)
        table[kept] = rows
        state[key] = table
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("attn_mask")]
    if missing or unexpected:
        raise ValueError(
            f"CLIP weights {file} do not match the model config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return kept


def load_pretrained_weights(
    model: torch.nn.Module, model_name: str, pretrained: str
) -> torch.Tensor | None:
    """Load a local weights file or folder, or an open_clip hub tag (the only path that downloads),
    into the open_clip ``model`` built for ``model_name``. Returns the kept token ids of a
    closed-vocabulary file (:meth:`CLIP.save_pretrained`), else None."""
    from unclip.io.safety import pickle_refusal, pickles_in

    p = Path(pretrained)
    if p.is_dir():
        names = (WEIGHTS_NAME, "open_clip_model.safetensors", "open_clip_pytorch_model.safetensors")
        for name in names:
            if (p / name).is_file():
                p = p / name
                break
        else:
            if pickles_in(p):
                raise pickle_refusal(pickles_in(p)[0], "clip", p)
            raise FileNotFoundError(
                f"no CLIP weights in folder {pretrained}: provide {p / WEIGHTS_NAME} "
                f"or open_clip_model.safetensors"
            )
    if p.is_file():
        if p.suffix != ".safetensors":  # a pickle (.bin/.pt/.ckpt) or an unknown format
            raise pickle_refusal(p, "clip")
        return _load_safetensors(model, p)
    if os.sep in pretrained or pretrained.endswith((".safetensors", ".bin", ".pt", ".pth")):
        raise FileNotFoundError(f"CLIP weights file not found: {pretrained}")
    tags = open_clip.list_pretrained_tags_by_model(model_name)
    if pretrained not in tags:
        raise ValueError(
            f"{pretrained!r} is neither a local weights path nor a pretrained tag of {model_name} "
            f"(tags: {tags})"
        )
    try:
        ckpt = open_clip.download_pretrained(open_clip.get_pretrained_cfg(model_name, pretrained))
    except Exception as exc:  # offline
        raise FileNotFoundError(
            f"could not download open_clip weights {model_name}/{pretrained} ({exc}); offline, "
            f"download them elsewhere and pass the local file as "
            f"clip.pretrained=/path/to/open_clip_model.safetensors"
        ) from exc
    if not ckpt:
        raise FileNotFoundError(f"could not fetch open_clip weights {model_name}/{pretrained}")
    if not str(ckpt).endswith(".safetensors"):  # this tag is published only as a pickle
        raise pickle_refusal(ckpt, f"clip ({model_name}/{pretrained})")
    from unclip.io.weights import check_safetensors

    check_safetensors(ckpt, f"clip ({model_name}/{pretrained})")
    # open_clip's loader (safetensors for this file) converts older and third-party key layouts
    open_clip.load_checkpoint(model, ckpt, weights_only=True)
    return None


WEIGHTS_NAME = "model.safetensors"
