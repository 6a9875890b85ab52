"""Training checkpoints without pickle, checked before use, and writes that survive a full disk.

A checkpoint folder ``checkpoints/step_XXXXXXXX`` holds only safetensors (tensors) and JSON (the
rest), so resuming one never runs code from it, whoever wrote it:

==========================  =================================================================
``model.safetensors``       the model's weights (the raw ones; EMA weights are separate)
``optimizer.safetensors``   the optimizer's per-parameter tensors (AdamW moments and steps;
                            SOAP's and KL-Shampoo's Kronecker factors and eigenbases)
``optimizer.json``          its parameter groups (hyper-parameters) and non-tensor state
``ema.safetensors``/``.json``  the EMA weights and their counters (when EMA is on)
``trainer_state.json``      the run's counters (step, data position, skips), the LR schedule
                            and the gradient scaler
``rng_<rank>.safetensors``  each process's torch (and CUDA) random state
``rng_<rank>.json``         each process's Python and NumPy random state
``config.yaml``             the run's config
``manifest.json``           the size and SHA-256 of every file above, written last
==========================  =================================================================

Files are written to ``step_XXXXXXXX.tmp`` and the folder is renamed when the manifest is in place,
so a folder without ``.tmp`` is complete. :func:`verify` checks a folder against its manifest
(missing, truncated, emptied or altered files); :func:`newest_intact` picks the newest checkpoint
that passes, with the reasons the newer ones were skipped. Other files in a checkpoint folder (for
instance a planted pickle) are never opened.

:func:`writing` turns a full disk (``ENOSPC``, also when it surfaces inside safetensors) into a
one-line :class:`DiskFullError` and removes the partial folder; :func:`replace_folder` swaps a
finished temporary folder into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional, cast

import numpy as np
import torch

from unclip.utils.files import replace_folder

__all__ = [
    "CheckpointError",
    "DiskFullError",
    "MANIFEST",
    "REQUIRED_FILES",
    "is_disk_full",
    "disk_full_is_an_error",
    "writing",
    "replace_folder",
    "write_manifest",
    "verify",
    "completed_checkpoints",
    "newest_intact",
    "save_tensors",
    "load_tensors",
    "write_json",
    "read_json",
    "optimizer_files",
    "optimizer_state",
    "rng_files",
    "set_rng_state",
]

MANIFEST = "manifest.json"
#: the files every checkpoint holds (the EMA's, ``ema.safetensors``/``ema.json``, when EMA is on;
#: the other processes' random states, ``rng_<rank>.*``, in a multi-process run)
REQUIRED_FILES = (
    "model.safetensors",
    "optimizer.safetensors",
    "optimizer.json",
    "trainer_state.json",
    "rng_0.safetensors",
    "rng_0.json",
    "config.yaml",
)
FORMAT = "unclip-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_\d{8}$")
#: files of a checkpoint written by older versions (pickles), which are never loaded
LEGACY_PICKLES = ("custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl")


class CheckpointError(ValueError):
    """A checkpoint is incomplete, damaged, not a checkpoint or does not fit this run."""


class DiskFullError(OSError):
    """The disk filled up while writing a checkpoint or an export."""

    def __init__(self, path):
        self.message = f"disk full while writing {path}: free space or choose another output_dir"
        super().__init__(errno.ENOSPC, self.message, str(path))

    def __str__(self) -> str:
        return self.message


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) reports a full disk or quota: an
    ``OSError`` with ``ENOSPC``/``EDQUOT``, or the text of one wrapped by a library (safetensors
    reports "No space left on device" inside its own error type)."""
    seen = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        exc = cause
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota" in text:
            return True
        cause = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def disk_full_is_an_error(path: Path):
    """Re-raise a full disk met in the block as :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise DiskFullError(path) from exc
        raise


@contextlib.contextmanager
def writing(tmp: Path, target: Path):
    """Write ``tmp`` (a temporary folder that becomes ``target``) in the block: on any error the
    partial ``tmp`` is removed (freeing the space it took), and a full disk is re-raised as
    :class:`DiskFullError` naming ``target``."""
    try:
        yield
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise DiskFullError(target) from exc
        raise


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ files
def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, in memory of their own: safetensors maps the file, and
    state that outlives the load (optimizer moments, EMA weights) must not depend on the file
    staying as it is (a truncated mapped file kills the process with SIGBUS)."""
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(str(path)).items()}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1))


