"""Image sources paired with their precomputed CLIP embeddings (``data.embeddings_path``).

``unclip embed --source webdataset`` writes one embedding shard per tar shard (tar shard ``i`` of
the expanded ``--data`` pattern ↔ ``img_emb_{i}.npy`` / ``text_emb_{i}.npy`` /
``metadata_{i}.jsonl``), one row per readable sample, in the tar's order, keyed by the sample's
``__key__``. ``--source folder`` writes the images (sorted by path) in consecutive shards keyed by
their path relative to the folder without the suffix. Training the decoder (or an upsampler) from
the same images with ``data.embeddings_path`` set streams the images exactly as
:class:`~unclip.train.data.sources.WebDatasetStream` /
:class:`~unclip.train.data.sources.FolderStream` do (same order, worker/rank split and exact resume)
and adds each sample's ``image_embed`` and ``text_embed`` (float32 ``[D]``) and ``key`` from its
embedding row, so the frozen CLIP does not run on the images during training.

The pairing is checked, and a mismatch raises ``ValueError`` naming the shard and the first
mismatched key:

* when the stream is built (before training starts): the embedding shards line up with each other
  (:class:`~unclip.train.data.sources.EmbeddingStream`'s checks), there is exactly one embedding
  shard per tar shard, and — for every local tar (its member headers are read, not its data) — the
  shard has no more rows than the tar has samples and its row keys are the tar's keys in the tar's
  order, apart from tar samples that ``unclip embed`` skipped as bad; for a folder, the row keys of
  all shards, in shard order, are image keys of the folder in sorted order. Rows are allowed to be
  missing only because their samples are bad, which is only known when they are decoded, hence:
* as samples stream: every readable sample (image and caption) must have a row with its key in *its*
  shard, and the row's caption must equal the sample's caption (img2dataset keys are sequence
  numbers, so equal keys alone do not prove the embeddings belong to these images).

A sample whose image or caption is bad is skipped and counted as usual; so is a sample whose
embedding row is non-finite. Tars behind ``pipe:`` or remote URLs cannot be listed cheaply; for them
only the shard count is checked up front and the keys as samples stream. The up-front check is
cached per process (keyed by the files' sizes and modification times), so DataLoader workers forked
after it do not repeat it.
"""

from __future__ import annotations

import json
import logging
import re
import tarfile
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from unclip.train.data.embeddings import EmbeddingStream
from unclip.train.data.sources import BadSample, FolderStream, WebDatasetStream, _Stream
from unclip.train.data.tars import local_file

__all__ = [
    "EmbeddingTable",
    "PairedWebDatasetStream",
    "PairedFolderStream",
    "tar_keys",
    "local_tar",
]

logger = logging.getLogger(__name__)

#: the name this module has exported for :func:`unclip.train.data.tars.local_file`
local_tar = local_file

_CHECKED: set = set()
_CACHED_SHARDS = 8
_META_RE = re.compile(r"__[^/]*__($|/)")
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext


def tar_keys(path) -> list[str]:
    """The sample keys of a tar in order, as webdataset groups them, reading member headers only."""
    keys: list[str] = []
    with tarfile.open(path, "r:*") as tar:
        for info in tar:
            name = info.name
            if not info.isreg() or _META_RE.match(name):
                continue
            if "/" not in name and name.startswith("__") and name.endswith("__"):
                continue
            m = _KEY_RE.match(name)
            if m and (not keys or keys[-1] != m.group(1)):
                keys.append(m.group(1))
    return keys


def _first_divergence(rows: Sequence[str], tar: Sequence[str], fallback: str) -> str:
    """Where the row keys first differ from the tar's keys, for error messages."""
    for j, (a, b) in enumerate(zip(rows, tar)):
        if a != b:
            return f"{a!r}: row {j} is {a!r} where the tar's sample {j} is {b!r}"
    return repr(fallback)


