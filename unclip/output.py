"""What a pipeline call returns (:class:`UnCLIPOutput`) and writing it to a folder: one PNG per
image, ``grid.png`` and ``generate.json`` (:meth:`UnCLIPOutput.save`, :func:`generate_to_folder`,
which backs ``unclip generate``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from unclip.clip import check_prompts
from unclip.config import to_dict
from unclip.images import image_grid
from unclip.io import DEFAULT_MODEL
from unclip.pipeline_utils import check_count

if TYPE_CHECKING:
    from unclip.pipeline import UnCLIPPipeline

__all__ = ["UnCLIPOutput", "generate_to_folder"]


@dataclass
class UnCLIPOutput:
    """Result of a pipeline call.

    ``images``: PIL list, ``np.ndarray [N, H, W, 3]`` uint8, or a tensor ``[N, 3, H, W]`` in [0, 1];
    ``image_embeds [N, D]`` the CLIP image embeddings decoded (the prior's chosen ones, or those
    given); ``text_embeds [N, D]``; ``stage_images``: ``{stage: tensor [N, 3, h, w] in [-1, 1]}``
    when intermediates were requested; ``timings``: wall-clock seconds per stage that ran (``prior``
    includes the text encoding when the prior runs, ``decoder`` includes reranking).
    """

    images: Any
    image_embeds: torch.Tensor
    text_embeds: Optional[torch.Tensor] = None
    stage_images: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def save(
        self,
        folder: Union[str, os.PathLike],
        prompts: Sequence[str],
        record: Optional[dict] = None,
        grid_cols: Optional[int] = None,
        seeds: Optional[Sequence[int]] = None,
    ) -> dict:
        """Write ``NNN_MM.png`` (prompt ``NNN``, image ``MM`` of it), ``grid.png`` and, with
        ``record``, ``generate.json`` (``record`` plus the file list, with each prompt's seed from
        ``seeds``) to ``folder``; returns the record. ``images`` must be PIL images in prompt order
        (``output_type="pil"``)."""
        if not isinstance(self.images, list):
            raise TypeError(
                "UnCLIPOutput.save needs PIL images (call the pipeline with output_type='pil')"
            )
        prompts = list(prompts)
        if not prompts or len(self.images) % len(prompts):
            raise ValueError(
                f"save: {len(self.images)} images do not split over {len(prompts)} prompts"
            )
        per = len(self.images) // len(prompts)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for i, prompt in enumerate(prompts):
            for j in range(per):
                f = folder / f"{i:03d}_{j:02d}.png"
                self.images[i * per + j].save(f)
                entry = {"file": f.name, "prompt": prompt}
                if seeds is not None:
                    entry["seed"] = seeds[i]
                files.append({**entry, "index": j})
        image_grid(self.images, cols=grid_cols).save(folder / "grid.png")
        out = {**(record or {}), "files": files, "grid": "grid.png"}
        if record is not None:
            (folder / "generate.json").write_text(json.dumps(out, indent=2))
        return out


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
) -> dict:
    """Sample ``prompts`` and write the images, ``grid.png`` and ``generate.json`` to ``folder``.

    ``model``: a pipeline, a folder for :meth:`UnCLIPPipeline.from_pretrained` or None (the bundled
    model); ``tiny``: a random untrained tiny pipeline instead (a smoke test). Prompt ``i`` is
    sampled with its own generator seeded ``seed + i``. ``generate.json`` records every setting
    needed to reproduce the images (prompts, seeds, model, resolved per-stage sampling settings,
    versions, ``command``); it is also returned."""
    from importlib.metadata import PackageNotFoundError, version

    # imported here: unclip.pipeline imports this module for UnCLIPOutput
    from unclip.pipeline import UnCLIPPipeline

    try:
        unclip_version = version("unclip")
    except PackageNotFoundError:  # running from a source tree that is not installed
        unclip_version = None
    prompts = check_prompts(prompts)
    n = check_count(num_images_per_prompt)
    if tiny:
        from unclip.tiny import tiny_pipeline

        pipe, name = tiny_pipeline(), "tiny (random, untrained)"
    elif isinstance(model, UnCLIPPipeline):
        pipe, name = model, "in-memory pipeline"
    else:
        pipe, name = UnCLIPPipeline.from_pretrained(model), str(model or DEFAULT_MODEL)
    pipe.to(device)
    settings = pipe.sampling_settings(sampling)  # fails on a bad override before any compute
    seeds = [seed + i for i in range(len(prompts))]
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    t0 = time.perf_counter()
    out = pipe(
        prompts, num_images_per_prompt=n, generator=gens, sampling=sampling, progress=progress
    )
    seconds = time.perf_counter() - t0
    record = {
        "model": name,
        "prompts": prompts,
        "seeds": seeds,
        "num_images_per_prompt": n,
        "rerank_clip": "reranker" if pipe.reranker is not None else "clip",
        "device": str(device),
        "resolution": pipe.resolution,
        "sampling": {k: to_dict(v) for k, v in settings.items()},
        "seconds": round(seconds, 3),
        "seconds_per_stage": {k: round(v, 3) for k, v in out.timings.items()},
        "versions": {"unclip": unclip_version, "torch": torch.__version__},
        "command": list(command) if command is not None else None,
    }
    return out.save(folder, prompts, record, grid_cols=n if len(prompts) > 1 else None, seeds=seeds)
