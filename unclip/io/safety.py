"""Refusing pickles: weight files that would run code when loaded (``.bin``, ``.pt``, ...) are
never loaded; the error says how to convert them to safetensors.
"""

from __future__ import annotations

from pathlib import Path

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
