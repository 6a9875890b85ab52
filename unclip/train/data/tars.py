"""Reading img2dataset tar shards: the samples of a shard as raw bytes (:func:`iter_tar_samples`),
and a header-only listing of a local shard (:func:`shard_listing`) with which a resumed stream skips
what it already consumed without reading or decoding it (:func:`read_listed` fetches the few listed
samples it still needs)."""

from __future__ import annotations

import json
import os
import re
import stat
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "expand_urls",
    "iter_tar_samples",
    "shard_error",
    "shard_listing",
    "read_listed",
    "local_file",
    "file_stamp",
]

_META = re.compile(r"__[^/]*__($|/)")


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


def _tar_files(url: str, errors: list, offset: int = 0) -> Iterator[dict]:
    """The regular members of one shard as webdataset file dicts, then webdataset's end-of-shard
    marker ``{}``; an unreadable or cut-short shard appends its exception to ``errors``.
    ``offset``: start at this byte (a member's header; local files only)."""
    from webdataset.gopen import gopen

    stream = None
    try:
        stream = gopen(url)
        if offset:
            stream.seek(offset)
        tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_StrictTarInfo)
        for member in tar:
            # skip directories and webdataset's own "__name__" metadata members
            if not member.isreg() or _META.match(member.name):
                continue
            data = tar.extractfile(member).read()  # type: ignore[union-attr]  # a regular member
            yield {"fname": member.name, "data": data, "__url__": url}
            # streamed: do not keep every header in memory (members is private to typeshed)
            tar.members = []  # type: ignore[attr-defined]
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


def iter_tar_samples(urls: Sequence[str], offset: int = 0, index: int = 0) -> Iterator[dict]:
    """Raw img2dataset samples (``{"__key__", "__url__", "jpg"|..., "txt", ...}`` bytes) of ``urls``
    in order.

    A shard that cannot be opened or read to its end (truncated, corrupt, a failing ``pipe:``)
    yields, after the samples read before the break, one error item ``{"__url__", "__error__":
    reason, "__lost__": n}`` where ``n`` is the number of samples lost if img2dataset's
    ``<shard>_stats.json`` lies beside the shard, else None (unknown). ``offset``: read the first
    shard from this byte on (the ``__offset__`` of a :func:`shard_listing` item, whose
    ``__index__`` is ``index``): ``__lost__`` then counts the ``index`` samples before it as read.
    """
    from webdataset.tariterators import group_by_keys

    for url in urls:
        errors: list = []

        def handler(exc: Exception, errors: list = errors) -> bool:
            errors.append(exc)
            return True

        count, index = index, 0
        for sample in group_by_keys(_tar_files(url, errors, offset), handler=handler):
            count += 1
            yield sample
        for exc in errors:
            yield _error_item(url, exc, count)
        offset = 0


def file_stamp(url: str) -> Optional[list[int]]:
    """``[size, modification time in ns]`` of a local shard, or None (``pipe:``/remote URLs, a
    missing file): what tells a shard changed since a run counted its samples."""
    if url.startswith("file:"):
        url = url[len("file:") :]
    if url.startswith("pipe:") or "://" in url:
        return None
    try:  # one stat call: a resume stamps every shard it passes
        st = os.stat(url)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else None


def _error_item(url: str, exc: BaseException, count: int) -> dict:
    size = _shard_size(url)
    lost = None if size is None else max(size - count, 0)
    return {"__url__": url, "__error__": f"{type(exc).__name__}: {exc}", "__lost__": lost}


def local_file(url: str) -> Optional[Path]:
    """The local file behind a shard URL (a plain path or ``file:``), or ``None`` for ``pipe:`` and
    remote URLs."""
    if url.startswith("file:"):
        url = url[len("file:") :]
    if url.startswith("pipe:") or "://" in url:
        return None
    path = Path(url)
    return path if path.is_file() else None


def shard_listing(url: str) -> Optional[list[dict]]:
    """What :func:`iter_tar_samples` yields for one shard, in the same order and grouping, with no
    member data read: each sample as ``{"__url__", "__key__", "__index__": i, "__offset__": byte
    of its first member's header}``, a break as the same error item. ``None`` when the shard cannot
    be listed by seeking (``pipe:``/remote URLs, compressed or unreadable tars): read it whole.

    Only the 512-byte headers are read (the data is seeked over), so listing a shard costs
    microseconds per sample where decoding its images costs milliseconds: resuming a stream skips
    the shards it already consumed this way (:class:`~unclip.train.data.sources.WebDatasetStream`).
    A member whose data runs past the end of the file ends the listing as the streaming read ends
    there, so both count the same samples."""
    from webdataset.tariterators import group_by_keys

    path = local_file(url)
    if path is None:
        return None
    errors: list = []
    try:
        f = open(path, "rb")
        tar = tarfile.open(fileobj=f, mode="r:", tarinfo=_StrictTarInfo)
    except (OSError, tarfile.TarError):
        return None
    size = os.fstat(f.fileno()).st_size
    plain = _plain_members(f.fileno(), size)

    if plain is not None:
        f.close()
        return _group_plain(url, plain)

    def files() -> Iterator[dict]:
        # the header offset travels as the member's "data": group_by_keys keeps it per suffix
        try:
            while True:
                member = tar.next()
                if member is None:
                    break
                tar.members = []  # type: ignore[attr-defined]  # private: drop read headers
                if not member.isreg() or _META.match(member.name):
                    continue
                if member.offset_data + member.size > size:
                    raise tarfile.ReadError("unexpected end of data")
                yield {"fname": member.name, "data": member.offset, "__url__": url}
        except Exception as exc:  # as _tar_files: any break ends the shard with an error item
            errors.append(exc)
        yield {}

    def handler(exc: Exception) -> bool:
        errors.append(exc)
        return True

    out = []
    try:
        for i, sample in enumerate(group_by_keys(files(), handler=handler)):
            first = min(v for k, v in sample.items() if not k.startswith("__"))
            out.append(
                {"__url__": url, "__key__": sample["__key__"], "__index__": i, "__offset__": first}
            )
    finally:
        f.close()
    return out + [_error_item(url, exc, len(out)) for exc in errors]


