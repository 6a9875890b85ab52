"""unclip: the trainable unCLIP (DALL-E 2) text-to-image library.

The names below are imported on first use (PEP 562), so ``import unclip`` and the command
line's ``--help`` do not pay for torch, open_clip and diffusers; ``from unclip import
UnCLIPPipeline`` works as usual. Folder layouts of other libraries (diffusers/Karlo) are found
through the ``unclip.folder_formats`` entry points when a folder needs them (see
:mod:`unclip.pipeline.folders`). Names that moved into the sub-packages keep their old import
paths for now, with a one-time ``FutureWarning`` (:mod:`unclip._compat`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from unclip import _compat

__version__ = "0.1.0"

# public name -> the core module that defines it
_EXPORTS = {
    "UnCLIPPipeline": "unclip.pipeline.pipeline",
    "TokenPipeline": "unclip.pipeline.token_pipeline",
    "KandinskyPipeline": "unclip.pipeline.kandinsky",
    "BasePipeline": "unclip.pipeline.base",
    "load_pipeline": "unclip.pipeline.auto",
    "AutoPipeline": "unclip.pipeline.auto",
    "UnCLIPOutput": "unclip.pipeline.output",
    "slerp": "unclip.sampling.utils",
    "CLIP": "unclip.nets.clip",
    "FrozenCLIP": "unclip.nets.clip",
    "TextEncoding": "unclip.nets.clip",
    "UnCLIPPrior": "unclip.nets.prior",
    "UnCLIPARPrior": "unclip.nets.ar_prior",
    "UnCLIPDecoder": "unclip.nets.decoder",
    "UnCLIPUpsampler": "unclip.nets.decoder",
    "load_config": "unclip.utils.config",
}

__all__ = [
    "UnCLIPPipeline",
    "TokenPipeline",
    "KandinskyPipeline",
    "BasePipeline",
    "load_pipeline",
    "AutoPipeline",
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
    from unclip.nets.ar_prior import UnCLIPARPrior
    from unclip.nets.clip import CLIP, FrozenCLIP
    from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
    from unclip.nets.prior import UnCLIPPrior
    from unclip.nets.text_encoding import TextEncoding
    from unclip.pipeline.auto import AutoPipeline, load_pipeline
    from unclip.pipeline.base import BasePipeline
    from unclip.pipeline.kandinsky import KandinskyPipeline
    from unclip.pipeline.output import UnCLIPOutput
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.pipeline.token_pipeline import TokenPipeline
    from unclip.sampling.utils import slerp
    from unclip.utils.config import load_config


_compat.install()


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unclip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
