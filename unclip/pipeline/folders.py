"""Pipeline folders on disk: ``unclip.json`` and one subfolder per component, trained component
folders (``unclip_stage.json``), and the bundled models. Loading a folder builds its components
(:func:`load_components`, :func:`read_pipeline_folder`); saving writes them
(:func:`write_pipeline_folder`). Safetensors I/O itself is :mod:`unclip.io.weights`.

Other folder layouts (e.g. diffusers' ``model_index.json``) are loaded by readers declared as
``unclip.folder_formats`` entry points (the diffusers/Karlo one is in pyproject.toml) or registered
with :func:`register_folder_format`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

from unclip.diffusion.config import DiffusionConfig, diffusion_to_save
from unclip.io.weights import read_json
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.nets.priors import load_prior
from unclip.sampling.settings import sampling_to_save
from unclip.sampling.utils import stage_kind
from unclip.utils.registry import EntryPointRegistry

PIPELINE_FILE = "unclip.json"


PIPELINE_FORMAT_VERSION = 1


STAGE_META_FILE = "unclip_stage.json"


# entry point group of folder readers: name = the marker file, value = reader(folder) -> pipeline
# (called with variant= too when one is asked for),
# e.g. "model_index.json" = "unclip.interop.diffusers:load_diffusers_unclip"
FOLDER_FORMAT_ENTRY_POINTS = "unclip.folder_formats"


#: marker file name -> reader(folder) returning a pipeline
FOLDER_FORMATS = EntryPointRegistry(FOLDER_FORMAT_ENTRY_POINTS)


def register_folder_format(marker: str, reader: Callable) -> None:
    """Let ``UnCLIPPipeline.from_pretrained`` read folders that hold ``marker`` (e.g.
    ``model_index.json``); packages can declare the same as an ``unclip.folder_formats`` entry
    point instead. ``reader(path)`` returns a new pipeline built from the folder:
    ``from_pretrained`` then applies its own settings to it (autocast, memory format, dtype)."""
    FOLDER_FORMATS[marker] = reader


def component_folder(path: Path, name, allow_external: bool = False) -> Path:
    """The folder of the component that pipeline folder ``path``'s ``unclip.json`` names ``name``.
    A name that leads outside ``path`` (``../other/decoder``, an absolute path, a link out) is
    refused unless ``allow_external``: loading a folder must read that folder only."""
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{path / PIPELINE_FILE}: a component name must be a folder name, got {name!r}"
        )
    folder = path / name
    if not allow_external:
        root = path.resolve()
        if not folder.resolve().is_relative_to(root):
            raise ValueError(
                f"{path / PIPELINE_FILE} names the component folder {name!r}, which is outside "
                f"the pipeline folder {path}: copy it in, or load with "
                "allow_external_components=True if you trust this folder"
            )
    return folder


def read_pipeline_index(path) -> dict:
    """The ``unclip.json`` of pipeline folder ``path``; a broken file is a one-line
    ``ValueError`` naming it, and so is another family's folder (a DALL-E or DALL-E Mega
    pipeline: ``unclip.pipeline.auto.load_pipeline`` reads every family's)."""
    index = read_json(Path(path) / PIPELINE_FILE, "pipeline")
    family = index.get("family", "unclip")
    if family != "unclip":
        raise ValueError(
            f"{Path(path)} holds a {family!r} pipeline, not an unCLIP one; load it with "
            "unclip.pipeline.auto.load_pipeline (as unclip generate --model does)"
        )
    return index


def _settings_from_pipeline(folder: Path, expected: str) -> dict:
    """Diffusion and sampling settings of a component folder without ``unclip_stage.json``: those of
    the pipeline folder it sits in (``../unclip.json``), else ``{}`` (the defaults) with a
    warning."""
    index_path = folder.parent / PIPELINE_FILE
    if index_path.is_file():
        index = read_json(index_path, "pipeline")
        comps = index.get("components", {})
        stage_of = {
            comps.get("prior"): "prior",
            comps.get("decoder"): "decoder",
            **{n: n for n in comps.get("upsamplers", [])},
        }
        name = stage_of.get(folder.name)
        if name is not None and name in index.get("diffusion", {}):
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


#: the stages conditioned on the CLIP; an upsampler reads only the low-res image and the noise
CLIP_STAGES = ("prior", "decoder")


