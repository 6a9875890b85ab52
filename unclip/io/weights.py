"""Component and pipeline folders on disk: safetensors weights (one file or sharded; pickles are
refused), JSON configs, trained component folders (``unclip_stage.json``), pipeline folders
(``unclip.json`` and one subfolder per component) and the bundled models.

Other folder layouts (e.g. diffusers' ``model_index.json``) are loaded by readers declared as
``unclip.folder_formats`` entry points (the diffusers/Karlo one is in pyproject.toml) or registered
with :func:`register_folder_format`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional

import torch

from unclip.io.safety import PICKLE_SUFFIXES, pickle_refusal, pickles_in


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
    falls back to unpickling. ``path`` may be a Hub repo id (:func:`unclip.io.hub.resolve_folder`:
    ``revision``, ``cache_dir``, ``local_files_only``, ``subfolder`` and ``variant`` are honoured
    there); ``torch_dtype`` and the other keyword arguments go to diffusers."""
    from unclip.io.hub import is_repo_id, resolve_folder

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


def check_variant(variant) -> str:
    """A weights variant's name (``"fp16"``): letters, digits or ``_``; ``ValueError`` else."""
    if not isinstance(variant, str) or not variant or not variant.replace("_", "").isalnum():
        raise ValueError(
            f"variant must be a short name of letters, digits or '_' (e.g. 'fp16'), got {variant!r}"
        )
    return variant


def name_variant_files(folder: Path, variant: str) -> list[Path]:
    """Rename every safetensors weights file under ``folder`` (and sharded indexes, with the
    shard names they list) to its ``variant``'s name (:func:`variant_file`), as diffusers'
    ``save_pretrained(variant=...)`` writes them; returns the new paths. ``folder`` should hold
    only the files just written (every weights file in it is renamed)."""
    check_variant(variant)
    renamed = []
    for index in sorted(Path(folder).rglob("*.safetensors.index.json")):
        meta = json.loads(index.read_text())
        meta["weight_map"] = {k: variant_file(v, variant) for k, v in meta["weight_map"].items()}
        target = index.with_name(variant_file(index.name, variant))
        target.write_text(json.dumps(meta, indent=2))
        index.unlink()
        renamed.append(target)
    for file in sorted(Path(folder).rglob("*.safetensors")):
        renamed.append(file.rename(file.with_name(variant_file(file.name, variant))))
    return renamed


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


def _shape(value) -> tuple:
    """A tensor's shape, or a shape given as such."""
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def _close(key: str, among) -> str:
    """``"; closest: 'x'"`` when one of ``among`` is close to ``key`` (a renamed or misspelt
    weight), else ``""``."""
    close = difflib.get_close_matches(key, sorted(among), n=1, cutoff=0.6)
    return f" (closest in the other side: {close[0]!r})" if close else ""


def check_state(component: str, expected: Mapping, got: Mapping, folder: Path) -> None:
    """Raise ``ValueError`` naming the component, ``folder`` (or weights file) and key on a
    missing, unexpected or mis-shaped weight, with the closest key of the other side where one
    is close. ``expected`` and ``got`` map names to tensors (meta ones do) or to shapes."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    for key, value in expected.items():
        if key not in got:
            raise ValueError(
                f"{component}: weight {key!r} is missing from {folder}{_close(key, unexpected)}"
            )
        if _shape(got[key]) != _shape(value):
            raise ValueError(
                f"{component}: weight {key!r} has shape {_shape(got[key])} in {folder} but "
                f"{component}/config.json implies {_shape(value)}"
            )
    for key in unexpected:
        raise ValueError(
            f"{component}: unexpected weight {key!r} in {folder} (not part of the model "
            f"described by {component}/config.json){_close(key, missing)}"
        )


def safetensors_shapes(file, component: str) -> dict[str, tuple]:
    """``{name: shape}`` from a safetensors file's header, without reading a tensor; a pickle
    (by its name) is refused before it is opened, a truncated or corrupt file is a one-line
    ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    if Path(file).suffix in PICKLE_SUFFIXES:
        raise pickle_refusal(file, component)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{component}: {file} is truncated or corrupt ({exc}); re-download or re-export it"
        ) from None
