"""Training data sources: image folders, img2dataset webdataset shards and precomputed CLIP
embeddings.

Every source is a *sample stream*: an endless iterable of sample dicts, deterministic for
``(seed, rank, world_size)`` and exactly resumable. Built with ``start=k`` (the number of samples
this rank already consumed) a stream yields exactly the samples that a stream built with
``start=0`` yields after its first ``k``.

Samples
-------
* image sources: ``{"image": float32 [3, R, R] in [-1, 1], "caption": str, "skipped": int}``; the
  image is converted to RGB, resized on the shorter side to ``R`` (bicubic, antialiased) and
  centre-cropped.
* image sources built with ``clip_resolution=S`` also carry ``"clip_image": float32 [3, S, S]``
  in [-1, 1]: the original image resized and centre-cropped to ``S`` (a CLIP's input size), the
  same geometry as the CLIP's own preprocessing, so its embedding is that of the full-resolution
  image (``data.clip_view: full``).
* embeddings: ``{"image_embed": float32 [D], "text_embed": float32 [D], "caption": str,
  "skipped": int}``.

Every sample also carries ``"data_cursor": (logical worker, workers, position[, shard counts])``:
``position`` is the number of raw items (files, tar samples, rows; bad ones included) this consumer
has read up to and including this sample. A stream built with ``cursor=position`` resumes right
after it without reading or decoding the items before (:class:`WebDatasetStream` passes the shards
it consumed by the sample counts its cursors carried), where ``start`` must check every earlier
item to count only the good ones; the training loop keeps the last cursor of each worker and the
shard counts in its checkpoints.

``skipped`` is the number of bad samples the stream dropped right before this one (unreadable image,
missing or empty caption, non-finite embedding), so a trainer can sum it even when the stream runs
inside DataLoader workers (:func:`collate` sums it per batch). Bad samples never raise; the first
few are logged with the reason. A stream whose whole epoch is bad raises ``ValueError``.

Splitting the data
------------------
The data is split across ``world_size * num_workers`` *consumers*. Worker ``w`` of rank ``r`` is
consumer ``c = r + w * world_size``; it takes positions ``p ≡ c (mod world_size * num_workers)`` of
each epoch's order (files or rows) or, for webdataset, those shards of the epoch's shard order. The
union over a rank's workers is therefore exactly "every ``world_size``-th item" for that rank.
``worker`` and ``num_workers`` default to ``torch.utils.data.get_worker_info()`` (worker 0 of 1 in
the main process); ``start`` always counts the samples *this consumer* yielded.
:class:`StreamDataset` converts a rank's consumed-sample count into per-worker starts for
``DataLoader(num_workers=k)``.

Every stream takes the keyword arguments ``seed``, ``rank``, ``world_size``, ``start`` (default 0),
``cursor`` (default None: resume by ``start``), ``worker`` and ``num_workers`` (default: from the
DataLoader worker info) that define this split.
(Image sources also take ``clip_resolution``, see Samples.)
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from PIL import Image

from unclip._compat import package_getattr
from unclip.train.data.batching import StreamDataset, collate
from unclip.train.data.resume import (
    buffer_positions,
    buffered_and_rest,
    head_changed,
    shard_list_changed,
    shard_list_id,
)
from unclip.train.data.tars import (
    expand_urls,
    file_stamp,
    iter_tar_samples,
    shard_error,
    shard_listing,
)
from unclip.utils.images import list_images, resize_crop_tensor

__all__ = [
    "FolderStream",
    "WebDatasetStream",
    "StreamDataset",
    "collate",
    "image_to_tensor",
    "open_rgb",
    "expand_urls",
    "iter_tar_samples",
    "shard_error",
    "TAR_IMAGE_KEYS",
]

logger = logging.getLogger(__name__)

TAR_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
_MAX_LOGGED = 5


class BadSample(Exception):
    """Internal: a sample that must be skipped; the message is the reason. ``count``: how many
    samples it stands for (a broken shard loses several); ``loud``: always log it, also after the
    first few."""

    def __init__(self, reason: str, count: int = 1, loud: bool = False):
        super().__init__(reason)
        self.count, self.loud = count, loud


class _EpochEnd(int):
    """Internal marker: one epoch of a consumer's raw items (this many) has been produced."""


