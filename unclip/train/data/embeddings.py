"""Precomputed CLIP embeddings as training data: ``.npy`` shards in the clip-retrieval layout
(``img_emb/img_emb_0.npy``, ``text_emb/…``, optional captions), streamed with exact resume like the
image sources of :mod:`unclip.train.data.sources`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from unclip.train.data.sources import BadSample, _EpochEnd, _rng, _Stream, check_caption

# --------------------------------------------------------------------------------------------------
# Precomputed embeddings (clip-retrieval layout)
# --------------------------------------------------------------------------------------------------
_SHARD_RE = {
    "img_emb": re.compile(r"^img_emb_(\d+)\.npy$"),
    "text_emb": re.compile(r"^text_emb_(\d+)\.npy$"),
    "metadata": re.compile(r"^metadata_(\d+)\.jsonl$"),
}


def embedding_shards(path) -> dict[str, dict[int, Path]]:
    """``{"img_emb"|"text_emb"|"metadata": {shard index: file}}`` found under ``path``."""
    root = Path(path)
    out = {}
    for sub, pattern in _SHARD_RE.items():
        folder = root / sub
        found = {}
        if folder.is_dir():
            for f in folder.iterdir():
                m = pattern.match(f.name)
                if m:
                    found[int(m.group(1))] = f
        out[sub] = found
    return out


def _count_lines(file: Path) -> int:
    data = file.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


class EmbeddingStream(_Stream):
    """CLIP image/text embedding pairs from the clip-retrieval layout written by ``unclip embed``.

    Layout: ``path/img_emb/img_emb_{i}.npy`` and ``path/text_emb/text_emb_{i}.npy`` (``[N_i, D]``,
    fp16 or fp32, memory-mapped) and ``path/metadata/metadata_{i}.jsonl`` — one JSON object per row
    with ``"key"`` and ``"caption"``. (clip-retrieval writes ``metadata_{i}.parquet``; reading
    parquet needs pyarrow, so this project writes and reads JSON lines instead.) On construction
    every shard is checked to line up: the same shard indices in all three folders, the same number
    of rows, the same ``D``, and ``stats.json`` (if present) agreeing on shard and row counts; a
    mismatch raises ``ValueError`` naming the shard. Epoch ``e`` visits shards in a permutation
    seeded by ``(seed, e)`` and each shard's rows in a permutation seeded by ``(seed, e, shard)``;
    consumer ``c`` of ``n`` takes every ``n``-th row of that order. Rows with a non-finite value or
    an empty caption are skipped and counted. ``split``: the keyword arguments of the data split
    (module doc).
    """

    what = "embedding row"

    def __init__(self, path, **split):
        super().__init__(**split)
        self.path = Path(path)
        found = embedding_shards(self.path)
        if not any(found.values()):
            raise ValueError(
                f"no embedding shards under {self.path}: expected img_emb/img_emb_0.npy, "
                f"text_emb/text_emb_0.npy and metadata/metadata_0.jsonl (write them with "
                f"`unclip embed`)"
            )
        indices = sorted(set().union(*(set(v) for v in found.values())))
        for i in indices:
            missing = [sub for sub in found if i not in found[sub]]
            if missing:
                raise ValueError(
                    f"{self.path}: shard {i} is missing from {', '.join(missing)} "
                    f"(present in the others); the shards do not line up"
                )
        self.shards = indices
        self.rows, self.embed_dim = [], None
        for i in indices:
            img = np.load(found["img_emb"][i], mmap_mode="r")
            txt = np.load(found["text_emb"][i], mmap_mode="r")
            n_meta = _count_lines(found["metadata"][i])
            if img.ndim != 2 or txt.ndim != 2:
                raise ValueError(
                    f"{self.path}: shard {i}: embeddings must be 2-D [N, D], got {img.shape} and "
                    f"{txt.shape}"
                )
            if not img.shape[0] == txt.shape[0] == n_meta:
                raise ValueError(
                    f"{self.path}: shard {i} does not line up: img_emb_{i} has {img.shape[0]} "
                    f"rows, text_emb_{i} {txt.shape[0]}, metadata_{i} {n_meta}"
                )
            dims = {img.shape[1], txt.shape[1]} | ({self.embed_dim} if self.embed_dim else set())
            if len(dims) != 1:
                raise ValueError(
                    f"{self.path}: shard {i}: embedding size mismatch (img {img.shape[1]}, "
                    f"text {txt.shape[1]}, earlier shards {self.embed_dim})"
                )
            self.embed_dim = img.shape[1]
            self.rows.append(img.shape[0])
        self.files = found
        stats = self.path / "stats.json"
        if stats.is_file():
            meta = json.loads(stats.read_text())
            shards, count = meta.get("num_shards", len(indices)), meta.get("count", sum(self.rows))
            if shards != len(indices) or count != sum(self.rows):
                raise ValueError(
                    f"{self.path}: stats.json records {meta.get('num_shards')} shards / "
                    f"{meta.get('count')} rows but {len(indices)} shards / {sum(self.rows)} rows "
                    f"were found (shards {indices}); a shard was deleted or added"
                )

    def __len__(self) -> int:
        return sum(self.rows)

    def describe(self) -> str:
        return f"embeddings {self.path} ({len(self.shards)} shards, {len(self)} rows)"

    def _raw(self, c: int, n: int) -> Iterator:
        if len(self) <= c:
            raise ValueError(f"{self.describe()} has fewer rows than consumers ({n})")
        epoch = 0
        while True:
            count = offset = 0
            for s in _rng(self.seed, 3, epoch).permutation(len(self.shards)):
                i, nrows = self.shards[s], self.rows[s]
                rows = _rng(self.seed, 4, epoch, i).permutation(nrows)[(c - offset) % n :: n]
                offset += nrows
                if len(rows) == 0:
                    continue
                img = np.load(self.files["img_emb"][i], mmap_mode="r")
                txt = np.load(self.files["text_emb"][i], mmap_mode="r")
                meta = [
                    json.loads(line)
                    for line in self.files["metadata"][i].read_text("utf-8").splitlines()
                ]
                finite = np.isfinite(img[rows]).all(1) & np.isfinite(txt[rows]).all(1)
                for r, ok in zip(rows.tolist(), finite.tolist()):
                    yield i, r, ok, img, txt, meta[r]
                count += len(rows)
            yield _EpochEnd(count)
            epoch += 1

    def _check(self, item):
        i, r, ok, img, txt, meta = item
        if not ok:
            raise BadSample(f"shard {i} row {r} ({meta.get('key')}): non-finite embedding")
        try:
            caption = check_caption(meta.get("caption"))
        except BadSample as exc:
            raise BadSample(f"shard {i} row {r} ({meta.get('key')}): {exc}") from None
        return img, txt, r, caption

    def _sample(self, value) -> dict:
        img, txt, r, caption = value
        return {
            "image_embed": torch.from_numpy(np.array(img[r], dtype=np.float32)),
            "text_embed": torch.from_numpy(np.array(txt[r], dtype=np.float32)),
            "caption": caption,
        }
