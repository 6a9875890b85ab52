"""What a webdataset stream needs to resume at its cursor without replaying what it consumed: which
raw samples its shuffle buffer holds there (:func:`buffer_positions`, in bulk from the buffer's
random draws) and those samples themselves (:func:`fetch_samples`, read from their shards); and
what tells that the data is no longer what the cursor was taken on (:func:`check_resume`): the
number of DataLoader workers, the shard list and the shard each worker was reading."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Optional

import numpy as np

from unclip.train.data.tars import file_stamp, iter_tar_samples, read_listed, shard_listing

__all__ = [
    "buffer_positions",
    "buffered_and_rest",
    "check_resume",
    "fetch_samples",
    "head_changed",
    "shard_changed",
    "shard_list_changed",
    "shard_list_id",
]


def buffer_positions(
    rng: np.random.Generator, size: int, outputs: int, chunk: int = 1 << 20
) -> np.ndarray:
    """The input position each slot of a shuffle buffer of ``size`` holds after ``outputs``
    outputs, and ``rng`` advanced as those outputs advanced it.

    The buffer is filled with inputs ``0 … size-1``; output ``j`` is the slot
    ``rng.integers(size)`` draws, which input ``size + j`` then takes. A slot therefore holds the
    input of the last output that drew it (or its first input if none did), so only the draws
    matter, not the items: they are drawn in bulk (numpy draws a bounded integer in bulk exactly
    as one at a time, and leaves the generator in the same state), ``chunk`` at a time to bound
    the memory at any run length."""
    slots = np.arange(size, dtype=np.int64)
    done = 0
    while done < outputs:
        m = min(outputs - done, chunk)
        drawn = rng.integers(size, size=m)
        # the last draw of each slot (ufunc.at applies repeated indices one after another)
        last = np.full(size, -1, dtype=np.int64)
        np.maximum.at(last, drawn, np.arange(m, dtype=np.int64))
        hit = last >= 0
        slots[hit] = size + done + last[hit]
        done += m
    return slots


def shard_changed(url: str, had: int, has: int) -> ValueError:
    return ValueError(
        f"shard {url} changed on disk since the checkpoint: the run had read {had} sample(s) of "
        f"it, it now has {has}; a resumed run reads again the samples its shuffle buffer held, "
        "so restore the shard as it was (do not modify shards during a run)"
    )


def shard_list_id(urls: Sequence[str]) -> str:
    """``"<number of shards>:<hash of their URLs in order>"``: what a cursor records of the shard
    list, whose length and order seed every epoch's shard permutation (the list itself would be
    a megabyte per checkpoint at LAION's 100k shards)."""
    digest = hashlib.sha256("\n".join(urls).encode("utf-8", "surrogateescape")).hexdigest()
    return f"{len(urls)}:{digest[:16]}"


def shard_list_changed(had: str, has: str) -> ValueError:
    n_had, n_has = had.split(":")[0], has.split(":")[0]
    what = (
        f"{n_had} shards then, {n_has} now"
        if n_had != n_has
        else f"{n_had} shards then and now, not the same or not in the same order"
    )
    return ValueError(
        f"the webdataset's shard list (data.path) changed since the checkpoint ({what}): every "
        "epoch's shard order follows from the list, so the resumed stream would train some "
        "samples twice and skip others; resume with the shards the run read, or start a new run "
        "from the checkpoint's weights (train.init_weights)"
    )


def head_changed(url: str, had: Sequence[int], has: Optional[Sequence[int]]) -> ValueError:
    now = "it is gone" if has is None else f"size {has[0]} bytes, modified at {has[1]} ns now"
    return ValueError(
        f"shard {url}, which the run was reading at the checkpoint, changed on disk since "
        f"(size {had[0]} bytes, modified at {had[1]} ns then; {now}): the resumed stream would "
        "read other samples than the run had in its shuffle buffer and still to come; restore "
        "the shard as it was (do not modify shards during a run)"
    )


