"""What a webdataset stream needs to resume at its cursor without replaying what it consumed: which
raw samples its shuffle buffer holds there (:func:`buffer_positions`, in bulk from the buffer's
random draws) and those samples themselves (:func:`fetch_samples`, read from their shards)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Optional

import numpy as np

from unclip.train.data.tars import file_stamp, iter_tar_samples, read_listed, shard_listing

__all__ = ["buffer_positions", "buffered_and_rest", "fetch_samples", "shard_changed"]


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
