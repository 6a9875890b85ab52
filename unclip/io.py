"""Component and pipeline folders on disk: safetensors weights (one file or sharded; pickles are
refused), JSON configs, trained component folders (``unclip_stage.json``), pipeline folders
(``unclip.json`` and one subfolder per component) and the bundled models.

Other folder layouts (e.g. diffusers' ``model_index.json``) are loaded by readers registered with
:func:`register_folder_format`; :mod:`unclip.interop` registers the diffusers/Karlo one.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional, Union

import torch

from unclip.clip import CLIP
from unclip.config import DiffusionConfig, SamplingConfig, to_dict
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.prior import UnCLIPPrior
from unclip.sampling import stage_kind

PIPELINE_FILE = "unclip.json"
PIPELINE_FORMAT_VERSION = 1
STAGE_META_FILE = "unclip_stage.json"

# marker file name -> reader(folder) returning a pipeline; filled by the interop layer
FOLDER_FORMATS: dict[str, Callable] = {}


def register_folder_format(marker: str, reader: Callable) -> None:
    """Let ``UnCLIPPipeline.from_pretrained`` read folders that hold ``marker`` (e.g.
    ``model_index.json``)."""
    FOLDER_FORMATS[marker] = reader


# ---------------------------------------------------------------------------------------- files
def read_json(file: Path, component: str) -> dict:
    if not file.is_file():
        raise ValueError(f"{component}: {file} is missing")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{component}: {file} is not valid JSON ({exc})") from exc


def load_weights(folder: Path, component: str) -> dict[str, torch.Tensor]:
    """All tensors of a component folder (one or sharded safetensors files; pickles are refused)."""
    from safetensors.torch import load_file

    if not folder.is_dir():
        raise ValueError(f"{component}: component folder {folder} is missing")
    for index_name in (
        "diffusion_pytorch_model.safetensors.index.json",
        "model.safetensors.index.json",
    ):
        if (folder / index_name).is_file():
            shards = sorted(
                set(read_json(folder / index_name, component).get("weight_map", {}).values())
            )
            state = {}
            for shard in shards:
                if not (folder / shard).is_file():
                    raise ValueError(
                        f"{component}: shard {shard} listed in {index_name} is missing"
                    )
                state.update(load_file(str(folder / shard)))
            return state
    for name in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if (folder / name).is_file():
            return load_file(str(folder / name))
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return load_file(str(files[0]))
    pickles = sorted(p.name for p in folder.glob("*.bin"))
    hint = (
        f" (found only pickle weights {pickles}; unclip never unpickles weight files — convert "
        "them to safetensors first)"
        if pickles
        else ""
    )
    raise ValueError(f"{component}: no safetensors weights in {folder}{hint}")


def check_state(component: str, expected: dict, got: dict, folder: Path) -> None:
    """Raise ``ValueError`` naming the component and key on a missing, unexpected or mis-shaped
    weight."""
    for key, value in expected.items():
        if key not in got:
            raise ValueError(f"{component}: weight {key!r} is missing from {folder}")
        if tuple(got[key].shape) != tuple(value.shape):
            raise ValueError(
                f"{component}: weight {key!r} has shape {tuple(got[key].shape)} but "
                f"{component}/config.json implies {tuple(value.shape)}"
            )
    for key in got:
        if key not in expected:
            raise ValueError(
                f"{component}: unexpected weight {key!r} in {folder} (not part of the model "
                f"described by {component}/config.json)"
            )


def _settings_from_pipeline(folder: Path, expected: str) -> dict:
    """Diffusion and sampling settings of a component folder without ``unclip_stage.json``: those of
    the pipeline folder it sits in (``../unclip.json``), else ``{}`` (the defaults) with a
    warning."""
    index_path = folder.parent / "unclip.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        comps = index.get("components", {})
        stage_of = {
            comps.get("prior"): "prior",
            comps.get("decoder"): "decoder",
            **{n: n for n in comps.get("upsamplers", [])},
        }
        name = stage_of.get(folder.name)
        if name in index.get("diffusion", {}):
            data = {"stage": stage_kind(name), "diffusion": index["diffusion"][name]}
            if name in index.get("sampling", {}):
                data["sampling"] = index["sampling"][name]
            return data
    warnings.warn(
        f"{expected} folder {folder} has neither unclip_stage.json nor a pipeline unclip.json "
        "beside it: assuming the default diffusion settings (epsilon prediction, no min-SNR). If "
        "it was trained otherwise, its samples will be wrong; pass the folder that a training "
        "command exported (<output_dir>/final/<name>) or a component folder inside a pipeline "
        "folder.",
        stacklevel=3,
    )
    return {}


def load_components(
    clip, decoder, prior, upsamplers, default_diffusion: dict, default_sampling: dict
):
    """``(clip, prior, decoder, upsamplers, diffusion, sampling)`` loaded from trained component
    folders."""
    diffusion, sampling = {}, {}

    def meta(folder, expected):
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{expected} component folder {folder} has no config.json")
        m = folder / "unclip_stage.json"
        data = (
            json.loads(m.read_text()) if m.is_file() else _settings_from_pipeline(folder, expected)
        )
        if data and data.get("stage") != expected:
            raise ValueError(
                f"{folder} holds a {data.get('stage')!r} component, expected {expected!r}"
            )
        return folder, data

    clip_m = CLIP.from_pretrained(clip)
    prior_m = None
    if prior is not None:
        folder, data = meta(prior, "prior")
        prior_m = UnCLIPPrior.from_pretrained(folder)
        diffusion["prior"], sampling["prior"] = (
            data.get("diffusion", default_diffusion["prior"]),
            data.get("sampling", default_sampling["prior"]),
        )
    folder, data = meta(decoder, "decoder")
    dec = UnCLIPDecoder.from_pretrained(folder)
    diffusion["decoder"], sampling["decoder"] = (
        data.get("diffusion", default_diffusion["decoder"]),
        data.get("sampling", default_sampling["decoder"]),
    )
    ups = []
    for u in upsamplers:
        folder, data = meta(u, "upsampler")
        up = UnCLIPUpsampler.from_pretrained(folder)
        name = f"sr{up.config.sample_size}"
        diffusion[name] = data.get("diffusion", default_diffusion["upsampler"])
        sampling[name] = data.get("sampling", default_sampling["upsampler"])
        ups.append(up)
    return clip_m, prior_m, dec, ups, diffusion, sampling


# pipeline folders ------------------------------------------------------------------------------
def resolve_pipeline_folder(path: Union[str, os.PathLike, None] = None) -> Path:
    """The folder ``path`` names: ``None`` or a bundled model's name (``"shapes"``) is that bundled
    model's folder; anything else must be an existing folder (else ``FileNotFoundError``)."""
    if path is None or str(path) in BUNDLED:
        path = bundled_model_path(str(path or DEFAULT_MODEL))
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"pipeline folder not found: {path}")
    return path


