"""Sample streams for training: the shapes world on the fly, plus dispatch to the file-based sources.

A stream is an iterable of sample dicts, deterministic for ``(seed, rank, world_size)`` and resumable:
built with ``start`` = samples this rank already consumed, it yields exactly what would have followed.
Image samples: ``{"image": float [3, R, R] in [-1, 1], "caption": str, "skipped": int}``.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from ..config import DataConfig

__all__ = ["ShapesStream", "make_stream", "batches", "pil_to_tensor"]


def pil_to_tensor(image) -> torch.Tensor:
    """PIL RGB image → float tensor ``[3, H, W]`` in [-1, 1]."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class ShapesStream:
    """The shapes world rendered on the fly; rank ``r`` of ``w`` takes indices ``r, r+w, r+2w, …``."""

    def __init__(self, resolution: int, *, seed: int = 0, split: str = "train", two_object_prob: float = 0.3,
                 rank: int = 0, world_size: int = 1, start: int = 0):
        from .shapes import ShapesWorld

        self.world = ShapesWorld(resolution=resolution, seed=seed, split=split, two_object_prob=two_object_prob)
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self) -> Iterator[dict]:
        i = self.start
        while True:
            sample = self.world[self.rank + i * self.world_size]
            yield {"image": pil_to_tensor(sample.image), "caption": sample.caption, "skipped": 0}
            i += 1


def make_stream(data: DataConfig, *, resolution: int, seed: int, rank: int, world_size: int,
                start: int = 0) -> Iterable[dict]:
    """The stream described by ``data`` for this rank, starting after ``start`` consumed samples."""
    if data.source == "shapes":
        return ShapesStream(data.shapes_resolution or resolution, seed=data.shapes_seed, split=data.shapes_split,
                            two_object_prob=data.shapes_two_object_prob, rank=rank, world_size=world_size,
                            start=start)
    if not data.path:
        raise ValueError(f"data.source={data.source!r} needs data.path (a folder, shard pattern or embeddings dir)")
    from . import sources

    if data.source == "folder":
        return sources.FolderStream(data.path, resolution, seed=seed, rank=rank, world_size=world_size, start=start)
    if data.source == "webdataset":
        return sources.WebDatasetStream(data.path, resolution, seed=seed, rank=rank, world_size=world_size,
                                        start=start, shuffle_buffer=data.shuffle_buffer)
    if data.source == "embeddings":
        return sources.EmbeddingStream(data.path, seed=seed, rank=rank, world_size=world_size, start=start)
    raise ValueError(f"unknown data.source {data.source!r}")


def batches(stream: Iterable[dict], batch_size: int) -> Iterator[dict]:
    """Group samples into batches: tensors stacked, captions listed, ``skipped`` summed."""
    buf: list[dict] = []
    for sample in stream:
        buf.append(sample)
        if len(buf) == batch_size:
            yield collate(buf)
            buf = []


def collate(samples: list[dict]) -> dict:
    out = {}
    for key in samples[0]:
        vals = [s[key] for s in samples]
        if key == "skipped":
            out[key] = sum(int(v) for v in vals)
        elif isinstance(vals[0], torch.Tensor):
            out[key] = torch.stack(vals)
        else:
            out[key] = vals
    return out
