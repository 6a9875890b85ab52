"""Component and pipeline folders on disk: safetensors weights (one file or sharded; pickles are
refused), JSON configs, trained component folders (``unclip_stage.json``), pipeline folders
(``unclip.json`` and one subfolder per component) and the bundled models.

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
from typing import Optional, Union

import torch

from unclip.clip import CLIP
from unclip.config import (
    DiffusionConfig,
    SamplingConfig,
    diffusion_to_save,
    sampling_to_save,
)
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.files import check_output_folder, write_folder
from unclip.prior import UnCLIPPrior
from unclip.priors import load_prior
from unclip.registry import EntryPointRegistry
from unclip.sampling import stage_kind

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


# ---------------------------------------------------------------------------------------- files
def read_json(file: Path, component: str) -> dict:
    if not file.is_file():
        raise ValueError(f"{component}: {file} is missing")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{component}: {file} is not valid JSON ({exc}); fix or re-export it"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{component}: {file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_pipeline_index(path) -> dict:
    """The ``unclip.json`` of pipeline folder ``path``; a broken file is a one-line
    ``ValueError`` naming it."""
    return read_json(Path(path) / PIPELINE_FILE, "pipeline")


#: weight files that are Python pickles: loading one can run arbitrary code, so unclip refuses them
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def pickle_refusal(file, component: str, folder=None) -> ValueError:
    """The one-line error for a pickle weights file (``folder``: the component folder that has no
    safetensors weights besides it), with the command that converts it."""
    file = Path(file)
    target = file.with_suffix(".safetensors")
    where = f"no safetensors weights in {folder}; " if folder is not None else ""
    return ValueError(
        f"{component}: {where}{file} is a pickle, which can run code when loaded, so unclip "
        "never loads "
        f'it; convert it to safetensors where you trust the file: python -c "import torch; from '
        f"safetensors.torch import save_file; save_file(torch.load('{file}', weights_only=True), "
        f"'{target}')\""
    )


def pickles_in(folder: Path) -> list[Path]:
    """The pickle weight files directly in ``folder``."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def check_safetensors(file, component: str) -> None:
    """Raise a one-line ``ValueError`` naming ``file`` if it is not a complete safetensors file
    (only the header is read; safetensors checks it covers the whole file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{component}: {file} is truncated or corrupt ({exc}); re-download or re-export it"
        ) from None


def load_safetensors(file, component: str) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file; a truncated or corrupt file is a one-line
    ``ValueError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if Path(file).suffix in PICKLE_SUFFIXES:
        raise pickle_refusal(file, component)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{component}: {file} is truncated or corrupt ({exc}); re-download or re-export it"
        ) from None


def safe_model_from_pretrained(load: Callable, path, component: str, **kwargs):
    """diffusers' ``ModelMixin.from_pretrained`` (bound as ``load``) restricted to safetensors: a
    folder with only pickle weights is refused with how to convert them, a truncated safetensors
    file is a one-line error naming it, and diffusers is told ``use_safetensors=True`` so it never
    falls back to unpickling. ``path`` may be a Hub repo id (:func:`unclip.hub.resolve_folder`:
    ``revision``, ``cache_dir``, ``local_files_only``, ``subfolder`` and ``variant`` are honoured
    there); ``torch_dtype`` and the other keyword arguments go to diffusers."""
    from unclip.hub import is_repo_id, resolve_folder

    if kwargs.get("use_safetensors") is False:
        raise ValueError(f"{component}: unclip never loads pickle weights (use_safetensors=False)")
    kwargs["use_safetensors"] = True
    folder = resolve_folder(
        path,
        revision=kwargs.pop("revision", None),
        cache_dir=kwargs.pop("cache_dir", None),
        local_files_only=kwargs.pop("local_files_only", None),
        subfolder=kwargs.pop("subfolder", None),
        variant=kwargs.get("variant"),
        what=component,
    )
    suffix = f".{kwargs['variant']}.safetensors" if kwargs.get("variant") else ".safetensors"
    weights = sorted(f for f in folder.iterdir() if f.name.endswith(suffix))
    if not weights and pickles_in(folder):
        raise pickle_refusal(pickles_in(folder)[0], component, folder)
    for file in weights:
        check_safetensors(file, component)
    model = load(folder, **kwargs)
    if not Path(path).expanduser().is_dir() and is_repo_id(str(path)):
        # the config's _name_or_path names the repo rather than a snapshot in the cache
        model.register_to_config(_name_or_path=str(path))
    return model


def variant_file(name: str, variant: Optional[str]) -> str:
    """diffusers' name of a weights file's variant: ``model.safetensors`` →
    ``model.fp16.safetensors`` (an index ``x.safetensors.index.json`` →
    ``x.safetensors.index.fp16.json``)."""
    if not variant:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.{variant}{dot}{ext}"


def load_weights(
    folder: Path, component: str, variant: Optional[str] = None
) -> dict[str, torch.Tensor]:
    """All tensors of a component folder (one or sharded safetensors files; pickles are refused);
    ``variant`` (e.g. ``"fp16"``): the files of that variant (``model.fp16.safetensors``)."""
    if not folder.is_dir():
        raise ValueError(f"{component}: component folder {folder} is missing")
    for base in ("diffusion_pytorch_model", "model"):
        index = folder / variant_file(f"{base}.safetensors.index.json", variant)
        if index.is_file():
            shards = sorted(set(read_json(index, component).get("weight_map", {}).values()))
            state = {}
            for shard in shards:
                if not (folder / shard).is_file():
                    raise ValueError(
                        f"{component}: shard {shard} listed in {index.name} is missing"
                    )
                state.update(load_safetensors(folder / shard, component))
            return state
    for base in ("diffusion_pytorch_model", "model"):
        file = folder / variant_file(f"{base}.safetensors", variant)
        if file.is_file():
            return load_safetensors(file, component)
    if variant:
        raise ValueError(
            f"{component}: no {variant!r} variant weights (*.{variant}.safetensors) in {folder}; "
            "load without variant= to read the plain weights"
        )
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return load_safetensors(files[0], component)
    if pickles_in(folder):
        raise pickle_refusal(pickles_in(folder)[0], component, folder)
    raise ValueError(f"{component}: no safetensors weights in {folder}")


def state_mismatch(
    expected: Mapping[str, tuple], got: Mapping[str, tuple], here: str, examples: int = 3
) -> str:
    """What keeps weights of shapes ``got`` (from a file) from loading into a model whose weights
    have shapes ``expected``: "N missing (e.g. ...); N unexpected (...); N of another shape (...)",
    or "" when they fit. ``here`` names the model's side in the shape examples."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: {tuple(got[k])} in the file, {tuple(expected[k])} {here}"
        for k in expected
        if k in got and tuple(got[k]) != tuple(expected[k])
    ]
    parts = [
        f"{len(missing)} missing (e.g. {missing[:examples]})" if missing else "",
        f"{len(unexpected)} unexpected (e.g. {unexpected[:examples]})" if unexpected else "",
        f"{len(wrong)} of another shape (e.g. {wrong[:2]})" if wrong else "",
    ]
    return "; ".join(p for p in parts if p)


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