class EmbeddingTable:
    """Read side of an ``unclip embed`` folder for pairing: validated shards, per-shard key → row
    lookups."""

    def __init__(self, path):
        self.path = Path(path)
        # EmbeddingStream checks that img_emb / text_emb / metadata (and stats.json) line up
        emb = EmbeddingStream(self.path, seed=0, rank=0, world_size=1)
        self.shards, self.rows, self.files, self.embed_dim = (
            emb.shards,
            emb.rows,
            emb.files,
            emb.embed_dim,
        )
        self._loaded: OrderedDict = OrderedDict()

    def signature(self) -> tuple:
        out = []
        for sub in ("img_emb", "text_emb", "metadata"):
            for i in self.shards:
                st = self.files[sub][i].stat()
                out.append((str(self.files[sub][i]), st.st_size, st.st_mtime_ns))
        return tuple(out)

    def metadata(self, shard: int) -> list[dict]:
        return [
            json.loads(line)
            for line in self.files["metadata"][shard].read_text("utf-8").splitlines()
        ]

    def keys(self, shard: int) -> list[str]:
        """Row keys of ``shard``; ``ValueError`` if a key is missing or repeated."""
        keys, seen = [], set()
        for r, meta in enumerate(self.metadata(shard)):
            key = meta.get("key")
            if not isinstance(key, str):
                raise ValueError(
                    f"{self.path}: shard {shard}: metadata_{shard}.jsonl row {r} has no string "
                    f"'key' (got {key!r}); pairing images with embeddings needs the sample keys"
                )
            if key in seen:
                raise ValueError(
                    f"{self.path}: shard {shard}: key {key!r} appears twice in "
                    f"metadata_{shard}.jsonl"
                )
            seen.add(key)
            keys.append(key)
        return keys

    def shard(self, i: int) -> tuple[dict, list, np.ndarray, np.ndarray]:
        """``(key → row, captions, img_emb, text_emb)`` of shard ``i`` (memory-mapped, a few shards
        cached)."""
        if i in self._loaded:
            self._loaded.move_to_end(i)
            return self._loaded[i]
        meta = self.metadata(i)
        entry = (
            {m.get("key"): r for r, m in enumerate(meta)},
            [m.get("caption") for m in meta],
            np.load(self.files["img_emb"][i], mmap_mode="r"),
            np.load(self.files["text_emb"][i], mmap_mode="r"),
        )
        self._loaded[i] = entry
        while len(self._loaded) > _CACHED_SHARDS:
            self._loaded.popitem(last=False)
        return entry

    def row(self, shard: int, key: Optional[str], caption: str, where: str) -> dict:
        """The embedding entries of ``key`` in ``shard``; ``ValueError`` if missing or for another
        caption, ``BadSample`` if non-finite."""
        index, captions, img, txt = self.shard(shard)
        r = index.get(key)
        if r is None:
            raise ValueError(
                f"{where}: the image and embedding shards do not line up: sample key {key!r} has "
                f"no row in embedding shard {shard} ({self.files['metadata'][shard]}); first "
                f"mismatched key {key!r}. Re-run `unclip embed` on exactly these images (same "
                f"shard list/order, no --num) or fix data.path / data.embeddings_path"
            )
        if captions[r] != caption:
            raise ValueError(
                f"{where}: the image and embedding shards do not line up: embedding shard {shard} "
                f"row {r} (key {key!r}) was computed for the caption {captions[r]!r} but the "
                f"sample's caption is {caption!r}; first mismatched key {key!r}. The embeddings "
                "belong to other data; re-run `unclip embed`"
            )
        image_embed, text_embed = (
            np.asarray(img[r], dtype=np.float32),
            np.asarray(txt[r], dtype=np.float32),
        )
        if not (np.isfinite(image_embed).all() and np.isfinite(text_embed).all()):
            raise BadSample(f"{where}: non-finite embedding (shard {shard} row {r})")
        return {
            "image_embed": torch.from_numpy(image_embed.copy()),
            "text_embed": torch.from_numpy(text_embed.copy()),
            "key": key,
        }


def _once(signature: tuple, check) -> None:
    if signature not in _CHECKED:
        check()
        _CHECKED.add(signature)


class _Paired(_Stream):
    """What both paired streams add to their image stream: the embedding table's row of each
    sample."""

    table: EmbeddingTable

    def describe(self) -> str:
        return f"{super().describe()} paired with embeddings {self.table.path}"

    def _with_row(self, image, caption: str, shard: int, key: Optional[str], source) -> tuple:
        where = f"{self.table.path}: shard {shard} ({source})"
        return image, caption, self.table.row(shard, key, caption, where)

    def _sample(self, value) -> dict:
        image, caption, embeds = value
        return {**super()._sample((image, caption)), **embeds}