def check_resume(data, cursors: dict) -> None:
    """Refuse, in one line naming what changed and what to do, a resume whose data is not what the
    checkpoint's ``cursors`` (:func:`~unclip.train.data.batching.cursors_of`) were taken on: the
    number of DataLoader workers (each reads its own part of the data, so the parts change with
    it), the webdataset shard list, or a shard a worker was reading. A consumed shard that changed
    is left to the stream, which refuses it only if it still needs its samples."""
    from unclip.train.data.tars import expand_urls

    had = cursors.get("num_workers")
    workers = max(1, int(data.num_workers))
    if had is not None and int(had) != workers and cursors.get("positions"):
        raise ValueError(
            f"data.num_workers={data.num_workers} but the checkpoint's run read its data with "
            f"{had} DataLoader worker(s), each its own part of the data: a resume with another "
            f"number would train some samples twice and skip others; resume with "
            f"data.num_workers={had}"
        )
    if data.source != "webdataset":
        return
    listed = cursors.get("shard_list")
    if listed is not None:
        now = shard_list_id(expand_urls(data.path))
        if now != listed:
            raise shard_list_changed(listed, now)
    for _, head in sorted(cursors.get("heads", {}).items()):
        if len(head) > 1 and file_stamp(head[0]) != list(head[1:]):
            raise head_changed(head[0], head[1:], file_stamp(head[0]))


def fetch_samples(
    url: str, indices: Sequence[int], listing: Optional[list[dict]] = None
) -> dict[int, dict]:
    """The raw samples (or error items) at ``indices`` of one shard, as a full read yields them:
    a local shard's from their byte offsets (its :func:`shard_listing`, given or made), a
    ``pipe:``/remote one's by reading it up to the last. Raises ``ValueError`` if the shard no
    longer has one of them."""
    wanted = sorted(set(indices))
    if listing is None:
        listing = shard_listing(url)
    if listing is None:
        out = {}
        for i, raw in enumerate(iter_tar_samples([url])):
            if i > wanted[-1]:
                break
            out[i] = raw
        if wanted[-1] not in out:
            raise shard_changed(url, wanted[-1] + 1, len(out))
        return {i: out[i] for i in wanted}
    if wanted[-1] >= len(listing):
        raise shard_changed(url, wanted[-1] + 1, len(listing))
    items = [listing[i] for i in wanted]
    full = read_listed([x for x in items if "__error__" not in x])
    return {i: full[url, i] if "__error__" not in x else x for i, x in zip(wanted, items)}


def buffered_and_rest(
    buffered: Iterable[tuple[str, int]], url: str, index: int, listings: dict[str, list]
) -> tuple[dict[tuple[str, int], dict], Optional[tuple[Iterator[dict], int, Optional[list]]]]:
    """What a resumed stream reads: the raw samples at the ``buffered`` ``(shard, index)`` pairs,
    and ``(the raw samples of url from index on, index, url's file stamp)`` or None when ``index``
    is 0 (the shard is read from its start). A local shard is read from its samples' offsets (its
    listing from ``listings`` or made), a ``pipe:``/remote one from its start (read, not decoded).
    """
    shards: dict[str, set[int]] = {}
    for u, i in buffered:
        shards.setdefault(u, set()).add(i)
    fetched: dict[tuple[str, int], dict] = {}
    stamp = file_stamp(url)
    head = None
    if index:
        listing = listings.get(url)
        if listing is None and stamp is not None:
            listing = shard_listing(url)
        if listing is not None:
            listings[url] = listing
            if index >= len(listing):
                raise shard_changed(url, index + 1, len(listing))
            nxt = listing[index]
            raws = (
                iter(listing[index:])
                if "__error__" in nxt
                else iter_tar_samples([url], offset=nxt["__offset__"], index=index)
            )
        else:  # read up to the cursor, keeping the buffered samples met on the way
            raws, read = iter(iter_tar_samples([url])), 0
            kept = {i for i in shards.get(url, ()) if i < index}
            for i, raw in zip(range(index), raws):
                read += 1
                if i in kept:
                    fetched[url, i] = raw
            if read < index:
                raise shard_changed(url, index, read)
            if url in shards:
                shards[url] -= kept
        head = (raws, index, stamp)
    for u, indices in shards.items():
        if indices:
            got = fetch_samples(u, sorted(indices), listings.get(u))
            fetched.update(((u, i), raw) for i, raw in got.items())
    return fetched, head