#: the stages conditioned on the CLIP; an upsampler reads only the low-res image and the noise
CLIP_STAGES = ("prior", "decoder")


def stage_meta(stage: str, name: str, diffusion: dict, sampling: dict, clip) -> dict:
    """The ``unclip_stage.json`` of an exported component: its stage kind, name, diffusion and
    sampling settings (dicts) and, for the stages the CLIP conditions (:data:`CLIP_STAGES`), the
    fingerprint of the CLIP it was trained with (:meth:`~unclip.clip.CLIP.fingerprint`), which
    :func:`load_components` checks."""
    meta = {"stage": stage, "name": name, "diffusion": diffusion, "sampling": sampling}
    if stage in CLIP_STAGES:
        meta["clip_fingerprint"] = clip.fingerprint()
    return meta


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

    fingerprint = []

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
        folder, data = meta(u, "upsampler")
        up = UnCLIPUpsampler.from_pretrained(folder)
        name = f"sr{up.config.sample_size}"
        diffusion[name] = data.get("diffusion", default_diffusion["upsampler"])
        sampling[name] = data.get("sampling", default_sampling["upsampler"])
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
    (:func:`unclip.hub.resolve_folder`, which takes ``hub``: ``revision``, ``cache_dir``,
    ``local_files_only``, ``variant``); else ``FileNotFoundError``."""
    from unclip.hub import resolve_folder

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


def read_pipeline_folder(path: Union[str, os.PathLike], variant: Optional[str] = None) -> dict:
    """The components and settings of a folder written by :func:`write_pipeline_folder`, as the
    keyword arguments of ``UnCLIPPipeline``: ``clip``, ``prior``, ``decoder``, ``upsamplers``,
    ``diffusion`` and ``sampling`` (as stored), ``prior_clip_range``, ``reranker``. ``variant``:
    read each component's weights of that variant (``model.fp16.safetensors``)."""
    path = Path(path)
    v = {"variant": variant} if variant else {}
    index = read_pipeline_index(path)
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
        "clip": CLIP.from_pretrained(sub(comps.get("clip", "clip")), **v),
        "prior": load_prior(sub(comps["prior"]), **v) if comps.get("prior") else None,
        "decoder": UnCLIPDecoder.from_pretrained(sub(comps.get("decoder", "decoder")), **v),
        "upsamplers": [
            UnCLIPUpsampler.from_pretrained(sub(n), **v) for n in comps.get("upsamplers", [])
        ],
        "diffusion": index.get("diffusion"),
        "sampling": index.get("sampling"),
        "prior_clip_range": index.get("prior_clip_range", 10.0),
        "reranker": (
            CLIP.from_pretrained(sub(comps["reranker"]), **v) if comps.get("reranker") else None
        ),
    }


def assemble_pipeline(
    clip, decoder, prior=None, upsamplers=(), reranker=None, *, out, overwrite: bool = False
):
    """``unclip assemble``: a pipeline folder ``out`` from trained component folders (see
    ``UnCLIPPipeline.from_components``). A non-empty ``out`` is refused unless ``overwrite``, which
    replaces it entirely; the folder is written beside it and renamed. Returns the pipeline."""
    from unclip.pipeline import UnCLIPPipeline

    check_output_folder(out, overwrite=overwrite, option="--out")
    pipe = UnCLIPPipeline.from_components(clip, decoder, prior, upsamplers, reranker=reranker)
    write_folder(out, pipe.save_pretrained)
    return pipe


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
