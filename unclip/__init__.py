"""unclip: the trainable unCLIP (DALL-E 2) text-to-image library.

The names below are imported on first use (PEP 562), so ``import unclip`` and the command
line's ``--help`` do not pay for torch, open_clip and diffusers; ``from unclip import
UnCLIPPipeline`` works as usual. Folder layouts of other libraries (diffusers/Karlo) are found
through the ``unclip.folder_formats`` entry points when a folder needs them (see
:mod:`unclip.io`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the core module that defines it
_EXPORTS = {
    "UnCLIPPipeline": "unclip.pipeline",
    "UnCLIPOutput": "unclip.pipeline",
    "slerp": "unclip.pipeline",
    "CLIP": "unclip.clip",
    "FrozenCLIP": "unclip.clip",
    "TextEncoding": "unclip.clip",
    "UnCLIPPrior": "unclip.prior",
    "UnCLIPARPrior": "unclip.ar_prior",
    "UnCLIPDecoder": "unclip.decoder",
    "UnCLIPUpsampler": "unclip.decoder",
    "load_config": "unclip.config",
}

__all__ = [
    "UnCLIPPipeline",
    "UnCLIPOutput",
    "CLIP",
    "FrozenCLIP",
    "TextEncoding",
    "UnCLIPPrior",
    "UnCLIPARPrior",
    "UnCLIPDecoder",
    "UnCLIPUpsampler",
    "load_config",
    "slerp",
    "__version__",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports on first use
    from unclip.ar_prior import UnCLIPARPrior
    from unclip.clip import CLIP, FrozenCLIP, TextEncoding
    from unclip.config import load_config
    from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
    from unclip.pipeline import UnCLIPOutput, UnCLIPPipeline, slerp
    from unclip.prior import UnCLIPPrior


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unclip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
