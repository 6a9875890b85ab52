"""Batches of a rank's sample stream: :class:`StreamDataset` splits it over DataLoader workers with
exact resume, :func:`collate` stacks samples (the sample streams are in
:mod:`unclip.train.data.sources`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

__all__ = ["StreamDataset", "collate", "cursors_of"]


class StreamDataset(torch.utils.data.IterableDataset):
    """A rank's stream for
    ``DataLoader(dataset, batch_size=batch_size, num_workers=k, collate_fn=collate)``.

    ``factory(start=..., worker=..., num_workers=...)`` builds one consumer's stream, e.g.
    ``functools.partial(FolderStream, path, 64, seed=0, rank=rank, world_size=world_size)``;
    ``start`` is the number of samples this *rank* already consumed (a multiple of ``batch_size``
    when ``k > 0``).

    Exact resume with workers: each worker streams its own disjoint part (module doc) and batches it
    itself, and an in-order DataLoader returns batch ``j`` from worker ``j % k``. After
    ``start = m * batch_size`` consumed samples, logical worker ``v`` has delivered
    ``len(range(v, m, k))`` batches, and the next batch is due from logical worker ``m % k``. A new
    DataLoader starts at worker 0, so DataLoader worker ``w`` plays logical worker ``(w + m) % k``
    and restarts that worker's stream after the batches it delivered: the resumed loader yields
    exactly the batches ``m, m+1, …`` of an uninterrupted one. The batching depends on ``k`` and
    ``batch_size``: keep both fixed across a resume. With ``k = 0`` the rank's stream is the single
    consumer's stream and ``start`` is used as is. Do not let another layer (e.g.
    ``accelerator.prepare``) shard this dataset again.

    ``cursors``: ``{logical worker: raw position}`` from the batches delivered before (their
    ``data_cursor``, :func:`cursors_of`); a worker with one resumes there, skipping what it read
    without decoding it, instead of re-reading its ``start`` samples. ``heads``: ``{logical
    worker: the shard it was reading}`` (webdataset), given to the stream with its cursor.
    """

    def __init__(
        self,
        factory: Callable[..., Iterable[dict]],
        *,
        start: int = 0,
        batch_size: int = 1,
        cursors: Optional[dict[int, int]] = None,
        heads: Optional[dict[int, list]] = None,
    ):
        super().__init__()
        self.cursors = dict(cursors or {})
        self.heads = dict(heads or {})
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        self.factory, self.start, self.batch_size = factory, start, batch_size

    def worker_plan(self, worker: int, num_workers: int) -> tuple[int, int]:
        """``(logical worker, its start)`` for DataLoader worker ``worker`` of ``num_workers`` (see
        class doc)."""
        if num_workers <= 1:
            return 0, self.start
        if self.start % self.batch_size:
            raise ValueError(
                f"resuming with DataLoader workers needs start ({self.start}) to be a multiple of "
                f"batch_size ({self.batch_size}); resume at a batch boundary or use num_workers=0"
            )
        done = self.start // self.batch_size
        logical = (worker + done) % num_workers
        return logical, len(range(logical, done, num_workers)) * self.batch_size

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        logical, start = self.worker_plan(worker, num_workers)
        cursor = self.cursors.get(logical)
        extra: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
        if cursor is not None and logical in self.heads:
            extra["head"] = self.heads[logical]
        return iter(self.factory(start=start, worker=logical, num_workers=num_workers, **extra))


def cursors_of(batch: dict, known: dict) -> None:
    """Record the ``data_cursor`` of a collated batch in ``known`` (``{"num_workers": k,
    "positions": {logical worker: raw position}, "shards": {shard: [samples, size, mtime_ns]},
    "shard_list": id, "heads": {logical worker: [shard, size, mtime_ns]}}``, what a resumed
    loader is given back; ``shards`` gathers the shard counts webdataset cursors carry, with which
    a resumed stream passes the shards it consumed unopened; ``shard_list`` and ``heads``, what
    it checks the data against before it resumes)."""
    cursor = batch.get("data_cursor")
    if cursor is None:
        return
    worker, workers, position = cursor[:3]
    if known.get("num_workers") != workers:
        shards = known.get("shards")  # facts about files, valid with any number of workers
        known.clear()
        known.update(num_workers=workers, positions={})
        if shards is not None:
            known["shards"] = shards
    known["positions"][worker] = position
    if len(cursor) > 3:
        known.setdefault("shards", {}).update(cursor[3])
    if len(cursor) > 4:
        known["shard_list"] = cursor[4]["list"]
        known.setdefault("heads", {})[worker] = cursor[4]["head"]


def collate(samples: list[dict]) -> dict:
    """Batch sample dicts: tensors stacked on a new first axis, strings listed, ``skipped``
    summed, ``data_cursor`` the last sample's (a batch comes from one stream) with the shard
    counts of all."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key == "skipped":
            out[key] = sum(int(v) for v in values)
        elif key == "data_cursor":  # the last position, the shard counts of all
            out[key] = values[-1]
            if len(values[-1]) > 3:
                news = {}
                for v in values:
                    news.update(v[3])
                out[key] = (*values[-1][:3], news, *values[-1][4:])
        elif isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = values
    return out
