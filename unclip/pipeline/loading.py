"""Reading and writing an :class:`~unclip.pipeline.pipeline.UnCLIPPipeline`'s folders: pipeline
folders (its own, diffusers'/Karlo's through the registered readers), component folders exported
by the training commands, the bundled model and the Hub. The pipeline's ``from_pretrained``,
``from_components`` and ``save_pretrained`` call these functions."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional, TypeVar, Union

import torch

from unclip.io.card import read_card_info, write_card
from unclip.nets.clip import CLIP
from unclip.pipeline.cascade import UnCLIPCascade
from unclip.pipeline.diffusers_api import check_from_pretrained_options
from unclip.pipeline.folders import (
    folder_format_reader,
    load_components,
    read_pipeline_folder,
    resolve_pipeline_folder,
    write_pipeline_folder,
)
from unclip.sampling.settings import DEFAULT_DIFFUSION, DEFAULT_SAMPLING
from unclip.utils.precision import parse_autocast, parse_dtype

P = TypeVar("P", bound=UnCLIPCascade)


def one_dtype(torch_dtype, dtype):
    """diffusers' two names for the weights' dtype (``torch_dtype``, and ``dtype`` in its newer
    releases): the one given; both given must agree."""
    if (
        torch_dtype is not None
        and dtype is not None
        and parse_dtype(torch_dtype) != parse_dtype(dtype)
    ):
        raise ValueError(
            f"from_pretrained: torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; give one "
            "of them (they are two names of the same setting)"
        )
    return torch_dtype if torch_dtype is not None else dtype


def load_unclip_pipeline(
    cls: type[P],
    path: Union[str, os.PathLike, None],
    *,
    revision: Optional[str],
    cache_dir: Union[str, os.PathLike, None],
    local_files_only: Optional[bool],
    torch_dtype,
    variant: Optional[str],
    autocast_dtype,
    memory_format: Optional[torch.memory_format],
    token: Union[str, bool, None],
    use_safetensors: Optional[bool],
    low_cpu_mem_usage: Optional[bool],
    device_map: Union[str, torch.device, None],
    allow_external_components: bool,
) -> P:
    """:meth:`UnCLIPPipeline.from_pretrained
    <unclip.pipeline.pipeline.UnCLIPPipeline.from_pretrained>` (its docstring says what each
    option does)."""
    hub_token, device = check_from_pretrained_options(
        token, use_safetensors, low_cpu_mem_usage, device_map
    )
    dtype = parse_dtype(torch_dtype)
    autocast = parse_autocast(autocast_dtype)
    hub = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
    hub.update(hub_token)
    folder = resolve_pipeline_folder(path, variant=variant, **hub)
    reader = folder_format_reader(folder)
    if reader is not None:
        pipe = reader(folder, variant=variant) if variant else reader(folder)
        if not isinstance(pipe, cls) and isinstance(cls, type) and type(pipe) in cls.__mro__:
            pipe = cls(**pipe.components)  # a subclass of the reader's class: same components
        if not isinstance(pipe, cls):
            raise TypeError(
                f"{cls.__name__}.from_pretrained: {folder} holds a {type(pipe).__name__}; load it "
                f"with {type(pipe).__name__}.from_pretrained or unclip.load_pipeline"
            )
    else:
        external = {"allow_external_components": allow_external_components}
        pipe = cls(**read_pipeline_folder(folder, variant=variant, **external))
    pipe._freeze()
    pipe.card_info = read_card_info(folder)
    pipe._loaded_defaults(autocast, memory_format, dtype)
    return pipe if device is None else pipe.to(device)


def assemble_unclip_pipeline(
    cls: type[P],
    clip: Union[str, os.PathLike],
    decoder: Union[str, os.PathLike],
    prior: Union[str, os.PathLike, None],
    upsamplers: Sequence[Union[str, os.PathLike]],
    reranker: Union[str, os.PathLike, None],
    *,
    autocast_dtype,
    memory_format: Optional[torch.memory_format],
) -> P:
    """:meth:`UnCLIPPipeline.from_components
    <unclip.pipeline.pipeline.UnCLIPPipeline.from_components>`: a pipeline over component
    folders exported by the training commands."""
    autocast = parse_autocast(autocast_dtype)
    clip_m, prior_m, decoder_m, ups, diffusion, sampling = load_components(
        clip, decoder, prior, upsamplers, DEFAULT_DIFFUSION, DEFAULT_SAMPLING
    )
    pipe = cls(
        clip_m,
        prior_m,
        decoder_m,
        ups,
        diffusion,
        sampling,
        reranker=CLIP.from_pretrained(reranker) if reranker is not None else None,
    )
    pipe._freeze()
    pipe._loaded_defaults(autocast, memory_format)
    return pipe


def write_unclip_folder(
    pipe: UnCLIPCascade, path: Union[str, os.PathLike], model_card: Mapping
) -> None:
    """The self-describing folder of ``pipe``: ``unclip.json``, one subfolder per component and
    the model card ``README.md`` (fields: ``model_card``, already checked)."""
    write_pipeline_folder(
        path,
        clip=pipe.clip,
        prior=pipe.prior,
        decoder=pipe.decoder,
        upsamplers=dict(zip(pipe.upsampler_names, pipe.upsamplers)),
        reranker=pipe.reranker,
        diffusion=pipe.diffusion,
        sampling=pipe.sampling,
        prior_clip_range=pipe.prior_clip_range,
    )
    write_card(path, pipe, dict(model_card))