def _group_plain(url: str, members: list[tuple[str, int]]) -> list[dict]:
    """:func:`shard_listing` of plain members, grouped as webdataset's ``group_by_keys`` groups them
    (a sample per run of equal keys; a repeated suffix is an error reported after the samples and
    its member left out), without building its per-member dicts."""
    from webdataset.tariterators import base_plus_ext

    out: list[dict] = []
    errors: list[ValueError] = []
    key: Optional[str] = None
    suffixes: set[str] = set()
    for name, offset in members:
        if _META.match(name):
            continue
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            continue
        suffix = suffix.lower()
        if key is None or prefix != key:
            key, suffixes = prefix, set()
            out.append(
                {"__url__": url, "__key__": key, "__index__": len(out), "__offset__": offset}
            )
        if suffix in suffixes or suffix in ("__key__", "__url__"):
            errors.append(ValueError(f"{name}: duplicate file name in tar file {suffix}"))
            continue
        suffixes.add(suffix)
    return out + [_error_item(url, exc, len(out)) for exc in errors]


def _plain_members(fd: int, size: int) -> Optional[list[tuple[str, int]]]:
    """``[(name, header offset)]`` of the regular files of a tar made only of plain ustar/GNU
    headers (regular files and folders, valid checksums, every member whole, an end-of-archive
    block), as img2dataset writes them; ``None`` for anything else (long names, pax headers, a
    break), which :mod:`tarfile` then lists (the same members, at several times the cost per
    header)."""
    out: list[tuple[str, int]] = []
    offset = 0
    while True:
        block = os.pread(fd, tarfile.BLOCKSIZE, offset)
        if len(block) != tarfile.BLOCKSIZE:
            return None  # no end-of-archive block: tarfile reports the shard cut short
        if block.count(0) == tarfile.BLOCKSIZE:
            return out
        # the header's checksum (unsigned; tarfile also takes a signed one) and octal size
        stored, length_field = block[148:156], block[124:136]
        if block[124] & 0x80 or stored[:1] == b"\0":
            return None  # a base-256 size or an empty checksum field: tarfile decodes them
        try:
            checksum = int(stored.rstrip(b"\0 "), 8)
            length = int(length_field.rstrip(b"\0 ") or b"0", 8)
        except ValueError:
            return None
        if checksum != sum(block) - sum(stored) + 256:
            return None
        kind = block[156:157]
        end = block.find(0, 0, 100)
        name = block[: 100 if end < 0 else end].decode(tarfile.ENCODING, "surrogateescape")
        if block[257:265] == tarfile.POSIX_MAGIC and block[345] != 0:
            return None  # a name prefix: tarfile joins it
        data = offset + tarfile.BLOCKSIZE
        if data + length > size:
            return None
        if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) and not name.endswith("/"):
            out.append((name, offset))
        elif kind not in (tarfile.DIRTYPE, tarfile.AREGTYPE):
            return None
        offset = data + -(-length // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def read_listed(items: Sequence[dict]) -> dict[tuple[str, int], dict]:
    """The full raw samples (data read, not decoded) of :func:`shard_listing` items, by
    ``(url, index)``, each read from its offset (runs of nearby ones in one pass)."""
    wanted: dict[str, dict[int, int]] = {}
    for item in items:
        wanted.setdefault(item["__url__"], {})[item["__index__"]] = item["__offset__"]
    out = {}
    for url, indices in wanted.items():
        # runs of nearby samples are read in one pass; a far one (a sample that stayed long in a
        # shuffle buffer) from its own offset, so no shard is read between them
        order = sorted(indices)
        runs = [[order[0]]]
        for i in order[1:]:
            if i - runs[-1][-1] <= 8:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            for i, raw in enumerate(iter_tar_samples([url], offset=indices[first]), start=first):
                if i > last or "__error__" in raw:
                    break
                if i in indices:
                    out[url, i] = raw
    missing = [(url, i) for url, ix in wanted.items() for i in ix if (url, i) not in out]
    if missing:
        raise ValueError(
            f"shard {missing[0][0]} changed since it was listed (sample {missing[0][1]} is gone); "
            "do not modify shards during a run"
        )
    return out


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
