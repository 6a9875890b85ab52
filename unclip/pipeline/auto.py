"""One loading entry for every family's pipeline folder.

    from unclip.pipeline.auto import load_pipeline
    pipe = load_pipeline("runs/dalle/final/pipeline")   # a TokenPipeline
    pipe = load_pipeline(None)                          # the bundled unCLIP shapes model

A local folder whose ``unclip.json`` names a token family (``"family": "dalle"`` or
``"dalle_mega"``) loads as :class:`~unclip.pipeline.token_pipeline.TokenPipeline`; a local diffusers
Kandinsky 2.2 decoder folder (its ``model_index.json`` names a ``KandinskyV22`` pipeline) as
:class:`~unclip.pipeline.kandinsky.KandinskyPipeline`, with the prior its model card names or
``prior=``; everything else
(unCLIP folders, which name no family or ``"unclip"``, diffusers folders, Hub ids, ``None`` for the
bundled model) goes to :meth:`UnCLIPPipeline.from_pretrained <unclip.pipeline.pipeline.
UnCLIPPipeline.from_pretrained>` with the same keyword arguments.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from unclip.io.weights import read_json
from unclip.pipeline.base import BasePipeline
from unclip.pipeline.folders import PIPELINE_FILE
from unclip.pipeline.token_pipeline import TOKEN_FAMILIES, TokenPipeline

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["load_pipeline", "pipeline_family", "AutoPipeline", "is_pipeline"]


def pipeline_family(path: Union[str, os.PathLike, None]) -> str:
    """The family of the pipeline at ``path``: ``dalle``, ``dalle_mega``, ``kandinsky`` (a local
    diffusers Kandinsky 2.2 folder) or ``unclip`` (anything else)."""
    if path is None:
        return "unclip"
    index = Path(path) / PIPELINE_FILE
    diffusers_index = Path(path) / "model_index.json"
    if not index.is_file() and diffusers_index.is_file():
        name = read_json(diffusers_index, "model_index.json").get("_class_name")
        return "kandinsky" if str(name).startswith("KandinskyV22") else "unclip"
    if not index.is_file():
        return "unclip"
    family = read_json(index, "pipeline").get("family", "unclip")
    if family != "unclip" and family not in TOKEN_FAMILIES:
        raise ValueError(
            f"{index}: unknown pipeline family {family!r}; this unclip reads "
            f"{', '.join(('unclip',) + TOKEN_FAMILIES)}"
        )
    return family


def load_pipeline(path: Union[str, os.PathLike, None] = None, **kwargs):
    """The pipeline at ``path`` (see the module doc); ``kwargs`` as
    :meth:`UnCLIPPipeline.from_pretrained` takes them. A token pipeline folder takes the dtype,
    autocast, memory-format and device options; the Hub options are refused for it with what to
    do."""
    family = pipeline_family(path)
    if family == "unclip" and _is_hub_id(path):
        # a Hub repo holds any family's folder: fetch it (once, into the cache) and look
        family = pipeline_family(_fetched(path, kwargs))
        if family == "kandinsky":  # its prior is found from the repo id, as diffusers does
            return _load_kandinsky(path, kwargs)
        if family != "unclip":  # a token family: its snapshot loads as a local folder
            path = _fetched(path, kwargs)
            hub = ("revision", "cache_dir", "local_files_only", "token", "variant")
            kwargs = {k: v for k, v in kwargs.items() if k not in hub}
    if family == "unclip":
        from unclip.pipeline.pipeline import UnCLIPPipeline

        return UnCLIPPipeline.from_pretrained(path, **kwargs)
    assert path is not None  # None is the bundled unCLIP model
    if family == "kandinsky":
        return _load_kandinsky(path, kwargs)
    own = {"torch_dtype", "dtype", "autocast_dtype", "memory_format", "device_map"}
    own.add("allow_external_components")
    given = {k: v for k, v in kwargs.items() if v is not None and k not in own}
    if given:
        raise ValueError(
            f"{', '.join(sorted(given))}: not supported for a token pipeline folder ({path}); "
            "leave them out"
        )
    return TokenPipeline.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in own})


def _is_hub_id(path) -> bool:
    from unclip.io.hub import is_repo_id

    return path is not None and not Path(path).expanduser().exists() and is_repo_id(str(path))


def _fetched(repo_id, kwargs: dict) -> Path:
    """The local snapshot of ``repo_id`` (the Hub options in ``kwargs`` apply)."""
    from unclip.pipeline.folders import resolve_pipeline_folder

    hub = {k: kwargs.get(k) for k in ("revision", "cache_dir", "local_files_only", "variant")}
    if kwargs.get("token") is not None:
        hub["token"] = kwargs["token"]
    return resolve_pipeline_folder(repo_id, **hub)


def _load_kandinsky(path, kwargs: dict):
    from unclip.pipeline.kandinsky import KandinskyPipeline

    own = {"prior", "torch_dtype", "dtype", "autocast_dtype", "variant", "revision", "cache_dir"}
    own |= {"local_files_only", "token"}
    given = {k for k, v in kwargs.items() if v is not None and k not in own}
    if given:
        raise ValueError(
            f"{', '.join(sorted(given))}: not supported for a Kandinsky 2.2 folder ({path}); "
            "leave them out"
        )
    return KandinskyPipeline.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in own})


def is_pipeline(obj) -> TypeIs[BasePipeline]:
    """Whether ``obj`` is a loaded pipeline of any family (rather than a path or name)."""
    return isinstance(obj, BasePipeline)


class AutoPipeline:
    """``AutoPipeline.from_pretrained(path, **kwargs)``: :func:`load_pipeline`."""

    @staticmethod
    def from_pretrained(path=None, **kwargs):
        return load_pipeline(path, **kwargs)
