"""Sample streams for training: the shapes world on the fly, plus dispatch to the file-based
sources.

A stream is an iterable of sample dicts, deterministic for ``(seed, rank, world_size)`` and
resumable: built with ``start`` = samples this rank already consumed, it yields exactly what would
have followed. Image samples:
``{"image": float [3, R, R] in [-1, 1], "caption": str, "skipped": int}``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Optional

import torch

from unclip.train.config import DataConfig
from unclip.train.data.batching import collate
from unclip.utils.images import pil_to_tensor

__all__ = ["ShapesStream", "make_stream", "make_batches", "batches", "collate"]


class ShapesStream:
    """The shapes world rendered on the fly; rank ``r`` of ``w`` takes indices ``r, r+w, r+2w,
    …``."""

    def __init__(
        self,
        resolution: int,
        *,
        seed: int = 0,
        split: str = "train",
        two_object_prob: float = 0.3,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        worker: int = 0,
        num_workers: int = 1,
        clip_resolution: Optional[int] = None,
    ):
        from unclip.shapes.world import ShapesWorld

        self.world = ShapesWorld(
            resolution=resolution, seed=seed, split=split, two_object_prob=two_object_prob
        )
        # a scene is a function of (seed, split, index): the same scene drawn at the CLIP's size
        self.clip_world = (
            None
            if clip_resolution is None
            else ShapesWorld(
                resolution=clip_resolution, seed=seed, split=split, two_object_prob=two_object_prob
            )
        )
        # DataLoader worker w of rank r is consumer r + w·world_size of world_size·num_workers
        self.consumer = rank + worker * world_size
        self.consumers = world_size * max(1, num_workers)
        self.start = start

    def __iter__(self) -> Iterator[dict]:
        i = self.start
        while True:
            index = self.consumer + i * self.consumers
            sample = self.world[index]
            out = {"image": pil_to_tensor(sample.image), "caption": sample.caption, "skipped": 0}
            if self.clip_world is not None:
                out["clip_image"] = pil_to_tensor(self.clip_world[index].image)
            yield out
            i += 1


def make_stream(
    data: DataConfig,
    *,
    resolution: int,
    seed: int,
    rank: int,
    world_size: int,
    start: int = 0,
    clip_resolution: Optional[int] = None,
    **worker,
) -> Iterable[dict]:
    """The stream described by ``data`` for this rank (and DataLoader ``worker``/``num_workers`` if
    given), starting after ``start`` consumed samples. ``clip_resolution``: image samples also carry
    ``clip_image``, the original image at that size (:mod:`unclip.train.data.sources`); ignored
    with ``data.embeddings_path``, whose precomputed embeddings replace it. ``worker`` may also hold
    ``cursor``: the file sources resume there without decoding what came before (the shapes world
    draws any sample directly and needs none), ``shard_counts``: the webdataset shards' sample
    counts the run recorded, with which it passes the shards before its cursor unopened, and
    ``shard_list``/``head``: the shard list and the shard in progress the cursor was taken on,
    which the stream checks before it resumes."""
    cursor = worker.pop("cursor", None)
    recorded = {k: worker.pop(k, None) for k in ("shard_counts", "shard_list", "head")}
    split = dict(rank=rank, world_size=world_size, start=start, **worker)
    if cursor is not None and data.source != "shapes":
        split["cursor"] = cursor
        if data.source == "webdataset":
            split.update((k, v) for k, v in recorded.items() if v)
    if data.embeddings_path:  # images paired with their precomputed CLIP embeddings
        from unclip.train.data.paired import paired_stream

        return paired_stream(data, resolution, seed=seed, **split)
    if data.source == "shapes":
        return ShapesStream(
            data.shapes_resolution or resolution,
            seed=data.shapes_seed,
            split=data.shapes_split,
            two_object_prob=data.shapes_two_object_prob,
            clip_resolution=clip_resolution,
            **split,
        )
    if not data.path:
        raise ValueError(
            f"data.source={data.source!r} needs data.path (a folder, shard pattern or embeddings "
            "dir)"
        )
    from unclip.train.data import sources

    if data.source == "folder":
        return sources.FolderStream(
            data.path, resolution, seed=seed, clip_resolution=clip_resolution, **split
        )
    if data.source == "webdataset":
        return sources.WebDatasetStream(
            data.path,
            resolution,
            seed=seed,
            shuffle_buffer=data.shuffle_buffer,
            clip_resolution=clip_resolution,
            **split,
        )
    if data.source == "embeddings":
        return sources.EmbeddingStream(data.path, seed=seed, **split)
    raise ValueError(f"unknown data.source {data.source!r}")


def make_batches(
    data: DataConfig,
    *,
    resolution: int,
    seed: int,
    rank: int,
    world_size: int,
    start: int = 0,
    clip_resolution: Optional[int] = None,
    cursors: Optional[dict] = None,
) -> Iterable[dict]:
    """Batches of ``data.batch_size`` for this rank, resumable at ``start`` samples; uses a
    DataLoader with ``data.num_workers`` worker processes when > 0 (exact resume either way, see
    ``StreamDataset``). ``clip_resolution``: as in :func:`make_stream`. ``cursors``: where each
    worker's stream stood (``TrainLoop.data_cursors``, saved in checkpoints): the streams skip to
    it without decoding the samples before. Data that is not what the cursors were taken on (the
    number of workers, the shard list, a shard in progress changed) is refused here, in this
    process, in one line (:func:`~unclip.train.data.resume.check_resume`)."""
    positions, shards, heads, shard_list = {}, None, {}, None
    if cursors and data.source != "shapes":
        from unclip.train.data.resume import check_resume

        check_resume(data, cursors)
        positions = {int(k): int(v) for k, v in cursors.get("positions", {}).items()}
        shards = cursors.get("shards")
        heads = {int(k): v for k, v in cursors.get("heads", {}).items()}
        shard_list = cursors.get("shard_list")
    # this rank's stream from a start position (and a DataLoader worker's share of it)
    stream_from = functools.partial(
        make_stream,
        data,
        resolution=resolution,
        seed=seed,
        rank=rank,
        world_size=world_size,
        clip_resolution=clip_resolution,
        **({"shard_counts": shards} if shards else {}),
        **({"shard_list": shard_list} if shard_list else {}),
    )
    if data.num_workers <= 0:
        at = {"cursor": positions[0]} if 0 in positions else {}
        if at and 0 in heads:
            at["head"] = heads[0]
        return batches(stream_from(start=start, **at), data.batch_size)

    from unclip.train.data.batching import StreamDataset

    if (
        data.embeddings_path
    ):  # check the pairing now, before the workers start (they reuse the cached check)
        stream_from()
    ds = StreamDataset(
        stream_from, start=start, batch_size=data.batch_size, cursors=positions, heads=heads
    )
    return torch.utils.data.DataLoader(
        ds,
        batch_size=data.batch_size,
        num_workers=data.num_workers,
        collate_fn=collate,
        persistent_workers=False,
    )


def batches(stream: Iterable[dict], batch_size: int) -> Iterator[dict]:
    """Group samples into batches: tensors stacked, captions listed, ``skipped`` summed."""
    buf: list[dict] = []
    for sample in stream:
        buf.append(sample)
        if len(buf) == batch_size:
            yield collate(buf)
            buf = []