def stage_meta(stage: str, name: str, diffusion: dict, sampling: dict, clip) -> dict:
    """The ``unclip_stage.json`` of an exported component: its stage kind, name, diffusion and
    sampling settings (dicts) and, for the stages the CLIP conditions (:data:`CLIP_STAGES`), the
    fingerprint of the CLIP it was trained with (:meth:`~unclip.nets.clip.CLIP.fingerprint`), which
    :func:`load_components` checks."""
    meta = {"stage": stage, "name": name, "diffusion": diffusion, "sampling": sampling}
    if stage in CLIP_STAGES:
        meta["clip_fingerprint"] = clip.fingerprint()
    return meta


def load_upsampler_folder(folder, default_diffusion: dict, default_sampling: dict):
    """``(upsampler, diffusion, sampling)`` of an upsampler component folder: one a training run
    exported (its ``unclip_stage.json``) or one inside a pipeline folder (the settings its
    ``unclip.json`` stores for it, e.g. ``unclip/bundled/shapes/sr64``). Settings are as stored
    (dicts), else ``default_diffusion["upsampler"]`` / ``default_sampling["upsampler"]``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"upsampler component folder {folder} has no config.json")
    m = folder / STAGE_META_FILE
    data = (
        read_json(m, "upsampler") if m.is_file() else _settings_from_pipeline(folder, "upsampler")
    )
    if data and data.get("stage") != "upsampler":
        raise ValueError(f"{folder} holds a {data.get('stage')!r} component, expected 'upsampler'")
    up = UnCLIPUpsampler.from_pretrained(folder)
    return (
        up,
        data.get("diffusion", default_diffusion["upsampler"]),
        data.get("sampling", default_sampling["upsampler"]),
    )


def save_diffusers_component(model, folder: Path) -> None:
    """Save a diffusers component (an upsampler, a decoder, a prior) as a pipeline folder does."""
    _save_component(model, Path(folder))


def load_components(
    clip, decoder, prior, upsamplers, default_diffusion: dict, default_sampling: dict
):
    """``(clip, prior, decoder, upsamplers, diffusion, sampling)`` loaded from trained component
    folders.

    A prior or decoder whose ``unclip_stage.json`` records a ``clip_fingerprint`` must have been
    trained with this ``clip`` (``ValueError`` otherwise); one without it (an older export) loads
    with a warning, unless it sits in a pipeline folder whose ``clip/`` is this ``clip``. An
    upsampler does not read the CLIP, so it goes with any (older exports recorded one)."""
    diffusion, sampling = {}, {}
    clip_m = CLIP.from_pretrained(clip)
    unchecked = []

    def meta(folder, expected):
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{expected} component folder {folder} has no config.json")
        m = folder / STAGE_META_FILE
        data = read_json(m, expected) if m.is_file() else _settings_from_pipeline(folder, expected)
        if data and data.get("stage") != expected:
            raise ValueError(
                f"{folder} holds a {data.get('stage')!r} component, expected {expected!r}"
            )
        if expected not in CLIP_STAGES:
            return folder, data
        want = data.get("clip_fingerprint")
        same_pipeline = (folder.parent / PIPELINE_FILE).is_file() and (
            (folder.parent / "clip").resolve() == Path(clip).resolve()
        )
        if want is None:
            if not same_pipeline:  # a pipeline folder's parts were saved together
                unchecked.append(str(folder))
        elif want != clip_fingerprint():
            raise ValueError(
                f"{expected} {folder} was trained with CLIP {want} but the CLIP {clip} is "
                f"{clip_fingerprint()}; pass the CLIP folder exported with it (<output_dir>/final/"
                "clip of its training run)"
            )
        return folder, data

    fingerprint: list[str] = []  # computed once, when a check needs it

    def clip_fingerprint():
        if not fingerprint:
            fingerprint.append(clip_m.fingerprint())
        return fingerprint[0]

    prior_m = None
    if prior is not None:
        folder, data = meta(prior, "prior")
        prior_m = load_prior(folder)
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
        up, diffusion_u, sampling_u = load_upsampler_folder(u, default_diffusion, default_sampling)
        name = f"sr{up.config.sample_size}"
        diffusion[name], sampling[name] = diffusion_u, sampling_u
        ups.append(up)
    if unchecked:
        warnings.warn(
            f"{', '.join(unchecked)}: no clip_fingerprint recorded (exported by an older unclip), "
            f"so unclip cannot check that they were trained with the CLIP {clip}; make sure it is "
            "the one exported beside them",
            stacklevel=3,
        )
    return clip_m, prior_m, dec, ups, diffusion, sampling


# pipeline folders ------------------------------------------------------------------------------
def resolve_pipeline_folder(path: Union[str, os.PathLike, None] = None, **hub) -> Path:
    """The folder ``path`` names: ``None`` or a bundled model's name (``"shapes"``) is that bundled
    model's folder; anything else an existing folder or a Hub repo id's snapshot
    (:func:`unclip.io.hub.resolve_folder`, which takes ``hub``: ``revision``, ``cache_dir``,
    ``local_files_only``, ``variant``); else ``FileNotFoundError``."""
    from unclip.io.hub import resolve_folder

    if path is None or str(path) in BUNDLED:
        path = bundled_model_path(str(path or DEFAULT_MODEL))
    return resolve_folder(path, what="pipeline", **hub)


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
    if not FOLDER_FORMATS and (folder / "model_index.json").is_file():
        # the diffusers reader is declared as an entry point: an install from before it existed
        # (or a source tree on sys.path without an install) lists none
        raise ValueError(
            f"{folder} is a diffusers folder but no folder reader is installed; reinstall unclip "
            "(pip install -e . in a checkout) so its unclip.folder_formats entry point is "
            "registered"
        )
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
    sampling: Mapping[str, Any],
    prior_clip_range: Optional[float],
) -> None:
    """Write a self-describing pipeline folder: one subfolder per component (config and safetensors
    weights; ``upsamplers`` by stage name) and :data:`PIPELINE_FILE` naming them, with each
    stage's diffusion and sampling settings and the prior's ``prior_clip_range``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    clip.save_pretrained(path / "clip")
    if prior is not None:
        _save_component(prior, path / "prior")
    _save_component(decoder, path / "decoder")
    for name, up in upsamplers.items():
        _save_component(up, path / name)
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
        "diffusion": {k: diffusion_to_save(v) for k, v in diffusion.items()},
        "sampling": {k: sampling_to_save(v) for k, v in sampling.items()},
        "prior_clip_range": prior_clip_range,
    }
    (path / PIPELINE_FILE).write_text(json.dumps(index, indent=2))


