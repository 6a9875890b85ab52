"""Intermediate features of a CLIP's image tower (:meth:`CLIP.layer_features
<unclip.nets.clip.CLIP.layer_features>`: REPA's alignment target, CLIP-FID): a named layer's output
as a feature map ``[B, C, h, w]``.
"""

from __future__ import annotations

from typing import Optional

import torch


def named_submodule(root: torch.nn.Module, name: str, key: str) -> torch.nn.Module:
    """``root``'s submodule ``name`` (dotted); a name that is none is a ``ValueError`` naming the
    setting ``key`` and listing the top-level modules (with the block names for a ViT tower)."""
    modules = dict(root.named_modules())
    if name not in modules or not name:
        top = [n for n, _ in root.named_children()]
        hint = ""
        if "transformer" in top and hasattr(root, "grid_size"):
            hint = " (a ViT image tower: name a block, transformer.resblocks.<i>)"
        raise ValueError(f"{key}={name!r} names no module; the top-level ones are {top}{hint}")
    return modules[name]


def _feature_map(visual: torch.nn.Module, out) -> Optional[torch.Tensor]:
    """``out`` as ``[B, C, h, w]``: a convolutional map as it is; a ViT block's tokens without
    the class (and register) tokens in front, laid out on the patch grid."""
    if not isinstance(out, torch.Tensor):
        return None
    if out.ndim == 4:
        return out
    grid = getattr(visual, "grid_size", None)
    if out.ndim != 3 or grid is None:
        return None
    if not getattr(getattr(visual, "transformer", None), "batch_first", True):
        out = out.transpose(0, 1)  # [L, B, D] → [B, L, D]
    gh, gw = grid
    if out.shape[1] < gh * gw:
        return None
    patches = out[:, out.shape[1] - gh * gw :]
    return patches.transpose(1, 2).reshape(out.shape[0], out.shape[2], gh, gw)
