"""Component and pipeline folders on disk: safetensors weights (one file or sharded; pickles are
refused), JSON configs, trained component folders (``unclip_stage.json``) and the bundled models.

Other folder layouts (e.g. diffusers' ``model_index.json``) are loaded by readers declared as
``unclip.folder_formats`` entry points (the diffusers/Karlo one is in pyproject.toml) or registered
with :func:`register_folder_format`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import torch

from unclip.clip import FrozenCLIP
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.pipeline_utils import stage_kind
from unclip.prior import UnCLIPPrior

PIPELINE_FILE = "unclip.json"
STAGE_META_FILE = "unclip_stage.json"

# entry point group of folder readers: name = the marker file, value = reader(folder) -> pipeline,
# e.g. "model_index.json" = "unclip.interop.diffusers:load_diffusers_unclip"
FOLDER_FORMAT_ENTRY_POINTS = "unclip.folder_formats"


class FolderFormats(MutableMapping):
    """marker file name -> reader(folder) returning a pipeline.

    The entry points are listed on first use and each reader is imported only when a folder holds
    its marker, so the core never imports the layers that extend it (a reader registered in code
    wins over an entry point for the same marker)."""

    def __init__(self) -> None:
        self._readers: dict = {}
        self._listed = False

    def _list(self) -> dict:
        if not self._listed:
            self._listed = True
            from importlib.metadata import entry_points

            for ep in entry_points(group=FOLDER_FORMAT_ENTRY_POINTS):
                self._readers.setdefault(ep.name, _EntryPointReader(ep))
        return self._readers

    def __getitem__(self, marker: str) -> Callable:
        return self._list()[marker]

    def __setitem__(self, marker: str, reader: Callable) -> None:
        self._readers[marker] = reader

    def __delitem__(self, marker: str) -> None:
        del self._list()[marker]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._list()))

    def __len__(self) -> int:
        return len(self._list())


class _EntryPointReader:
    """A folder reader named by an entry point, imported on its first call."""

    def __init__(self, entry_point) -> None:
        self.entry_point = entry_point
        self._reader: Callable | None = None

    def __call__(self, folder):
        if self._reader is None:
            self._reader = self.entry_point.load()
        return self._reader(folder)

    def __repr__(self) -> str:
        return f"<folder reader {self.entry_point.value}>"


FOLDER_FORMATS = FolderFormats()


def register_folder_format(marker: str, reader: Callable) -> None:
    """Let ``UnCLIPPipeline.from_pretrained`` read folders that hold ``marker`` (e.g.
    ``model_index.json``); packages can declare the same as an ``unclip.folder_formats`` entry
    point instead."""
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

    clip_m = FrozenCLIP.from_pretrained(clip)
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
