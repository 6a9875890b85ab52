"""``train.init_weights``: start a run from an exported component's weights (fine-tuning).

Safetensors only: a pickle or a damaged file is a one-line error naming it, never unpickled.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from unclip.io.weights import load_safetensors, load_weights, state_mismatch
from unclip.train.repa import exported_state

__all__ = ["load_initial_weights"]

logger = logging.getLogger("unclip.train")


def load_initial_weights(model: torch.nn.Module, path, partial: bool = False) -> Path:
    """Load a component's weights (a component folder, or a ``.safetensors`` file) into ``model``.

    Every tensor of the model must be present with the same shape (the configs must match); dtypes
    are converted (e.g. fp16 shipped weights into an fp32 model). With ``partial`` the tensors whose
    name and shape fit are loaded and the model's others keep their fresh initialisation (a changed
    or added part, e.g. a decoder given its own caption transformer); what was left out is logged,
    and weights of which nothing fits are an error. Returns ``path``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"init_weights: {path} does not exist; give a component folder or a .safetensors file"
        )
    # a pickle or a damaged file is a one-line error naming it (never unpickled)
    load = load_weights if path.is_dir() else load_safetensors
    state = load(path, "init_weights")
    state = exported_state(state)  # a repa checkpoint's model.safetensors: the decoder's part
    own = model.state_dict()
    problems = state_mismatch(
        {k: tuple(v.shape) for k, v in own.items()},
        {k: tuple(v.shape) for k, v in state.items()},
        "in the model",
    )
    if problems and not partial:
        raise ValueError(
            f"init_weights {path} do not fit this model: {problems}"
            ". The stage config must describe the same architecture (and CLIP) as the weights"
            " (or set train.init_weights_partial to load only the tensors that fit)."
        )
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    for prefix, module in model.named_modules():
        # tensors that only mean something together (e.g. the AR prior's quantiser fit and its
        # "fitted" flag): all of them load, or none and the module keeps its fresh state
        for group in getattr(module, "_load_together", ()):
            keys = [f"{prefix}.{name}" if prefix else name for name in group]
            if not all(k in fits for k in keys):
                for k in keys:
                    fits.pop(k, None)
    if not fits:
        raise ValueError(
            f"init_weights {path}: no tensor fits this model by name and shape ({problems}); "
            "are they weights of this stage?"
        )
    if problems:
        fresh = sum(own[k].numel() for k in own if k not in fits)
        logger.warning(
            "init_weights %s loaded partially: %d of the model's %d tensors; %s parameters keep "
            "their fresh initialisation (%s)",
            path,
            len(fits),
            len(own),
            f"{fresh:,}",
            problems,
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in fits.items()}, strict=not problems)
    return path
