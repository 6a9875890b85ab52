"""Hugging Face Hub repos as model sources, through ``huggingface_hub``.

    UnCLIPPipeline.from_pretrained("org/name")                 # downloaded once, then cached
    UnCLIPPipeline.from_pretrained("org/name", revision="v1")  # a branch, tag or commit
    UnCLIPDecoder.from_pretrained("org/name", subfolder="decoder")
    pipe.push_to_hub("me/my-unclip")                           # save_pretrained + upload

:func:`resolve_folder` turns a local folder or a repo id into a local folder: an id is fetched with
``huggingface_hub.snapshot_download`` into its cache (``cache_dir``, default ``HF_HUB_CACHE``),
configs, safetensors weights, tokenizer text files and cards only; pickle weights (``.bin``,
``.ckpt``...) are never downloaded or loaded, and a repo that has no other weights is refused,
naming them. ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` use the cache only. Every failure is
one line: :class:`ModelNotFoundError` (a ``FileNotFoundError``) when the source is neither a folder
nor a repo that can be fetched, ``ValueError`` for a pickle-only repo or a bad argument.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "ALLOW_PATTERNS",
    "ModelNotFoundError",
    "is_repo_id",
    "push_folder",
    "resolve_folder",
    "upload_folder_of",
]

#: the files a snapshot holds: configs and model indexes (JSON), safetensors weights, tokenizer
#: vocabularies (JSON/TXT) and model cards (MD)
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.md")
#: diffusers' precision variants of weights (``x.fp16.safetensors``): not downloaded unless asked
#: for with ``variant=``, since the loaders read the files without a variant then
VARIANTS = ("fp16", "bf16")
# `org/name`: a path that does not exist and has this form is looked up on the Hub (a single name,
# a path with more parts, or one starting with . / ~ is always a local path)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(FileNotFoundError):
    """A model source that is neither a local folder nor a Hub repo that can be fetched."""


def is_repo_id(source) -> bool:
    """Whether ``source`` has the form of a Hub repo id (``org/name``)."""
    return isinstance(source, str) and _REPO_ID.fullmatch(source) is not None


def _version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("unclip")
    except PackageNotFoundError:
        return None


def resolve_folder(
    source: Union[str, os.PathLike],
    *,
    revision: Optional[str] = None,
    cache_dir: Union[str, os.PathLike, None] = None,
    local_files_only: Optional[bool] = None,
    subfolder: Optional[str] = None,
    variant: Optional[str] = None,
    what: str = "model",
    token: Union[str, bool, None] = None,
) -> Path:
    """The local folder ``source`` names (``subfolder`` inside it): an existing folder as it is,
    else a Hub repo id's snapshot (see module doc). ``revision`` and ``cache_dir`` apply to repo
    ids only (``ValueError`` with a local folder, rather than being ignored);
    ``local_files_only=None`` leaves it to ``HF_HUB_OFFLINE``. ``variant``
    (e.g. ``"fp16"``) fetches those weight files instead of the plain ones. ``what`` names the
    source in errors. ``token``: a Hub token for a private or gated repo (default: the one
    ``huggingface-cli login`` stored)."""
    path = Path(source).expanduser()
    if path.is_dir():
        hub = {"revision": revision, "cache_dir": cache_dir}
        given = [k for k, v in hub.items() if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(
                f"{' and '.join(given)} {verb} to Hub repo ids only, but {source} is a local folder"
            )
        folder = path / subfolder if subfolder else path
        if not folder.is_dir():
            raise ModelNotFoundError(f"{what} folder not found: {folder}")
        return folder
    if path.exists():
        raise ModelNotFoundError(f"{what} {source} is a file; expected a folder")
    if not is_repo_id(str(source)):
        raise ModelNotFoundError(f"{what} folder not found: {source}")
    folder = _snapshot(
        str(source), revision, cache_dir, local_files_only, subfolder, variant, what, token
    )
    _refuse_pickle_only(folder, str(source), revision, subfolder, variant, local_files_only)
    return folder / subfolder if subfolder else folder


def _patterns(subfolder: Optional[str], variant: Optional[str]):
    allow = list(ALLOW_PATTERNS)
    ignore = [] if variant else [f"*.{v}.safetensors" for v in VARIANTS]
    if variant:
        allow = [p for p in allow if p != "*.safetensors"] + [f"*.{variant}.safetensors"]
    if subfolder:
        allow = [f"{subfolder}/{p}" for p in allow]
    return allow, ignore or None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _snapshot(
    repo_id, revision, cache_dir, local_files_only, subfolder, variant, what, token=None
) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    allow, ignore = _patterns(subfolder, variant)
    rev = revision or constants.DEFAULT_REVISION
    where = f"{repo_id} (revision {rev})"
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=bool(local_files_only),
                allow_patterns=allow,
                ignore_patterns=ignore,
                library_name="unclip",
                library_version=_version(),
                token=token,
            )
        )
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{what} {repo_id}: no such folder, and not a valid Hub repo id ({exc})"
        ) from None
    except LocalEntryNotFoundError as exc:
        cache = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        if local_files_only:
            why = "local_files_only=True"
        elif _offline():
            why = "HF_HUB_OFFLINE is set"
        else:
            cause = exc.__cause__
            why = f"the Hub could not be reached ({type(cause).__name__ if cause else exc})"
        raise ModelNotFoundError(
            f"{what} {repo_id}: no such folder, and Hub repo {where} is not in the cache "
            f"{cache} while {why}; download it once with network access, or pass a local folder"
        ) from None
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{what} {repo_id}: Hub repo {repo_id} is gated; accept its terms on the Hub and log "
            "in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{what} {repo_id}: no such folder, and no Hub model repo {repo_id} (or it is "
            "private: log in with hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"{what} {repo_id}: Hub repo {repo_id} has no revision {rev!r}"
        ) from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"{what} {repo_id}: the Hub refused {where}: {first}") from None


def _refuse_pickle_only(folder, repo_id, revision, subfolder, variant, local_files_only) -> None:
    """``ValueError`` if a component folder of the snapshot (one holding ``config.json``) has no
    safetensors weights but the repo has pickle weights for it (in the cache, or listed by the Hub
    when online)."""
    from unclip.io.safety import PICKLE_SUFFIXES

    root = folder / subfolder if subfolder else folder
    components = [p.parent for p in root.rglob("config.json")]
    suffix = f".{variant}.safetensors" if variant else ".safetensors"

    def weights(name: str) -> bool:
        if variant:
            return name.endswith(suffix)
        return name.endswith(suffix) and not any(name.endswith(f".{v}{suffix}") for v in VARIANTS)

    bare = [c for c in components if not any(weights(f.name) for f in c.iterdir())]
    if not bare:
        return
    files = [f.relative_to(folder).as_posix() for c in bare for f in c.iterdir() if f.is_file()]
    if not (local_files_only or _offline()):
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        try:  # the snapshot folder is named by the commit it holds
            files += HfApi().list_repo_files(repo_id, revision=folder.name)
        except (HfHubHTTPError, OSError):
            pass  # then the loader reports the missing weights itself
    names = {c.relative_to(folder).as_posix() for c in bare}
    pickles = sorted(
        {
            f
            for f in files
            if Path(f).suffix in PICKLE_SUFFIXES and Path(f).parent.as_posix() in names
        }
    )
    if pickles:
        rev = revision or "main"
        others = sorted(
            {v for f in files for v in VARIANTS if f.endswith(f".{v}.safetensors") and v != variant}
        )
        hint = f'pass variant="{others[0]}" to load its safetensors variant, or ' if others else ""
        raise ValueError(
            f"{repo_id} (revision {rev}): only pickle weights ({', '.join(pickles)}), no "
            f"*{suffix}; unclip loads safetensors only, because loading a pickle can run code; "
            f"{hint}use a revision of the repo with safetensors weights (e.g. its refs/pr/N "
            "conversion), or convert a copy you trust and load that folder"
        )


def upload_folder_of(write: Callable[[Path], None], folder: Union[str, os.PathLike]) -> Path:
    """The folder :func:`push_folder` uploads: ``write(folder)`` into the empty ``folder``, refused
    (``ValueError``) if it wrote a pickle weights file, which unclip would then refuse to load."""
    folder = Path(folder)
    write(folder)
    from unclip.io.safety import PICKLE_SUFFIXES

    pickles = sorted(str(f) for f in folder.rglob("*") if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"not uploading pickle weights {', '.join(pickles)}; save safetensors")
    return folder


def push_folder(
    write: Callable[[Path], None],
    repo_id: str,
    *,
    commit_message: Optional[str] = None,
    private: Optional[bool] = None,
    token: Union[str, bool, None] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
):
    """Create the model repo ``repo_id`` if needed, build :func:`upload_folder_of` ``write`` in a
    temporary folder and upload it (``huggingface_hub.HfApi.upload_folder``); returns the
    ``CommitInfo``."""
    from huggingface_hub import HfApi

    api = HfApi(token=token, library_name="unclip", library_version=_version())
    # first, so that no time is spent saving when the Hub cannot be reached (or HF_HUB_OFFLINE)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="unclip-push-") as tmp:
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=upload_folder_of(write, tmp),
            commit_message=commit_message or "Upload with unclip",
            revision=revision,
            create_pr=create_pr,
        )
