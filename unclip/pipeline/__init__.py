"""Pipelines of every family on one base: :class:`UnCLIPPipeline` (the unCLIP cascade),
:class:`TokenPipeline` (DALL-E, DALL-E Mega), :class:`KandinskyPipeline` (Kandinsky 2.2), the
:class:`BasePipeline` they stand on, :func:`load_pipeline` / :class:`AutoPipeline` (any family's
folder), their outputs, folders, editing, memory, offload and LoRA methods, and generate-to-folder::

    from unclip.pipeline import UnCLIPPipeline, load_pipeline

The names are imported on first use, so importing the package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from unclip._compat import package_getattr

#: public name -> the module that defines it
_EXPORTS = {
    "BasePipeline": "unclip.pipeline.base",
    "ResolvedSampling": "unclip.pipeline.base",
    "UnCLIPPipeline": "unclip.pipeline.pipeline",
    "TokenPipeline": "unclip.pipeline.token_pipeline",
    "KandinskyPipeline": "unclip.pipeline.kandinsky",
    "UnCLIPOutput": "unclip.pipeline.output",
    "load_pipeline": "unclip.pipeline.auto",
    "AutoPipeline": "unclip.pipeline.auto",
    "is_pipeline": "unclip.pipeline.auto",
}

__all__ = [
    "BasePipeline",
    "ResolvedSampling",
    "UnCLIPPipeline",
    "TokenPipeline",
    "KandinskyPipeline",
    "UnCLIPOutput",
    "load_pipeline",
    "AutoPipeline",
    "is_pipeline",
]

if TYPE_CHECKING:
    from unclip.pipeline.auto import AutoPipeline, is_pipeline, load_pipeline
    from unclip.pipeline.base import BasePipeline, ResolvedSampling
    from unclip.pipeline.kandinsky import KandinskyPipeline
    from unclip.pipeline.output import UnCLIPOutput
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.pipeline.token_pipeline import TokenPipeline

# names of the module this package replaced (``unclip.pipeline``), with a one-time FutureWarning
_old_names = package_getattr(__name__)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    return _old_names(name)