def _save_component(model, folder: Path) -> None:
    """Save a diffusers component (safetensors). diffusers writes the folder a model was loaded
    from into its config's ``_name_or_path``: a pipeline folder names each component by its
    subfolder instead, so a saved or shared folder carries no path of the machine that wrote it."""
    model.save_pretrained(folder, safe_serialization=True)
    config = folder / "config.json"
    if not config.is_file():
        return
    data = json.loads(config.read_text())
    if "_name_or_path" in data:
        data["_name_or_path"] = folder.name
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_pipeline_folder(
    path: Union[str, os.PathLike],
    variant: Optional[str] = None,
    allow_external_components: bool = False,
) -> dict:
    """The components and settings of a folder written by :func:`write_pipeline_folder`, as the
    keyword arguments of ``UnCLIPPipeline``: ``clip``, ``prior``, ``decoder``, ``upsamplers``,
    ``diffusion`` and ``sampling`` (as stored), ``prior_clip_range``, ``reranker``. ``variant``:
    read each component's weights of that variant (``model.fp16.safetensors``).
    ``allow_external_components``: follow component names that lead outside ``path``
    (:func:`component_folder`)."""
    path = Path(path)
    variant = variant or None  # "" reads the plain weights, as None does
    index = read_pipeline_index(path)
    comps = index.get("components", {})

    def sub(name):
        folder = component_folder(path, name, allow_external_components)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"pipeline component {name!r} is missing: expected {folder}/config.json "
                f"and its weights"
            )
        return folder

    return {
        "clip": CLIP.from_pretrained(sub(comps.get("clip", "clip")), variant=variant),
        "prior": load_prior(sub(comps["prior"]), variant=variant) if comps.get("prior") else None,
        "decoder": UnCLIPDecoder.from_pretrained(
            sub(comps.get("decoder", "decoder")), variant=variant
        ),
        "upsamplers": [
            UnCLIPUpsampler.from_pretrained(sub(n), variant=variant)
            for n in comps.get("upsamplers", [])
        ],
        "diffusion": index.get("diffusion"),
        "sampling": index.get("sampling"),
        "prior_clip_range": index.get("prior_clip_range", 10.0),
        "reranker": (
            CLIP.from_pretrained(sub(comps["reranker"]), variant=variant)
            if comps.get("reranker")
            else None
        ),
    }


# bundled models --------------------------------------------------------------------------------
DEFAULT_MODEL = "shapes"


BUNDLED = ("shapes",)


def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Folder of a model shipped inside the package (``unclip/bundled/<name>``)."""
    path = Path(__file__).resolve().parents[1] / "bundled" / name
    if not (path / PIPELINE_FILE).is_file():
        raise FileNotFoundError(
            f"the bundled model {name!r} is not installed in this package ({path}); "
            f"pass a pipeline folder instead (see README: training the shapes model)"
        )
    return path
