"""img2dataset webdataset shards: shard URLs, strict tar reading (a shard cut short is reported, not
silently ended) and the error items of broken shards."""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional, Union

__all__ = ["TAR_IMAGE_KEYS", "expand_urls", "iter_tar_samples", "shard_error"]

TAR_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


def expand_urls(urls: Union[str, Sequence[str]]) -> list[str]:
    """Shard URLs from a path, brace pattern (``data/{00000..00009}.tar``), ``::``-joined string or
    list. A local folder (img2dataset's output folder) stands for the ``.tar`` shards directly in
    it, in name order; the ``*_stats.json``, ``.parquet`` and other files img2dataset writes beside
    them are not shards."""
    from webdataset.shardlists import expand_urls as wds_expand

    if isinstance(urls, (str, Path)):
        items = [urls]
    elif isinstance(urls, (list, tuple)):
        items = list(urls)
    else:
        raise TypeError(f"urls must be a string or a list of strings, got {type(urls).__name__}")
    out = []
    for item in items:
        if Path(item).is_dir():
            out += _folder_shards(Path(item))
        else:
            out += wds_expand(str(item))
    if not out:
        raise ValueError(f"no shards in {urls!r}")
    return out


def _folder_shards(folder: Path) -> list[str]:
    shards = sorted(str(f) for f in folder.iterdir() if f.suffix == ".tar" and f.is_file())
    if not shards:
        raise ValueError(
            f"{folder} is a folder with no .tar shards in it; give the folder img2dataset wrote "
            "with --output_format webdataset, or the shards themselves "
            "(e.g. data/{00000..00009}.tar)"
        )
    return shards


class _StrictTarInfo(tarfile.TarInfo):
    """Tar header reader that reports a shard cut short: after the first member, :mod:`tarfile`
    takes a truncated, missing or garbled header for the end of the archive and stops without a
    word, which would lose the rest of the shard silently."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except (
            tarfile.EmptyHeaderError,
            tarfile.TruncatedHeaderError,
            tarfile.InvalidHeaderError,
        ) as exc:
            if tar.offset == 0:
                raise
            raise tarfile.ReadError(
                f"cut short at byte {tar.offset} ({exc}; no end-of-archive marker)"
            ) from None


def _tar_files(url: str, errors: list) -> Iterator[dict]:
    """The regular members of one shard as webdataset file dicts, then webdataset's end-of-shard
    marker ``{}``; an unreadable or cut-short shard appends its exception to ``errors``."""
    from webdataset.gopen import gopen

    stream = None
    try:
        stream = gopen(url)
        tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_StrictTarInfo)
        for member in tar:
            # skip directories and webdataset's own "__name__" metadata members
            if not member.isreg() or re.match(r"__[^/]*__($|/)", member.name):
                continue
            data = tar.extractfile(member).read()
            yield {"fname": member.name, "data": data, "__url__": url}
            tar.members = []  # streamed: do not keep every header in memory
    except Exception as exc:  # tarfile.ReadError, OSError, EOFError, zlib.error, pipe status
        errors.append(exc)
    finally:
        if stream is not None:
            try:
                stream.close()
            except Exception as exc:  # a pipe: URL whose command failed
                errors.append(exc)
    yield {}


def _shard_size(url: str) -> Optional[int]:
    """The number of samples img2dataset wrote to a local shard (``successes`` in the
    ``<shard>_stats.json`` beside it), or None if unknown."""
    path = Path(url)
    stats = path.with_name(path.name.split(".")[0] + "_stats.json")
    try:
        n = json.loads(stats.read_text()).get("successes")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def iter_tar_samples(urls: Sequence[str]) -> Iterator[dict]:
    """Raw img2dataset samples (``{"__key__", "__url__", "jpg"|..., "txt", ...}`` bytes) of ``urls``
    in order.

    A shard that cannot be opened or read to its end (truncated, corrupt, a failing ``pipe:``)
    yields, after the samples read before the break, one error item ``{"__url__", "__error__":
    reason, "__lost__": n}`` where ``n`` is the number of samples lost if img2dataset's
    ``<shard>_stats.json`` lies beside the shard, else None (unknown).
    """
    from webdataset.tariterators import group_by_keys

    for url in urls:
        errors: list = []

        def handler(exc: Exception, errors: list = errors) -> bool:
            errors.append(exc)
            return True

        count = 0
        for sample in group_by_keys(_tar_files(url, errors), handler=handler):
            count += 1
            yield sample
        for exc in errors:
            size = _shard_size(url)
            lost = None if size is None else max(size - count, 0)
            yield {"__url__": url, "__error__": f"{type(exc).__name__}: {exc}", "__lost__": lost}


def shard_error(raw: dict) -> Optional[str]:
    """The one-line reason of an error item of :func:`iter_tar_samples`, or None for a sample."""
    if "__error__" not in raw:
        return None
    lost = raw.get("__lost__")
    what = "the rest of the shard" if lost is None else f"{lost} sample(s)"
    return (
        f"broken shard {raw['__url__']} ({raw['__error__']}): {what} lost; re-download or "
        "re-create the shard"
    )