# --------------------------------------------------------------------------------------------------
# Decoding helpers (also used by ``unclip embed``)
# --------------------------------------------------------------------------------------------------
def open_rgb(src: Union[str, Path, bytes]) -> Image.Image:
    """Fully decode an image file or encoded bytes to an RGB PIL image; raises ``BadSample`` if
    unreadable."""
    try:
        with Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src) as im:
            im.load()
            return im.convert("RGB")
    # PIL raises many types for broken data (OSError, SyntaxError, ValueError, ...)
    except Exception as exc:
        raise BadSample(f"unreadable image ({type(exc).__name__}: {exc})") from None


def check_caption(raw: Optional[Union[bytes, str]]) -> str:
    """The stripped caption, or ``BadSample`` if missing, not UTF-8 or empty."""
    if raw is None:
        raise BadSample("missing caption")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadSample("caption is not valid UTF-8") from None
    caption = raw.strip()
    if not caption:
        raise BadSample("empty caption")
    return caption


def image_to_tensor(image: Image.Image, resolution: int) -> torch.Tensor:
    """PIL image → float32 ``[3, R, R]`` in [-1, 1]: RGB, shorter side to ``R`` (bicubic,
    antialias), centre crop."""
    arr = np.asarray(image.convert("RGB"), dtype=np.uint8)
    x = torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)
    x = resize_crop_tensor(x, resolution).clamp_(0.0, 1.0)
    return (x * 2.0 - 1.0).contiguous()


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def _check_split(seed, rank, world_size, start) -> None:
    for name, value, low in (
        ("seed", seed, 0),
        ("rank", rank, 0),
        ("world_size", world_size, 1),
        ("start", start, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank {rank} must be < world_size {world_size}")


# --------------------------------------------------------------------------------------------------
# The shared stream loop
# --------------------------------------------------------------------------------------------------
class _Stream:
    """Base: subclasses produce raw items per consumer (``_raw``), check them (``_check``) and build
    samples. The keyword arguments define the split (module doc)."""

    what = "sample"
    resolution: int  # image sources: the training image side (_sample)

    def __init__(
        self,
        *,
        seed: int,
        rank: int,
        world_size: int,
        start: int = 0,
        worker: Optional[int] = None,
        num_workers: Optional[int] = None,
        clip_resolution: Optional[int] = None,
        cursor: Optional[int] = None,
    ):
        _check_split(seed, rank, world_size, start)
        if cursor is not None and (isinstance(cursor, bool) or not isinstance(cursor, int)):
            raise ValueError(f"cursor must be an int >= 0, got {cursor!r}")
        if cursor is not None and cursor < 0:
            raise ValueError(f"cursor must be an int >= 0, got {cursor!r}")
        self.cursor = cursor
        if clip_resolution is not None and (
            isinstance(clip_resolution, bool)
            or not isinstance(clip_resolution, int)
            or clip_resolution < 1
        ):
            raise ValueError(f"clip_resolution must be an int >= 1, got {clip_resolution!r}")
        self.clip_resolution = clip_resolution
        self.seed, self.rank, self.world_size, self.start = (
            int(seed),
            int(rank),
            int(world_size),
            int(start),
        )
        self.worker, self.num_workers = worker, num_workers
        self._logged = 0

    def consumer(self) -> tuple[int, int]:
        """``(c, n)``: this consumer's index and the number of consumers (see module doc)."""
        worker, num_workers = self.worker, self.num_workers
        if worker is None or num_workers is None:
            info = torch.utils.data.get_worker_info()
            worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} must be in [0, num_workers={num_workers})")
        return self.rank + worker * self.world_size, self.world_size * num_workers

    def _bad(self, reason: str, loud: bool = False) -> None:
        if loud:
            logger.warning("%s: %s", type(self).__name__, reason)
            return
        if self._logged < _MAX_LOGGED:
            logger.warning("%s: skipping bad %s: %s", type(self).__name__, self.what, reason)
        elif self._logged == _MAX_LOGGED:
            logger.warning(
                "%s: further bad samples are skipped without logging (see 'skipped' counts)",
                type(self).__name__,
            )
        self._logged += 1

    def __iter__(self) -> Iterator[dict]:
        c, n = self.consumer()
        consumed = skipped = run_of_bad = 0
        epoch_len = None
        # resuming at a cursor: the raw items before it are skipped unread (see _raw_from); at a
        # start count: they are read and checked, as the count leaves out the bad ones
        position = self.cursor or 0
        raw = self._raw(c, n) if self.cursor is None else self._raw_from(c, n, self.cursor)
        for item in raw:
            if isinstance(item, _EpochEnd):
                if item == 0:
                    raise ValueError(
                        f"{self.describe()}: consumer {c} of {n} (rank {self.rank}) got no "
                        f"samples in a whole epoch"
                    )
                epoch_len = int(item)
                continue
            position += 1
            try:
                value = self._check(item)
            except BadSample as exc:
                skipped += exc.count
                run_of_bad += 1
                self._bad(str(exc), exc.loud)
                if epoch_len is not None and run_of_bad >= epoch_len:
                    raise ValueError(
                        f"{self.describe()}: {run_of_bad} bad samples in a row (a whole epoch); "
                        f"last reason: {exc}"
                    ) from None
                continue
            run_of_bad = 0
            if self.cursor is not None or consumed >= self.start:
                sample = self._sample(value)
                sample["skipped"] = skipped
                # (logical worker, workers, raw items read): where a resumed stream picks up
                sample["data_cursor"] = (
                    (c - self.rank) // self.world_size,
                    n // self.world_size,
                    position,
                    *self._cursor_news(),
                )
                yield sample
            skipped = 0
            consumed += 1

    def _cursor_news(self) -> tuple:
        """What a sample's ``data_cursor`` carries after the position (WebDataset: shard counts)."""
        return ()

    def _raw_from(self, c: int, n: int, skip: int) -> Iterator:
        """``_raw(c, n)`` without its first ``skip`` items (epoch markers pass): sources whose raw
        items are cheap (file paths, embedding rows) drop them unread; WebDataset overrides it."""
        for item in self._raw(c, n):
            if isinstance(item, _EpochEnd) or skip == 0:
                yield item
            else:
                skip -= 1

    # subclasses define describe, _raw and _check, and _sample unless they stream images

    def describe(self) -> str:
        """What this stream reads, for messages."""
        raise NotImplementedError

    def _raw(self, c: int, n: int) -> Iterator:
        """Consumer ``c`` of ``n``'s raw items, with :class:`_EpochEnd` markers between epochs."""
        raise NotImplementedError

    def _check(self, item):
        """The value of a raw item, or raise :class:`BadSample`."""
        raise NotImplementedError

    def _sample(self, value) -> dict:  # image sources: value = (PIL image, caption)
        image, caption = value
        sample = {"image": image_to_tensor(image, self.resolution), "caption": caption}
        if self.clip_resolution is not None:
            # cut from the decoded original, not from the (smaller) training image
            sample["clip_image"] = image_to_tensor(image, self.clip_resolution)
        return sample


# --------------------------------------------------------------------------------------------------
# Folder
# --------------------------------------------------------------------------------------------------
class FolderStream(_Stream):
    """Images (those :func:`unclip.utils.images.list_images` lists, recursively) with same-stem
    ``.txt`` captions, looping over epochs.

    Epoch ``e`` visits the files in a permutation seeded by ``(seed, e)`` (sorted order if
    ``shuffle=False``); consumer ``c`` of ``n`` (module doc) takes every ``n``-th file from position
    ``c``. Resuming at a ``cursor`` skips the files before it unread; at a ``start`` count it
    re-reads (decodes) them to know which were bad, so skip counts stay exact. ``split``: the
    keyword arguments of the data split (module doc).
    """

    what = "image"

    def __init__(self, path, resolution: int, *, shuffle: bool = True, **split):
        super().__init__(**split)
        self.path, self.resolution, self.shuffle = Path(path), int(resolution), bool(shuffle)
        try:
            self.files = list_images(self.path)
        except ValueError as exc:
            raise ValueError(f"{exc}; expected image files with same-stem .txt captions") from None

    def describe(self) -> str:
        return f"image folder {self.path} ({len(self.files)} images)"

    def _raw(self, c: int, n: int) -> Iterator:
        if len(self.files) <= c:
            raise ValueError(
                f"{self.describe()} has fewer images than consumers "
                f"(world_size * num_workers = {n}); add images or use fewer processes/workers"
            )
        epoch = 0
        while True:
            order = (
                _rng(self.seed, epoch).permutation(len(self.files))
                if self.shuffle
                else np.arange(len(self.files))
            )
            mine = order[c::n]
            for i in mine:
                yield self.files[i]
            yield _EpochEnd(len(mine))
            epoch += 1

    def _check(self, file: Path):
        txt = file.with_suffix(".txt")
        if not txt.is_file():
            raise BadSample(f"{file}: missing caption file {txt.name}")
        try:
            caption = check_caption(txt.read_bytes())
        except BadSample as exc:
            raise BadSample(f"{file}: {exc}") from None
        try:
            return open_rgb(file), caption
        except BadSample as exc:
            raise BadSample(f"{file}: {exc}") from None


# --------------------------------------------------------------------------------------------------
# WebDataset (img2dataset shards)
# --------------------------------------------------------------------------------------------------
class WebDatasetStream(_Stream):
    """img2dataset tar shards (``{key}.jpg|png|webp`` + ``{key}.txt`` (+ ``.json``)), looping over
    epochs.

    ``urls``: a local path, brace pattern (``data/{00000..00009}.tar``), ``::``-joined string, list,
    or ``pipe:`` URLs (e.g. ``"pipe:cat data/00000.tar"``). Epoch ``e`` orders the shards by a
    permutation seeded by ``(seed, e)``; consumer ``c`` of ``n`` (module doc) reads shards
    ``c, c+n, …`` of that order, so shards are split across ranks *and* DataLoader workers. Samples
    pass through a shuffle buffer of ``shuffle_buffer`` raw samples (seeded by ``(seed, c, n)``; 0
    or 1 disables it) that carries over epochs, then are decoded; unreadable images and
    missing/empty ``.txt`` captions are skipped and counted; a shard that cannot be opened or is cut
    short (also inside a tar header) is logged with its name and counted as skipped: as the number
    of samples lost when img2dataset's ``<shard>_stats.json`` lies beside it, else as one.
    Each sample's ``data_cursor`` also carries ``{shard: [raw items, size, mtime_ns]}`` for the
    shards read to their end since the previous sample (no size/mtime for ``pipe:``/remote ones).
    Resuming at a ``cursor`` with those counts (``shard_counts``, gathered by
    :func:`~unclip.train.data.batching.cursors_of`) passes the consumed shards unopened, computes
    what the shuffle buffer held from its random draws alone and reads those samples and the rest
    of the shard the cursor stands in; a consumed shard whose size or mtime changed is reported
    and still passed by its count, unless the shuffle buffer still held samples of it, which is
    refused. A shard without a count is listed by its headers (local) or read, not decoded
    (``pipe:``/remote). At a ``start`` count the skipped samples are read and decoded. ``split``:
    the keyword arguments of the data split (module doc).

    The ``data_cursor`` ends with ``{"list": ..., "head": [shard, size, mtime_ns]}``: the shard
    list's :func:`~unclip.train.data.resume.shard_list_id` and the shard being read (no stamp for
    ``pipe:``/remote ones). Given back as ``shard_list`` and ``head``, a resume refuses another
    shard list and a shard in progress that changed since (size or modification time) instead of
    training on other samples than the run would have.
    """

    what = "webdataset sample"

    def __init__(
        self,
        urls,
        resolution: int,
        *,
        shuffle_buffer: int = 1000,
        shard_counts: Optional[dict] = None,
        shard_list: Optional[str] = None,
        head: Optional[list] = None,
        **split,
    ):
        super().__init__(**split)
        self.urls = expand_urls(urls)
        self.list_id = shard_list_id(self.urls)
        self.shard_counts = dict(shard_counts or {})
        # what the cursor resumed at was taken on (None: a checkpoint from before they were kept)
        self.shard_list, self.head = shard_list, (list(head) if head else None)
        self._news: dict[str, list[int]] = {}
        self._reading: list = []  # the shard being read, with the stamp it had when opened
        self.resolution, self.shuffle_buffer = int(resolution), int(shuffle_buffer)
        if len(self.urls) < self.world_size:
            raise ValueError(
                f"webdataset has {len(self.urls)} shard(s) but world_size is {self.world_size}: "
                f"every process needs at least one whole shard. Re-shard the data into at least "
                f"{self.world_size} (ideally many more) shards, e.g. img2dataset with a smaller "
                f"--number_sample_per_shard, or run fewer processes"
            )

    def describe(self) -> str:
        more = " …" if len(self.urls) > 1 else ""
        return f"webdataset {self.urls[0]}{more} ({len(self.urls)} shards)"

    def _order(self, c: int, n: int, epoch: int) -> list[str]:
        """Consumer ``c`` of ``n``'s shards in epoch ``epoch``."""
        if len(self.urls) <= c:
            raise ValueError(
                f"{self.describe()}: {n} consumers (world_size {self.world_size} x DataLoader "
                f"workers) but only {len(self.urls)} shards; every worker needs a shard: use fewer "
                f"DataLoader workers or more shards"
            )
        order = _rng(self.seed, 2, epoch).permutation(len(self.urls))
        return [self.urls[i] for i in order[c::n]]

    def _epochs(self, c: int, n: int, at: tuple = (0, 0, 0), head=None) -> Iterator:
        """This consumer's raw samples, epoch after epoch, from shard ``k`` of epoch ``e`` with
        ``at = (e, k, samples of epoch e before it)``; ``head``: ``(its samples from where the
        stream resumes, how many it skipped, its file stamp)``. Each shard read to its end is
        counted (``_news``, carried by the next sample's ``data_cursor``): its raw items and the
        size and modification time it had."""
        epoch, k, count = at
        while True:
            for url in self._order(c, n, epoch)[k:]:
                if head is not None:
                    (raws, got, stamp), head = head, None
                else:
                    raws, got, stamp = iter_tar_samples([url]), 0, file_stamp(url)
                self._reading = [url, *(stamp or ())]
                # one sample ahead, so a shard is counted as its last sample leaves: a cursor
                # then carries the count of every shard read to its end before it
                raws = iter(raws)
                ahead = next(raws, None)
                while ahead is not None:
                    raw, ahead = ahead, next(raws, None)
                    got += 1
                    count += 1
                    if ahead is None:
                        self._news[url] = [got, *(stamp or ())]
                    yield raw
                self._news[url] = [got, *(stamp or ())]
            yield _EpochEnd(count)
            epoch, k, count = epoch + 1, 0, 0

    def _raw(self, c: int, n: int, skip: int = 0) -> Iterator:
        buffer = self.shuffle_buffer if self.shuffle_buffer > 1 else 0
        rng = _rng(self.seed, 1, c, n)
        buf: list = []
        items = self._resume(c, n, skip, buffer, rng, buf) if skip else self._epochs(c, n)
        if not buffer:
            yield from items
            return
        for item in items:
            if isinstance(item, _EpochEnd):
                yield item
                continue
            if len(buf) < buffer:
                buf.append(item)
            else:
                i = int(rng.integers(len(buf)))
                yield buf[i]
                buf[i] = item

    def _resume(self, c: int, n: int, skip: int, buffer: int, rng, buf: list) -> Iterator:
        """The raw items after the first ``skip`` this consumer's buffer put out, with ``buf``
        filled as the buffer stood then and ``rng`` advanced as it was (see
        :func:`~unclip.train.data.resume.buffer_positions`): the consumed shards are passed by
        their sample counts (``shard_counts``, else listed by their headers or, ``pipe:``/remote,
        read), the samples still in the buffer are read from their shards, and the shard the
        cursor stands in is read on from there."""
        if self.shard_list is not None and self.shard_list != self.list_id:
            raise shard_list_changed(self.shard_list, self.list_id)
        if self.head is not None and len(self.head) > 1:
            now = file_stamp(self.head[0])
            if now != self.head[1:]:
                raise head_changed(self.head[0], self.head[1:], now)
        consumed = skip + buffer  # inputs the buffer had taken
        slots = buffer_positions(rng, buffer, skip) if buffer else np.zeros(0, np.int64)
        wanted = np.unique(slots)
        where: dict[int, tuple[str, int]] = {}  # input position -> (shard, index in it)
        listings: dict[str, list] = {}  # the last few shards listed, for their buffered samples
        changed: dict[str, None] = {}  # in the order met, once each
        stamps: dict[str, Optional[list[int]]] = {}
        epoch, pos, last_epoch = 0, 0, 0
        while True:
            first = pos
            urls = self._order(c, n, epoch)
            for k in range(len(urls)):  # k and url stay where the cursor stands
                url = urls[k]
                count = consumed - pos
                if count > 0:
                    count = self._shard_count(url, listings, changed, stamps)
                lo, hi = np.searchsorted(wanted, [pos, min(pos + count, consumed)])
                where.update((int(p), (url, int(p) - pos)) for p in wanted[lo:hi])
                if pos + count > consumed or pos == consumed:
                    break
                pos += count
            else:
                if pos == first:
                    raise ValueError(
                        f"{self.describe()}: consumer {c} of {n} (rank {self.rank}) got no "
                        f"samples in a whole epoch"
                    )
                last_epoch, epoch = pos - first, epoch + 1
                continue
            break
        needed = [u for u, _ in where.values() if u in changed]
        if needed:
            raise ValueError(
                f"shard {needed[0]} changed on disk since the run counted it (size or "
                f"modification time) and {len(needed)} of its samples were still in the shuffle "
                "buffer at the checkpoint: the resumed stream would train on other samples; "
                "restore the shard as it was (do not modify shards during a run)"
            )
        if changed:
            logger.warning(
                "%s: %d consumed shard(s) differ in size or modification time from when the run "
                "counted them (first: %s); the resume skips the samples the run counted",
                type(self).__name__,
                len(changed),
                next(iter(changed)),
            )
        index = consumed - pos  # of the next sample in the shard the cursor stands in
        if index and self.head is not None and self.head[0] != url:
            # the shards before it were counted otherwise than the run counted them
            raise ValueError(
                f"{self.describe()}: the cursor of consumer {c} of {n} stands in shard {url}, "
                f"the run was reading {self.head[0]}: the shards changed since the checkpoint; "
                "restore them as they were (do not modify shards during a run)"
            )
        fetched, head = buffered_and_rest(where.values(), url, index, listings)
        buf[:] = [dict(fetched[where[int(p)]]) for p in slots]
        if last_epoch:
            yield _EpochEnd(last_epoch)
        yield from self._epochs(c, n, (epoch, k, consumed - first), head)

    def _shard_count(self, url: str, listings: dict, changed: dict, stamps: dict) -> int:
        """The number of raw items a consumed shard gave: as the run counted it, else listed or
        read now (and carried by the next ``data_cursor``)."""
        known = self.shard_counts.get(url)
        if url not in stamps:  # each shard once per resume, however many epochs it passes
            stamps[url] = file_stamp(url)
        stamp = stamps[url]
        if known is not None:
            if len(known) > 1 and list(known[1:]) != stamp:
                changed[url] = None
            return int(known[0])
        listing = shard_listing(url)
        if listing is None:
            count = sum(1 for _ in iter_tar_samples([url]))
        else:
            count = len(listing)
            listings[url] = listing
            if len(listings) > 4:  # buffered samples are in the last few shards
                del listings[next(iter(listings))]
        self._news[url] = [count, *(stamp or ())]
        return count

    def _cursor_news(self) -> tuple:
        news, self._news = self._news, {}
        return news, {"list": self.list_id, "head": list(self._reading)}

    def _raw_from(self, c: int, n: int, skip: int) -> Iterator:
        return self._raw(c, n, skip)

    def _check(self, raw: dict):
        broken = shard_error(raw)
        if broken is not None:
            raise BadSample(broken, count=max(1, raw.get("__lost__") or 0), loud=True)
        where = f"{raw.get('__url__')}:{raw.get('__key__')}"
        ext = next((k for k in TAR_IMAGE_KEYS if k in raw), None)
        if ext is None:
            raise BadSample(f"{where}: no image member ({'/'.join(TAR_IMAGE_KEYS)})")
        try:
            caption = check_caption(raw.get("txt"))
            return open_rgb(raw[ext]), caption
        except BadSample as exc:
            raise BadSample(f"{where}: {exc}") from None


# names that moved out of this module keep their old import path, with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
