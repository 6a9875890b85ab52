"""The sample stream shared by every training data source (:mod:`unclip.train.data.sources`): the
split across ranks and DataLoader workers, exact resume, bad-sample skipping, image decoding, and
the DataLoader integration (:class:`StreamDataset`, :func:`collate`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from PIL import Image

from unclip.utils.images import resize_crop_tensor

__all__ = [
    "BadSample",
    "StreamDataset",
    "collate",
    "check_caption",
    "image_to_tensor",
    "open_rgb",
]

logger = logging.getLogger(__name__)

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
    ):
        _check_split(seed, rank, world_size, start)
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
        for item in self._raw(c, n):
            if isinstance(item, _EpochEnd):
                if item == 0:
                    raise ValueError(
                        f"{self.describe()}: consumer {c} of {n} (rank {self.rank}) got no "
                        f"samples in a whole epoch"
                    )
                epoch_len = int(item)
                continue
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
            if consumed >= self.start:
                sample = self._sample(value)
                sample["skipped"] = skipped
                yield sample
            skipped = 0
            consumed += 1

    # subclasses define: describe() -> str, _raw(c, n) -> items and _EpochEnd markers,
    # _check(item) -> value (or raise BadSample), _sample(value) -> dict without 'skipped'

    def _sample(self, value) -> dict:  # image sources: value = (PIL image, caption)
        image, caption = value
        sample = {"image": image_to_tensor(image, self.resolution), "caption": caption}
        if self.clip_resolution is not None:
            # cut from the decoded original, not from the (smaller) training image
            sample["clip_image"] = image_to_tensor(image, self.clip_resolution)
        return sample


# --------------------------------------------------------------------------------------------------
# DataLoader integration
# --------------------------------------------------------------------------------------------------
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
    """

    def __init__(self, factory: Callable[..., object], *, start: int = 0, batch_size: int = 1):
        super().__init__()
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
        return iter(self.factory(start=start, worker=logical, num_workers=num_workers))


def collate(samples: list[dict]) -> dict:
    """Batch sample dicts: tensors stacked on a new first axis, strings listed, ``skipped``
    summed."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key == "skipped":
            out[key] = sum(int(v) for v in values)
        elif isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = values
    return out