def folder_format_reader(folder: Path) -> Optional[Callable]:
    """``None`` for an unclip pipeline folder (it holds :data:`PIPELINE_FILE`, read by
    :func:`read_pipeline_folder`), else the reader registered for a marker file it holds; a
    ``ValueError`` for a folder of neither kind."""
    if (folder / PIPELINE_FILE).is_file():
        return None
    for marker, reader in FOLDER_FORMATS.items():
        if (folder / marker).is_file():
            return reader
    known = "".join(f" nor a {m}" for m in FOLDER_FORMATS)
    raise ValueError(f"{folder} is not an unclip pipeline folder: it has no {PIPELINE_FILE}{known}")


def write_pipeline_folder(
    path: Union[str, os.PathLike],
    *,
    clip: CLIP,
    prior: Optional[UnCLIPPrior],
    decoder: UnCLIPDecoder,
    upsamplers: Mapping[str, UnCLIPUpsampler],
    reranker: Optional[CLIP],
    diffusion: Mapping[str, DiffusionConfig],
    sampling: Mapping[str, SamplingConfig],
    prior_clip_range: Optional[float],
) -> None:
    """Write a self-describing pipeline folder: one subfolder per component (config and safetensors
    weights; ``upsamplers`` by stage name) and :data:`PIPELINE_FILE` naming them, with each
    stage's diffusion and sampling settings and the prior's ``prior_clip_range``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    clip.save_pretrained(path / "clip")
    if prior is not None:
        prior.save_pretrained(path / "prior", safe_serialization=True)
    decoder.save_pretrained(path / "decoder", safe_serialization=True)
    for name, up in upsamplers.items():
        up.save_pretrained(path / name, safe_serialization=True)
    if reranker is not None:
        reranker.save_pretrained(path / "reranker")
    index = {
        "format": "unclip-pipeline",
        "version": PIPELINE_FORMAT_VERSION,
        "components": {
            "clip": "clip",
            "prior": "prior" if prior is not None else None,
            "decoder": "decoder",
            "upsamplers": list(upsamplers),
            "reranker": "reranker" if reranker is not None else None,
        },
        "diffusion": {k: to_dict(v) for k, v in diffusion.items()},
        "sampling": {k: to_dict(v) for k, v in sampling.items()},
        "prior_clip_range": prior_clip_range,
    }
    (path / PIPELINE_FILE).write_text(json.dumps(index, indent=2))


def read_pipeline_folder(path: Union[str, os.PathLike]) -> dict:
    """The components and settings of a folder written by :func:`write_pipeline_folder`, as the
    keyword arguments of ``UnCLIPPipeline``: ``clip``, ``prior``, ``decoder``, ``upsamplers``,
    ``diffusion`` and ``sampling`` (as stored), ``prior_clip_range``, ``reranker``."""
    path = Path(path)
    index = json.loads((path / PIPELINE_FILE).read_text())
    comps = index.get("components", {})

    def sub(name):
        folder = path / name
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"pipeline component {name!r} is missing: expected {folder}/config.json "
                f"and its weights"
            )
        return folder

    return {
        "clip": CLIP.from_pretrained(sub(comps.get("clip", "clip"))),
        "prior": UnCLIPPrior.from_pretrained(sub(comps["prior"])) if comps.get("prior") else None,
        "decoder": UnCLIPDecoder.from_pretrained(sub(comps.get("decoder", "decoder"))),
        "upsamplers": [
            UnCLIPUpsampler.from_pretrained(sub(n)) for n in comps.get("upsamplers", [])
        ],
        "diffusion": index.get("diffusion"),
        "sampling": index.get("sampling"),
        "prior_clip_range": index.get("prior_clip_range", 10.0),
        "reranker": (
            CLIP.from_pretrained(sub(comps["reranker"])) if comps.get("reranker") else None
        ),
    }


# bundled models --------------------------------------------------------------------------------
DEFAULT_MODEL = "shapes"
BUNDLED = ("shapes",)


def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Folder of a model shipped inside the package (``unclip/models/<name>``)."""
    path = Path(__file__).parent / "models" / name
    if not (path / PIPELINE_FILE).is_file():
        raise FileNotFoundError(
            f"the bundled model {name!r} is not installed in this package ({path}); "
            f"pass a pipeline folder instead (see README: training the shapes model)"
        )
    return path