def read_json(path: Path):
    return json.loads(path.read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------ manifest
def write_manifest(folder: Path, step: int) -> None:
    """Record the size and SHA-256 of every file in ``folder`` (flushed to disk first) in
    ``manifest.json``, written atomically: the last file of a checkpoint."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(MANIFEST) or not path.is_file():
            continue
        _fsync_file(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify(folder: Path, required: tuple[str, ...] = REQUIRED_FILES) -> dict:
    """Check ``folder`` against its manifest; return the manifest. ``required``: files that must be
    listed. Raises :class:`CheckpointError` with the first problem found (no manifest, a file
    missing, of another size, or with other content)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    path = folder / MANIFEST
    if not path.is_file():
        if any((folder / name).exists() for name in LEGACY_PICKLES):
            raise CheckpointError(
                "it was written by an older unclip as pickles, which unclip no longer loads "
                "(they can run code)"
            )
        raise CheckpointError(f"no {MANIFEST} (the checkpoint was never finished)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        ok = (
            manifest.get("format") == FORMAT
            and isinstance(files, dict)
            and all(isinstance(entry, dict) for entry in files.values())
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{MANIFEST} is damaged (not a checkpoint manifest)")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint format version {manifest.get('version')!r}; this unclip reads {VERSION}"
        )
    for name in required:
        if name not in files:
            raise CheckpointError(f"{MANIFEST} lists no {name}")
    for name, entry in files.items():
        p = folder / name
        if os.sep in name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{MANIFEST} lists a path outside the folder: {name!r}")
        if not p.is_file():
            raise CheckpointError(f"{name} is missing")
        size = p.stat().st_size
        if size != entry.get("size"):
            what = "empty" if size == 0 else f"{size} bytes"
            raise CheckpointError(
                f"{name} is {what}, the manifest says {entry.get('size')} (truncated or replaced)"
            )
        if _sha256(p) != entry.get("sha256"):
            raise CheckpointError(f"{name} does not match its SHA-256 in the manifest (corrupted)")
    return manifest


def completed_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The ``step_XXXXXXXX`` folders of ``ckpt_dir`` (not ``.tmp``/``.old``), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir())


def newest_intact(
    ckpt_dir: Path, required: tuple[str, ...] = REQUIRED_FILES
) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest checkpoint of ``ckpt_dir`` that passes :func:`verify` (``None`` if none does),
    and the ``(folder, reason)`` of each newer one that was skipped."""
    skipped = []
    for path in reversed(completed_checkpoints(ckpt_dir)):
        try:
            verify(path, required)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return path, skipped
    return None, skipped


# ------------------------------------------------------------------ optimizer state
_JSON_SCALARS = (bool, int, float, str, type(None))


def _is_flat(state: dict) -> bool:
    """Whether a state dict has torch.optim's plain layout (AdamW's): per-parameter tensors and
    JSON scalars under string names, and parameter groups without tensors."""
    if set(state) != {"state", "param_groups"}:
        return False
    plain = (torch.Tensor, *_JSON_SCALARS)
    for per_param in state["state"].values():
        if not all(isinstance(k, str) and isinstance(v, plain) for k, v in per_param.items()):
            return False
    return not any(isinstance(v, torch.Tensor) for g in state["param_groups"] for v in g.values())


def _encode(value, key: str, tensors: dict, seen: dict):
    """``value`` as JSON, with its tensors moved to ``tensors`` (one entry per tensor object, so
    an aliased tensor is stored once and comes back aliased) and containers tagged with their
    type: ``{"tensor": key}``, ``{"dict": [[k, v], ...]}`` (keys keep their type),
    ``{"list"|"tuple"|"set": [...]}``."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = key
            tensors[key] = value
        return {"tensor": seen[id(value)]}
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v, f"{key}.{k}", tensors, seen)] for k, v in value.items()]}
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = "list" if isinstance(value, list) else "tuple" if isinstance(value, tuple) else "set"
        items = sorted(value) if kind == "set" else value
        return {kind: [_encode(v, f"{key}.{i}", tensors, seen) for i, v in enumerate(items)]}
    if isinstance(value, _JSON_SCALARS):
        return value
    raise TypeError(f"cannot store {type(value).__name__} at {key} in a checkpoint")


def _decode(value, tensors: dict):
    if not isinstance(value, dict):
        return value
    ((kind, body),) = value.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in body}
    items = [_decode(v, tensors) for v in body]
    return {"list": list, "tuple": tuple, "set": set}[kind](items)


def optimizer_files(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer's state dict into tensors and JSON. torch.optim's plain layout (AdamW):
    tensors ``state.<param>.<name>``, the groups and scalars as JSON. Any other (heavyball's nested
    per-parameter state, tensors in its groups): the whole dict as a tagged JSON tree under
    ``tree`` whose tensors are ``tree.<path>``."""
    if not _is_flat(state):
        tensors: dict[str, torch.Tensor] = {}
        return tensors, {"tree": _encode(state, "tree", tensors, {})}
    tensors = {}
    scalars: dict[str, dict] = {}
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in state["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict, live: dict) -> dict:
    """Rebuild the state dict of :func:`optimizer_files`; ``live``: the state dict of the optimizer
    it is for (its groups must hold the same parameters)."""
    if "tree" in meta:
        decoded = _decode(meta["tree"], tensors)
        _check_groups(decoded["param_groups"], live)
        return decoded
    groups = meta["param_groups"]
    _check_groups(groups, live)
    for saved, now in zip(groups, live["param_groups"]):
        for k, v in now.items():
            if isinstance(v, tuple) and isinstance(saved.get(k), list):
                saved[k] = tuple(saved[k])
    state: dict = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    return {"state": state, "param_groups": groups}


def _check_groups(groups: list, live: dict) -> None:
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in live["param_groups"]]:
        raise CheckpointError(
            "its optimizer has parameter groups of other sizes than this model's "
            f"({[len(g['params']) for g in groups]} vs "
            f"{[len(g['params']) for g in live['param_groups']]}): another architecture"
        )


# ------------------------------------------------------------------ random state
def rng_files() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's random state: torch (CPU and CUDA) as tensors, Python and NumPy as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    # legacy=True (the default) gives the tuple form, not the dict the stubs also allow
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore what :func:`rng_files` saved."""
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
