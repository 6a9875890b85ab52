"""Helpers of :mod:`unclip.pipeline`: argument checks, generator expansion, output conversion, slerp,
bundled-model lookup and loading trained component folders."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path


import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .clip import FrozenCLIP
from .decoder import UnCLIPDecoder, UnCLIPUpsampler
from .diffusion import Generator
from .prior import UnCLIPPrior

PIPELINE_FILE = "unclip.json"


def slerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    """Spherical interpolation between ``a`` and ``b`` (``[..., D]``) at weight ``w ∈ [0, 1]``."""
    an, bn = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    omega = torch.acos((an * bn).sum(-1, keepdim=True).clamp(-1 + 1e-7, 1 - 1e-7))
    so = torch.sin(omega)
    out = torch.sin((1 - w) * omega) / so * a.float() + torch.sin(w * omega) / so * b.float()
    small = omega.abs() < 1e-4
    return torch.where(small, (1 - w) * a.float() + w * b.float(), out)


def expand_generator(generator: Generator, batch: int, repeat: int, what: str) -> Generator:
    """One generator per final batch element (or a single shared one)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    gens = list(generator)
    if len(gens) == batch:
        return [g for g in gens for _ in range(repeat)]
    if len(gens) == batch * repeat:
        return gens
    raise ValueError(f"{what}: got {len(gens)} generators for {batch} prompts × {repeat} images; pass one "
                     f"generator, one per prompt, or one per image")


def stage_kind(name: str) -> str:
    return "upsampler" if name.startswith("sr") else name


def _settings_from_pipeline(folder: Path, expected: str) -> dict:
    """Diffusion and sampling settings of a component folder without ``unclip_stage.json``: those of the
    pipeline folder it sits in (``../unclip.json``), else ``{}`` (the defaults) with a warning."""
    index_path = folder.parent / "unclip.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        comps = index.get("components", {})
        stage_of = {comps.get("prior"): "prior", comps.get("decoder"): "decoder",
                    **{n: n for n in comps.get("upsamplers", [])}}
        name = stage_of.get(folder.name)
        if name in index.get("diffusion", {}):
            data = {"stage": stage_kind(name), "diffusion": index["diffusion"][name]}
            if name in index.get("sampling", {}):
                data["sampling"] = index["sampling"][name]
            return data
    warnings.warn(f"{expected} folder {folder} has neither unclip_stage.json nor a pipeline unclip.json beside it: "
                  f"assuming the default diffusion settings (epsilon prediction, no min-SNR). If it was trained "
                  f"otherwise, its samples will be wrong; pass the folder that a training command exported "
                  f"(<output_dir>/final/<name>) or a component folder inside a pipeline folder.", stacklevel=3)
    return {}


def load_components(clip, decoder, prior, upsamplers, default_diffusion: dict, default_sampling: dict):
    """``(clip, prior, decoder, upsamplers, diffusion, sampling)`` loaded from trained component folders."""
    diffusion, sampling = {}, {}

    def meta(folder, expected):
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{expected} component folder {folder} has no config.json")
        m = folder / "unclip_stage.json"
        data = json.loads(m.read_text()) if m.is_file() else _settings_from_pipeline(folder, expected)
        if data and data.get("stage") != expected:
            raise ValueError(f"{folder} holds a {data.get('stage')!r} component, expected {expected!r}")
        return folder, data

    clip_m = FrozenCLIP.from_pretrained(clip)
    prior_m = None
    if prior is not None:
        folder, data = meta(prior, "prior")
        prior_m = UnCLIPPrior.from_pretrained(folder)
        diffusion["prior"], sampling["prior"] = data.get("diffusion", default_diffusion["prior"]), data.get("sampling", default_sampling["prior"])
    folder, data = meta(decoder, "decoder")
    dec = UnCLIPDecoder.from_pretrained(folder)
    diffusion["decoder"], sampling["decoder"] = data.get("diffusion", default_diffusion["decoder"]), data.get("sampling", default_sampling["decoder"])
    ups = []
    for u in upsamplers:
        folder, data = meta(u, "upsampler")
        up = UnCLIPUpsampler.from_pretrained(folder)
        name = f"sr{up.config.sample_size}"
        diffusion[name] = data.get("diffusion", default_diffusion["upsampler"])
        sampling[name] = data.get("sampling", default_sampling["upsampler"])
        ups.append(up)
    return clip_m, prior_m, dec, ups, diffusion, sampling


def check_count(n, what="num_images_per_prompt") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
    return n


def check_output_type(output_type: str) -> None:
    if output_type not in ("pil", "np", "pt"):
        raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")


def check_embeds(image_embed, dim: int) -> torch.Tensor:
    if not isinstance(image_embed, torch.Tensor) or image_embed.ndim != 2 or image_embed.shape[1] != dim:
        shape = tuple(image_embed.shape) if isinstance(image_embed, torch.Tensor) else type(image_embed).__name__
        raise ValueError(f"image_embed must be a tensor [B, {dim}], got {shape}")
    if not torch.isfinite(image_embed).all():
        raise ValueError("image_embed contains NaN or inf")
    return image_embed


def as_image_input(image):
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(f"image file not found: {path}")
        return Image.open(path).convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image.astype(np.uint8)).convert("RGB")
    return image


def to_output(images: torch.Tensor, output_type: str = "pil"):
    """``[N, 3, H, W]`` in [-1, 1] → PIL list / uint8 array ``[N, H, W, 3]`` / float tensor in [0, 1]."""
    x = ((images.float().cpu() + 1) / 2).clamp(0, 1)
    if output_type == "pt":
        return x
    arr = (x.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return arr if output_type == "np" else [Image.fromarray(a) for a in arr]


# bundled models --------------------------------------------------------------------------------
DEFAULT_MODEL = "shapes"
BUNDLED = ("shapes",)


def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Folder of a model shipped inside the package (``unclip/models/<name>``)."""
    path = Path(__file__).parent / "models" / name
    if not (path / PIPELINE_FILE).is_file():
        raise FileNotFoundError(f"the bundled model {name!r} is not installed in this package ({path}); "
                                f"pass a pipeline folder instead (see README: training the shapes model)")
    return path
