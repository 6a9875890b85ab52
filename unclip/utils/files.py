"""Whole folders on disk: check an output folder before any work, and write a folder so that a
crash or a full disk never leaves it half-written (one implementation for CLIP and component
folders, pipeline folders and training exports)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Union

__all__ = [
    "check_output_folder",
    "recover_folder",
    "replace_folder",
    "write_file",
    "write_folder",
]


def check_output_folder(
    folder: Union[str, os.PathLike], *, overwrite: bool = True, option: str = "output folder"
) -> Path:
    """``folder`` as a ``Path`` if files can be written into it: an existing folder (non-empty only
    with ``overwrite``), or a missing one whose nearest existing parent is a writable folder (it is
    created at the first write). A file, a path under a file or an unwritable place is an error
    naming ``folder`` (``option``: how the user named it, e.g. ``--out``); nothing is created."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {folder} is a file; give a folder (a missing one is created)")
    if not overwrite and folder.is_dir() and any(folder.iterdir()):
        raise ValueError(
            f"{option} {folder} is not empty; pass --overwrite to replace it entirely, or choose "
            "another folder"
        )
    parent = folder.absolute()
    while not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot create {option} {folder}: {parent} is a file, not a folder")
    try:  # permissions alone do not tell (root, read-only mounts): write and remove a probe
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(folder)) from exc
    return folder


def replace_folder(tmp: Path, target: Path) -> None:
    """Put the finished folder ``tmp`` at ``target``: the old ``target`` (if any) is moved aside
    first and removed last, so at every instant one complete version exists under a known name."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_folder(target: Union[str, os.PathLike]) -> None:
    """Undo a :func:`replace_folder` cut short between its two renames (a kill, a power cut):
    ``target`` missing beside ``<target>.old`` gets the old version back."""
    target = Path(target)
    old = target.with_name(target.name + ".old")
    if not target.exists() and old.is_dir():
        os.replace(old, target)
        _fsync_dir(target.parent)


def write_folder(target: Union[str, os.PathLike], write: Callable[[Path], object]) -> Path:
    """Write folder ``target`` whole: ``write(tmp)`` fills ``<target>.tmp`` beside it (a leftover of
    a killed writer is cleared first), which then replaces ``target`` and everything that was in
    it (:func:`replace_folder`); on failure ``target`` is left as it was."""
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        replace_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_file(path: Union[str, os.PathLike], write: Callable[[Path], object]) -> Path:
    """Write file ``path`` whole: ``write(tmp)`` fills a hidden file beside it (what it returns,
    such as ``Path.write_text``'s count, is ignored), which then replaces ``path``. If writing
    fails (a full disk, a kill) ``path`` keeps its old content or stays absent, the partial file
    is removed, and an ``OSError`` names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
