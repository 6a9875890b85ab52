"""What a pipeline call returns (:class:`UnCLIPOutput`) and writing it to a folder: one PNG per
image, ``grid.png`` and ``generate.json`` (:meth:`UnCLIPOutput.save`, :func:`generate_to_folder`,
which backs ``unclip generate``: it checks the folder before loading a model and samples any number
of images in bounded batches)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from unclip.utils.files import check_output_folder, write_file
from unclip.utils.images import image_grid, save_image

__all__ = [
    "UnCLIPOutput",
    "check_output_folder",
]


_FIELDS = ("images", "image_embeds", "text_embeds", "stage_images", "timings")


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
    image_embeds: Optional[torch.Tensor]  # None from pipelines without a prior (token models)
    text_embeds: Optional[torch.Tensor] = None
    stage_images: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def to_tuple(self) -> tuple:
        """``(images, image_embeds, text_embeds)`` without the ones that are None, as diffusers'
        outputs give their fields."""
        return tuple(v for v in (self.images, self.image_embeds, self.text_embeds) if v is not None)

    def keys(self) -> list[str]:
        """The fields that are set (not None), as diffusers' outputs list them."""
        return [k for k in _FIELDS if getattr(self, k) is not None]

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __getitem__(self, key):
        """``out[0]`` (the images), ``out["images"]``: as diffusers' outputs index."""
        if isinstance(key, str):
            if key not in _FIELDS:
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

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
                save_image(self.images[i * per + j], f)
                entry: dict[str, Union[str, int]] = {"file": f.name, "prompt": prompt}
                if seeds is not None:
                    entry["seed"] = seeds[i]
                files.append({**entry, "index": j})
        save_image(image_grid(self.images, cols=grid_cols), folder / "grid.png")
        out = {**(record or {}), "files": files, "grid": "grid.png"}
        if record is not None:
            text = json.dumps(out, indent=2)
            write_file(folder / "generate.json", lambda tmp: tmp.write_text(text))
        return out
