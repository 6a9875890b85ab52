"""``unclip embed``: precompute CLIP image and text embeddings in the clip-retrieval layout, plus
statistics.

Writes, under ``--out``::

    img_emb/img_emb_{i}.npy       [N_i, D] unit-norm image embeddings (float16 by default, or
                                  float32)
    text_emb/text_emb_{i}.npy     [N_i, D] unit-norm text embeddings
    metadata/metadata_{i}.jsonl   one {"key", "caption"} JSON object per row (clip-retrieval writes
                                  parquet, which needs pyarrow; JSON lines need nothing)
    stats.npz / stats.json        per-dimension mean and std (population, ddof=0) of the image and
                                  text embeddings over all written rows, as stored (after the
                                  dtype cast), plus row, shard and skipped counts

Work is cut into *chunks*, one output shard each: ``--shard-size`` consecutive items of a folder
(sorted by path) or of the shapes world, or one input tar shard of a webdataset. Process ``p`` of
``P`` (run with ``torchrun``/``accelerate launch``; Accelerate sets up the process group) embeds
chunks ``p, p+P, …`` and names each shard by its global chunk index, so the output does not depend
on ``P``. The statistics are combined exactly: each process sums its rows and squared rows in
float64 and the sums are reduced across processes. Bad samples (unreadable image, missing/empty
caption) are skipped, counted and reported. Every file is written under a temporary name and
renamed.

Example::

    unclip embed --source webdataset --data "shards/{00000..00099}.tar" --clip-config pipe/ \
        --out emb/
    torchrun --nproc_per_node 8 -m unclip.cli.embed --source folder --data images/ \
        --clip-config prior.yaml --out emb/

The library call is :func:`embed` with an :class:`EmbedJob`; :func:`load_stats` reads the
statistics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import yaml

from unclip.nets.clip import CLIP, ClipConfig
from unclip.train.data.embeddings import embedding_shards
from unclip.train.data.sources import TAR_IMAGE_KEYS, BadSample, check_caption, open_rgb
from unclip.train.data.tars import expand_urls, iter_tar_samples, shard_error
from unclip.utils.config import from_dict
from unclip.utils.images import list_images

__all__ = ["EmbedJob", "embed", "load_clip", "load_stats", "STATS_FILE"]

#: the statistics file ``unclip embed`` writes beside the shards (read with :func:`load_stats`)
STATS_FILE = "stats.npz"

logger = logging.getLogger(__name__)
_MAX_LOGGED = 5


def load_clip(spec: str) -> CLIP:
    """A :class:`CLIP` from a pipeline folder (``clip/`` inside), a CLIP folder, or a YAML
    file.

    The YAML is a stage config (its ``clip:`` section is used) or a file holding only a ``clip:``
    section. A CLIP without pretrained weights is initialised from seed 0 so that every process gets
    the same one.
    """
    path = Path(spec)
    if path.is_dir():
        for folder in (path / "clip", path):
            if (folder / "config.json").is_file():
                return CLIP.from_pretrained(folder)
        raise ValueError(
            f"--clip-config {spec}: folder has neither clip/config.json (a pipeline) nor "
            "config.json (a CLIP folder written by CLIP.save_pretrained)"
        )
    if not path.is_file():
        raise ValueError(
            f"--clip-config {spec}: no such file or folder; pass a pipeline folder, a CLIP folder "
            "or a YAML config with a 'clip:' section"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"--clip-config {spec}: not a valid YAML file ({first})") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"--clip-config {spec}: expected a YAML mapping with a 'clip:' section, got "
            f"{type(data).__name__}"
        )
    if set(data) == {"clip"}:
        cfg = from_dict(ClipConfig, data["clip"], source=str(path), prefix="clip")
    else:
        from unclip.train.config import load_stage_config

        cfg = load_stage_config(path).clip
    if not cfg.pretrained:
        warnings.warn(
            f"{spec}: clip.pretrained is not set; using randomly initialised CLIP weights "
            "(seed 0), which is only useful for tests",
            stacklevel=2,
        )
        torch.manual_seed(0)
    return CLIP.from_config(cfg)


def load_stats(path) -> dict[str, np.ndarray]:
    """The statistics written by ``unclip embed`` (``path``: its output folder or the file itself):
    ``image_mean``, ``image_std``, ``text_mean``, ``text_std`` ``[D]`` and ``count``."""
    file = Path(path) / STATS_FILE if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no embedding statistics at {file}; run `unclip embed` first")
    with np.load(file, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@dataclass
class EmbedJob:
    """What ``unclip embed`` embeds and where (the command-line options, one field each).

    ``source``: ``folder``, ``webdataset`` or ``shapes``; ``data``: the image folder or tar shards
    (path, brace pattern, ``::`` list, ``pipe:`` URL); ``clip_config``: a pipeline folder (with
    ``clip/``), a CLIP folder or a YAML with a ``clip:`` section; ``out``: the output folder.
    ``shard_size``: rows per output shard for folder/shapes (webdataset: one output shard per tar
    shard); ``num``: embed only the first N items (folder/shapes); ``dtype``: of the ``.npy``
    shards; ``resolution``, ``shapes_seed``, ``shapes_split``: the shapes world; ``overwrite``:
    delete existing shards in ``out`` first.
    """

    source: Literal["folder", "webdataset", "shapes"]
    clip_config: str
    out: str
    data: Optional[str] = None
    batch_size: int = 64
    shard_size: int = 10000
    num: Optional[int] = None
    dtype: Literal["float16", "float32"] = "float16"
    resolution: int = 64
    shapes_seed: int = 0
    shapes_split: Literal["train", "heldout", "all"] = "train"
    overwrite: bool = False
    progress: bool = True


# --------------------------------------------------------------------------------------------------
# Chunks: (key, image | None, caption | None, reason) per item; reason: None, a bad sample's
# message, or (message, samples lost) for a broken shard
# --------------------------------------------------------------------------------------------------
def _chunks(job: EmbedJob) -> tuple[int, Callable[[int], Iterator], Optional[int]]:
    """``(num_chunks, items(chunk) -> iterator, total items or None)``."""
    size = job.shard_size
    if job.source == "shapes":
        from unclip.shapes.world import ShapesWorld

        if job.num is None:
            raise ValueError(
                "--source shapes needs --num N (how many samples of the shapes world to embed)"
            )
        world = ShapesWorld(job.resolution, seed=job.shapes_seed, split=job.shapes_split)

        def items(chunk):
            for index in range(chunk * size, min((chunk + 1) * size, job.num)):
                s = world[index]
                yield f"{index:08d}", s.image, s.caption, None

        return math.ceil(job.num / size), items, job.num
    if not job.data:
        raise ValueError(f"--source {job.source} needs --data")
    if job.source == "folder":
        root = Path(job.data)
        files = list_images(root)[: job.num]

        def items(chunk):
            for f in files[chunk * size : (chunk + 1) * size]:
                key = f.relative_to(root).with_suffix("").as_posix()
                txt = f.with_suffix(".txt")
                try:
                    caption = check_caption(txt.read_bytes() if txt.is_file() else None)
                    yield key, open_rgb(f), caption, None
                except BadSample as exc:
                    yield key, None, None, f"{f}: {exc}"

        return math.ceil(len(files) / size), items, len(files)
    if job.source == "webdataset":
        if job.num is not None:
            raise ValueError(
                "--num is not supported with --source webdataset (shard sizes are unknown until "
                "read); select shards with a brace pattern instead, e.g. 'data/{00000..00009}.tar'"
            )
        urls = expand_urls(job.data)

        def items(chunk):
            for raw in iter_tar_samples([urls[chunk]]):
                broken = shard_error(raw)
                if broken is not None:
                    logger.warning("unclip embed: %s", broken)
                    yield None, None, None, (broken, max(1, raw.get("__lost__") or 0))
                    continue
                key = raw.get("__key__")
                ext = next((k for k in TAR_IMAGE_KEYS if k in raw), None)
                try:
                    if ext is None:
                        raise BadSample("no image member")
                    caption = check_caption(raw.get("txt"))
                    yield key, open_rgb(raw[ext]), caption, None
                except BadSample as exc:
                    yield key, None, None, f"{urls[chunk]}:{key}: {exc}"

        return len(urls), items, None
    raise ValueError(f"unknown --source {job.source!r}; choose folder, webdataset or shapes")


def _save_npy(file: Path, array: np.ndarray) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, file)


def _save_text(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, file)


class _Sums:
    """float64 per-dimension sums and sums of squares of image and text embeddings."""

    def __init__(self, dim: int):
        self.t = torch.zeros(4, dim, dtype=torch.float64)
        self.count = 0

    def add(self, img: np.ndarray, txt: np.ndarray) -> None:
        for j, part in enumerate((img, txt)):
            a = torch.from_numpy(part.astype(np.float64))
            self.t[2 * j] += a.sum(0)
            self.t[2 * j + 1] += (a * a).sum(0)
        self.count += len(img)


def _embed_chunk(
    clip, items: Iterator, out: Path, chunk: int, dtype, batch_size: int, sums: _Sums, bar, log_bad
) -> tuple[int, int]:
    """Embed one chunk into shard ``chunk``; returns ``(rows written, bad samples skipped)``."""
    img_parts: list[np.ndarray] = []
    txt_parts: list[np.ndarray] = []
    meta: list = []
    batch: list = []
    skipped = 0

    def flush():
        if batch:
            images = [b[1] for b in batch]
            captions = [b[2] for b in batch]
            img_parts.append(clip.encode_image(images).cpu().numpy().astype(dtype))
            txt_parts.append(clip.encode_text(captions).text_embed.cpu().numpy().astype(dtype))
            meta.extend({"key": b[0], "caption": b[2]} for b in batch)
            bar.update(len(batch))
            batch.clear()

    for key, image, caption, reason in items:
        if isinstance(reason, tuple):  # a broken shard (already logged): (reason, samples lost)
            skipped += reason[1]
            continue
        if reason is not None:
            skipped += 1
            log_bad(reason)
            bar.update(1)
            continue
        batch.append((key, image, caption))
        if len(batch) == batch_size:
            flush()
    flush()
    d = clip.embed_dim
    img = np.concatenate(img_parts) if img_parts else np.zeros((0, d), dtype)
    txt = np.concatenate(txt_parts) if txt_parts else np.zeros((0, d), dtype)
    sums.add(img, txt)
    _save_text(
        out / "metadata" / f"metadata_{chunk}.jsonl", "".join(json.dumps(m) + "\n" for m in meta)
    )
    _save_npy(out / "text_emb" / f"text_emb_{chunk}.npy", txt)
    _save_npy(out / "img_emb" / f"img_emb_{chunk}.npy", img)
    return len(img), skipped


def _check_job(job: EmbedJob) -> None:
    """One-line errors for bad options, before any model is loaded."""
    from unclip.utils.files import check_output_folder

    if job.source not in ("folder", "webdataset", "shapes"):
        raise ValueError(f"unknown --source {job.source!r}; choose folder, webdataset or shapes")
    if job.dtype not in ("float16", "float32"):
        raise ValueError(f"--dtype must be float16 or float32, got {job.dtype!r}")
    for name in ("batch_size", "shard_size"):
        if getattr(job, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(job, name)}")
    if job.num is not None and job.num < 1:
        raise ValueError(f"--num must be >= 1, got {job.num}")
    if job.source != "shapes" and not job.data:
        raise ValueError(f"--source {job.source} needs --data")
    if job.source == "webdataset" and job.data:  # (it has data: checked just above)
        for url in expand_urls(job.data):
            local = "://" not in url and not url.startswith("pipe:")
            if local and not Path(url).is_file():
                raise FileNotFoundError(
                    f"--data: tar shard {url} not found; pass existing shards (path, brace pattern "
                    "such as 'shards/{00000..00009}.tar', '::' list or pipe: URL)"
                )
    if not Path(job.clip_config).exists():
        raise FileNotFoundError(
            f"--clip-config {job.clip_config}: no such file or folder; pass a pipeline folder, a "
            "CLIP folder or a YAML config with a 'clip:' section"
        )
    check_output_folder(job.out, option="--out")


def embed(job: EmbedJob) -> int:
    """Run ``unclip embed`` (see module doc) in this process (one of several under
    ``torchrun``/``accelerate launch``); returns 0."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    _check_job(job)
    out = Path(job.out)
    existing = [f for files in embedding_shards(out).values() for f in files.values()]
    if existing and not job.overwrite:
        raise ValueError(
            f"{out} already holds {len(existing)} embedding shard files; pass --overwrite to "
            "replace them or choose another --out"
        )
    num_chunks, items, total = _chunks(job)
    clip = load_clip(job.clip_config)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    acc = Accelerator(cpu=not torch.cuda.is_available())
    clip = clip.to(acc.device)
    acc.wait_for_everyone()
    if acc.is_main_process:
        for f in existing + [out / STATS_FILE, out / "stats.json"]:
            f.unlink(missing_ok=True)
        for sub in ("img_emb", "text_emb", "metadata"):
            (out / sub).mkdir(parents=True, exist_ok=True)
    acc.wait_for_everyone()

    dtype = np.float16 if job.dtype == "float16" else np.float32
    sums = _Sums(clip.embed_dim)
    mine = range(acc.process_index, num_chunks, acc.num_processes)
    logged = [0]

    def log_bad(reason: str) -> None:
        if logged[0] < _MAX_LOGGED:
            logger.warning("unclip embed: skipping bad sample: %s", reason)
        logged[0] += 1

    my_total = (
        None
        if total is None
        else sum(min(job.shard_size, total - c * job.shard_size) for c in mine)
    )
    bar = tqdm(
        total=my_total,
        desc=f"embed [{acc.process_index}]",
        unit="img",
        disable=not job.progress or not acc.is_local_main_process,
    )
    skipped = 0
    for chunk in mine:
        _, bad = _embed_chunk(
            clip, items(chunk), out, chunk, dtype, job.batch_size, sums, bar, log_bad
        )
        skipped += bad
    bar.close()

    acc.wait_for_everyone()
    totals = acc.reduce(sums.t.to(acc.device), reduction="sum").cpu()
    counts = acc.reduce(
        torch.tensor([sums.count, skipped], dtype=torch.float64, device=acc.device), reduction="sum"
    ).cpu()
    count, skipped_all = int(counts[0]), int(counts[1])
    if acc.is_main_process:
        if count == 0:
            raise ValueError(
                f"no usable samples in {job.data or 'shapes'} ({skipped_all} skipped); nothing to "
                "embed"
            )
        mean = totals[0::2] / count
        std = (totals[1::2] / count - mean * mean).clamp_min(0).sqrt()
        stats = {
            "image_mean": mean[0].numpy(),
            "image_std": std[0].numpy(),
            "text_mean": mean[1].numpy(),
            "text_std": std[1].numpy(),
            "count": np.int64(count),
        }
        tmp = out / (STATS_FILE + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **stats)
        os.replace(tmp, out / STATS_FILE)
        meta = {
            "count": count,
            "skipped": skipped_all,
            "num_shards": num_chunks,
            "embed_dim": clip.embed_dim,
            "dtype": job.dtype,
            "source": job.source,
            "data": job.data,
            "clip_model": clip.model_name,
            "num_processes": acc.num_processes,
            **{k: v.tolist() for k, v in stats.items() if k != "count"},
        }
        _save_text(out / "stats.json", json.dumps(meta, indent=1))
        print(
            f"unclip embed: wrote {count} embeddings in {num_chunks} shards to {out} "
            f"(skipped {skipped_all} bad samples)"
        )
    acc.wait_for_everyone()
    return 0