class PairedWebDatasetStream(_Paired, WebDatasetStream):
    """:class:`WebDatasetStream` samples plus ``image_embed``/``text_embed``/``key`` from the
    embedding shard of each sample's tar (module doc). Same arguments plus ``embeddings``: the
    ``unclip embed`` folder."""

    def __init__(self, urls, resolution: int, embeddings, **kw):
        super().__init__(urls, resolution, **kw)
        self.table = EmbeddingTable(embeddings)
        self.url_index: dict[str, int] = {}
        for i, u in enumerate(self.urls):
            self.url_index.setdefault(u, i)
        sig = (
            "webdataset",
            tuple(self.urls),
            self.table.signature(),
            tuple(
                (str(p), p.stat().st_size, p.stat().st_mtime_ns)
                for p in map(local_file, self.urls)
                if p
            ),
        )
        _once(sig, self._check_pairing)

    def _check_pairing(self) -> None:
        t, n = self.table, len(self.urls)
        if t.shards != list(range(n)):
            missing = [i for i in range(n) if i not in t.shards]
            extra = [i for i in t.shards if i >= n]
            first = (
                f"tar shard {missing[0]} ({self.urls[missing[0]]}) has no embedding shard "
                f"img_emb_{missing[0]}.npy"
                if missing
                else f"embedding shard {extra[0]} has no tar shard"
            )
            raise ValueError(
                f"data.embeddings_path {t.path} holds {len(t.shards)} embedding shard(s) but "
                f"data.path expands to {n} tar shard(s) ({self.urls[0]} …): the image and "
                f"embedding shards do not line up; {first}. Embed exactly the shards you train on "
                "(`unclip embed --source webdataset --data <data.path>`)"
            )
        for i, url in enumerate(self.urls):
            keys = t.keys(i)
            path = local_file(url)
            if path is None:
                continue  # pipe:/remote: keys are checked as samples stream
            try:
                tar = tar_keys(path)
            except (tarfile.TarError, OSError, EOFError) as exc:
                logger.warning(
                    "cannot list %s (%s: %s); its keys are checked as samples stream",
                    url,
                    type(exc).__name__,
                    exc,
                )
                continue
            where = f"{t.path}: shard {i} ({url})"
            if len(keys) > len(tar):
                in_tar = set(tar)
                stray = next((k for k in keys if k not in in_tar), keys[len(tar)])
                raise ValueError(
                    f"{where}: the image and embedding shards do not line up: embedding shard {i} "
                    f"has {len(keys)} rows but the tar holds {len(tar)} samples; first mismatched "
                    f"key {stray!r}"
                )
            pos = {k: j for j, k in enumerate(tar)}
            at = -1
            for r, key in enumerate(keys):
                j = pos.get(key)
                if j is None or j <= at:
                    why = "is not in the tar" if j is None else "is out of the tar's order"
                    raise ValueError(
                        f"{where}: the image and embedding shards do not line up: row {r} of "
                        f"metadata_{i}.jsonl has key {key!r}, which {why}; first mismatched key "
                        f"{_first_divergence(keys, tar, key)}"
                    )
                at = j

    def _check(self, raw: dict):
        image, caption = super()._check(raw)
        url, key = raw.get("__url__"), raw.get("__key__")
        shard = None if url is None else self.url_index.get(url)
        if shard is None:
            raise ValueError(
                f"{self.describe()}: sample {key!r} comes from {url!r}, which is not one of the "
                "shards"
            )
        return self._with_row(image, caption, shard, key, url)


class PairedFolderStream(_Paired, FolderStream):
    """:class:`FolderStream` samples plus ``image_embed``/``text_embed``/``key`` from the embedding
    row whose key is the image's path relative to the folder without its suffix (module doc)."""

    def __init__(self, path, resolution: int, embeddings, **kw):
        super().__init__(path, resolution, **kw)
        self.table = EmbeddingTable(embeddings)
        self._keys = {i: self.table.keys(i) for i in self.table.shards}
        self.key_shard = {k: i for i, keys in self._keys.items() for k in keys}
        firsts = sorted((keys[0], i) for i, keys in self._keys.items() if keys)
        self._first_keys, self._first_shards = [k for k, _ in firsts], [i for _, i in firsts]
        sig = ("folder", str(self.path), tuple(str(f) for f in self.files), self.table.signature())
        _once(sig, self._check_pairing)

    def key_of(self, file: Path) -> str:
        return file.relative_to(self.path).with_suffix("").as_posix()

    def _check_pairing(self) -> None:
        folder = [self.key_of(f) for f in self.files]
        pos: dict[str, int] = {}
        for index, k in enumerate(folder):
            pos.setdefault(k, index)
        at = -1
        seen: dict[str, int] = {}
        for i in self.table.shards:
            for r, key in enumerate(self._keys[i]):
                where = f"{self.table.path}: shard {i}"
                if key in seen:
                    raise ValueError(
                        f"{where}: key {key!r} also appears in shard {seen[key]}; first mismatched "
                        f"key {key!r}"
                    )
                seen[key] = i
                j = pos.get(key)
                if j is None or j <= at:
                    why = (
                        f"is not an image in {self.path}"
                        if j is None
                        else "is out of the folder's sorted order"
                    )
                    raise ValueError(
                        f"{where}: the image folder and the embedding shards do not line up: row "
                        f"{r} of metadata_{i}.jsonl has key {key!r}, which {why}; first mismatched "
                        f"key {key!r}"
                    )
                at = j

    def _check(self, file: Path):
        image, caption = super()._check(file)
        key = self.key_of(file)
        shard = self.key_shard.get(key)
        if shard is None:  # name the shard whose key range should have held it
            k = bisect_right(self._first_keys, key) - 1
            shard = self._first_shards[max(k, 0)] if self._first_shards else self.table.shards[0]
        return self._with_row(image, caption, shard, key, file)


def paired_stream(data, resolution: int, **kw):
    """The paired stream for ``data`` (a :class:`~unclip.train.config.DataConfig` with
    ``embeddings_path``)."""
    if data.source in ("webdataset", "folder") and not data.path:
        raise ValueError(
            f"data.source={data.source!r} needs data.path (the images data.embeddings_path was "
            "computed from)"
        )
    if data.source == "webdataset":
        return PairedWebDatasetStream(
            data.path, resolution, data.embeddings_path, shuffle_buffer=data.shuffle_buffer, **kw
        )
    if data.source == "folder":
        return PairedFolderStream(data.path, resolution, data.embeddings_path, **kw)
    raise ValueError(
        f"data.embeddings_path pairs image sources with their embeddings; it needs data.source "
        f"webdataset or folder, not {data.source!r} (use data.source=embeddings with "
        f"data.path=<embeddings folder> to train the prior on embeddings alone)"
    )
