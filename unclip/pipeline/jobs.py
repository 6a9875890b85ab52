"""Whole jobs on a pipeline that the command line runs: :func:`generate_to_folder` (``unclip
generate``: images, a grid and a JSON record in a folder), :func:`assemble_pipeline` and
:func:`assemble_token_pipeline` (``unclip assemble``: trained component folders into one pipeline
folder).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from unclip.nets.text_encoding import check_prompts
from unclip.pipeline.folders import DEFAULT_MODEL
from unclip.pipeline.limits import check_candidates_fit
from unclip.sampling.utils import check_count
from unclip.utils.config import to_dict
from unclip.utils.devices import check_device
from unclip.utils.files import check_output_folder, write_file, write_folder
from unclip.utils.images import image_grid, save_image

if TYPE_CHECKING:
    from unclip.pipeline.pipeline import UnCLIPPipeline


def assemble_pipeline(
    clip,
    decoder,
    prior=None,
    upsamplers=(),
    reranker=None,
    *,
    out,
    overwrite: bool = False,
    model_card: Optional[Mapping] = None,
):
    """``unclip assemble``: a pipeline folder ``out`` from trained component folders (see
    ``UnCLIPPipeline.from_components``). A non-empty ``out`` is refused unless ``overwrite``, which
    replaces it entirely; the folder is written beside it and renamed. ``model_card``: card fields
    (e.g. ``{"license": "mit"}``). Returns the pipeline."""
    from unclip.pipeline.pipeline import UnCLIPPipeline

    check_output_folder(out, overwrite=overwrite, option="--out")
    pipe = UnCLIPPipeline.from_components(clip, decoder, prior, upsamplers, reranker=reranker)
    write_folder(out, lambda folder: pipe.save_pretrained(folder, model_card=model_card))
    return pipe


def assemble_token_pipeline(
    tokenizer, transformer, clip=None, upsamplers=(), *, out, overwrite: bool = False
):
    """``unclip assemble --tokenizer T --transformer X``: a DALL-E or DALL-E Mega pipeline folder
    ``out`` from a tokenizer and a transformer folder, optionally a CLIP folder to rerank (and
    score) with and upsampler folders run after the tokenizer decoder (see
    ``TokenPipeline.from_components``). ``out`` as :func:`assemble_pipeline`."""
    from unclip.pipeline.token_pipeline import TokenPipeline

    check_output_folder(out, overwrite=overwrite, option="--out")
    pipe = TokenPipeline.from_components(
        tokenizer, transformer, rerank_clip=clip, upsamplers=upsamplers
    )

    def write(folder: Path) -> None:
        pipe.save_pretrained(folder)

    write_folder(out, write)
    return pipe


#: images per pipeline call in :func:`generate_to_folder` (``unclip generate --batch-size``)
DEFAULT_BATCH_SIZE = 16


#: the most images ``grid.png`` of :func:`generate_to_folder` shows (the first ones)
GRID_MAX_IMAGES = 64


#: ``generate_to_folder``'s ``autocast_dtype`` when not given
_UNSET = object()


def generate_to_folder(
    model: Union[str, os.PathLike, UnCLIPPipeline, None],
    prompts: Sequence[str],
    folder: Union[str, os.PathLike],
    *,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    sampling: Optional[dict] = None,
    device: Union[str, torch.device] = "cpu",
    progress: bool = True,
    tiny: bool = False,
    command: Optional[Sequence[str]] = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    negative_prompt: Optional[str] = None,
    revision: Optional[str] = None,
    cache_dir: Union[str, os.PathLike, None] = None,
    lora: Sequence[tuple[str, float]] = (),
    autocast_dtype=_UNSET,
) -> dict:
    """Sample ``prompts`` and write the images, ``grid.png`` and ``generate.json`` to ``folder``.

    ``model``: a pipeline, a folder (of any family: :func:`unclip.pipeline.auto.load_pipeline`)
    or Hub repo id for :meth:`UnCLIPPipeline.from_pretrained`
    (``revision``, ``cache_dir``: of the repo) or None (the bundled model); ``tiny``: a random
    untrained tiny pipeline instead (a smoke test). ``folder`` is
    checked (:func:`check_output_folder`) before the model loads; an existing folder is fine, its
    files of the same names are replaced. ``generate.json`` records every setting needed to
    reproduce the images (prompts, seeds, model, resolved per-stage sampling settings,
    ``batch_size``, ``negative_prompt``, versions, ``command``); it is also returned.
    ``negative_prompt``: one caption that replaces the empty one in guidance for every prompt
    (see :meth:`UnCLIPPipeline.__call__`). ``lora``: ``(adapter folder, scale)`` pairs loaded onto
    the pipeline first (:meth:`UnCLIPPipeline.load_lora`), recorded in ``generate.json``.
    ``autocast_dtype``: the arithmetic (``"auto"``, ``"bf16"``, ``"fp16"`` or None for full
    precision: see :attr:`UnCLIPPipeline.autocast_dtype`); default ``"auto"`` for a pipeline loaded
    here and its own setting for a pipeline passed in, which is given back with that setting.
    ``generate.json`` records the dtype the images were sampled in, since reduced precision
    changes them slightly.

    Memory stays bounded however many images are asked for: the images (prompt-major: every image
    of prompt 0, then of prompt 1, ...) are sampled in batches of at most ``batch_size`` images
    (each decoded from the decoder's ``best_of`` or ``best_of_contrasted`` candidates), and each
    batch's PNGs are written before the next batch starts. ``grid.png`` shows the first
    :data:`GRID_MAX_IMAGES` images only.

    Seeds: prompt ``i`` draws from one generator seeded ``seed + i``. A request of at most
    ``batch_size`` images is one pipeline call (the same images as ``pipe(prompts,
    num_images_per_prompt, generator=[one generator per prompt])``). In a larger request, a prompt
    whose images fall into several batches keeps drawing from its generator batch after batch, so
    the images are deterministic for a given ``seed`` and ``batch_size`` but change with
    ``batch_size``."""
    from importlib.metadata import PackageNotFoundError, version

    # imported here: unclip.pipeline imports this module for UnCLIPOutput
    from unclip.pipeline.auto import is_pipeline, load_pipeline
    from unclip.utils.precision import dtype_name, parse_autocast

    prompts = check_prompts(prompts)
    given = autocast_dtype is not _UNSET
    # a bad value fails before anything loads
    autocast = parse_autocast(autocast_dtype if given else "auto")
    n = check_count(num_images_per_prompt)
    batch_size = check_count(batch_size, "batch_size")
    folder = check_output_folder(folder)  # before loading a model or sampling anything
    device = check_device(device)
    try:
        unclip_version = version("unclip")
    except PackageNotFoundError:  # running from a source tree that is not installed
        unclip_version = None
    if tiny:
        from unclip.pipeline.tiny import tiny_pipeline

        pipe, name = tiny_pipeline(), "tiny (random, untrained)"
    elif is_pipeline(model):
        pipe, name = model, "in-memory pipeline"
        if not given:
            autocast = pipe.autocast_setting
    else:
        hub = {"revision": revision, "cache_dir": cache_dir}
        pipe = load_pipeline(model, **hub)
        name = str(model or DEFAULT_MODEL)
    if lora and not hasattr(pipe, "load_lora"):
        raise ValueError(
            f"LoRA adapters apply to unCLIP pipelines; this is a {pipe.family} pipeline (leave "
            "--lora out)"
        )
    # adapters already on a caller's pipeline are recorded too; those loaded here are unloaded
    # at the end, so the caller's pipeline is left as it was given
    adapters = [
        {"path": a.path, "scale": a.scale, "name": n, "stage": a.stage}
        for n, a in getattr(pipe, "lora_adapters", {}).items()
    ]
    own_autocast = pipe.autocast_setting  # a caller's pipeline gets its setting back
    pipe.autocast_dtype = autocast
    loaded_here: list[str] = []
    try:
        for path, scale in lora:
            adapter_name = pipe.load_lora(path, scale=float(scale))
            loaded_here.append(adapter_name)
            adapters.append(
                {
                    "path": str(path),
                    "scale": float(scale),
                    "name": adapter_name,
                    "stage": pipe.lora_adapters[adapter_name].stage,
                }
            )
        pipe.to(device)
        settings = pipe.sampling_settings(sampling)  # fails on a bad override before any compute
        check_candidates_fit(pipe, settings, min(batch_size, len(prompts) * n))
        seeds = [seed + i for i in range(len(prompts))]
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        # (prompt index, image index of that prompt) of every image, prompt-major
        order = [(i, j) for i in range(len(prompts)) for j in range(n)]
        files: list[dict] = []
        grid_images: list = []
        timings: dict[str, float] = {}
        seconds = 0.0
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            if len(batch) == len(order):  # the whole request: exactly one pipeline call
                args = (prompts, n, gens)
            else:  # one prompt per image; a prompt's generator carries on into the next batch
                args = ([prompts[i] for i, _ in batch], 1, [gens[i] for i, _ in batch])
            t0 = time.perf_counter()
            out = pipe(
                args[0],
                num_images_per_prompt=args[1],
                generator=args[2],
                sampling=sampling,
                progress=progress,
                negative_prompt=negative_prompt,
            )
            seconds += time.perf_counter() - t0
            for stage, t in out.timings.items():
                timings[stage] = timings.get(stage, 0.0) + t
            folder.mkdir(parents=True, exist_ok=True)
            for (i, j), image in zip(batch, out.images):
                f = folder / f"{i:03d}_{j:02d}.png"
                save_image(image, f)
                files.append({"file": f.name, "prompt": prompts[i], "seed": seeds[i], "index": j})
                if len(grid_images) < GRID_MAX_IMAGES:
                    grid_images.append(image)
            del out
        cols = n if len(prompts) > 1 and n < GRID_MAX_IMAGES else None
        save_image(image_grid(grid_images, cols=cols), folder / "grid.png")
        record = {
            "model": name,
            "revision": revision,
            "prompts": prompts,
            "seeds": seeds,
            "num_images_per_prompt": n,
            "negative_prompt": negative_prompt,
            "lora": adapters,
            "batch_size": batch_size,
            "rerank_clip": "reranker" if getattr(pipe, "reranker", None) is not None else "clip",
            "device": str(device),
            # resolved on the device: "auto" is bfloat16 on some CPUs and float32 on others
            "autocast_dtype": dtype_name(pipe.autocast_dtype),
            "resolution": pipe.resolution,
            "sampling": {k: to_dict(v) for k, v in settings.items()},
            "seconds": round(seconds, 3),
            "seconds_per_stage": {k: round(v, 3) for k, v in timings.items()},
            "versions": {"unclip": unclip_version, "torch": torch.__version__},
            "command": list(command) if command is not None else None,
            "files": files,
            "grid": "grid.png",
            "grid_images": len(grid_images),
        }
        text = json.dumps(record, indent=2)
        write_file(folder / "generate.json", lambda tmp: tmp.write_text(text))
    finally:
        pipe.autocast_dtype = own_autocast
        for adapter_name in loaded_here:
            pipe.unload_lora(adapter_name)
    return record
