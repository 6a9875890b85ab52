"""Caption encodings of the frozen CLIP kept between training steps (``train.text_cache_mb``).

The prior conditions on the CLIP's encoding of each caption (pooled embedding and token states).
The CLIP is frozen while the prior trains, so a caption seen again — repeated captions, a second
epoch, the shapes world's finite vocabulary — would be encoded to the same numbers again; on the
shapes prior the encoding is about a fifth of a training step (benchmarks/README.md).

The cache is exact. Captions it does not hold are encoded in batches of one fixed size (the
micro-batch size), padded with the empty caption: within a batch of fixed shape a row's encoding
does not depend on what the other rows hold, but it changes in the last bits with the batch's
size (the blocked matrix products round differently). So a cached encoding is the same numbers a
fresh one would be, a full micro-batch gets the encoding it would get without the cache, and a
resumed run, which starts with an empty cache, continues bit for bit.

Least recently used captions are dropped beyond ``max_mb`` megabytes of stored encodings.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from unclip.clip import CLIP, TextEncoding

__all__ = ["TextEncodingCache"]

Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TextEncodingCache:
    """``encode_text`` of a frozen ``clip`` with the encodings of seen captions kept (see module
    doc); ``encode_image`` is the CLIP's. ``chunk``: the batch size misses are encoded in (the
    micro-batch size); ``max_mb``: megabytes of encodings kept (0: no cache, every call encodes).
    ``served`` / ``encoded`` count captions returned and captions the CLIP encoded."""

    def __init__(self, clip: CLIP, chunk: int, max_mb: float):
        if chunk < 1:
            raise ValueError(f"TextEncodingCache: chunk must be >= 1, got {chunk}")
        if max_mb < 0:
            raise ValueError(f"TextEncodingCache: max_mb must be >= 0, got {max_mb}")
        self.clip, self.chunk = clip, chunk
        self.max_bytes = int(max_mb * 2**20)
        self.rows: OrderedDict[str, Row] = OrderedDict()
        self.bytes = 0
        self.served = 0
        self.encoded = 0

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.clip.encode_image(images)

    def encode_text(self, captions: Sequence[str]) -> TextEncoding:
        captions = list(captions)
        self.served += len(captions)
        if self.max_bytes == 0:
            self.encoded += len(captions)
            return self.clip.encode_text(captions)
        found: dict[str, Row] = {}
        for caption in captions:
            row = self.rows.get(caption)
            if row is not None:
                self.rows.move_to_end(caption)
                found[caption] = row
        todo = list(dict.fromkeys(c for c in captions if c not in found))
        for start in range(0, len(todo), self.chunk):
            part = todo[start : start + self.chunk]
            enc = self.clip.encode_text(part + [""] * (self.chunk - len(part)))
            self.encoded += len(part)
            for i, caption in enumerate(part):
                # copies, so that a kept row does not hold its whole batch in memory
                row = (
                    enc.text_embed[i].clone(),
                    enc.text_tokens[i].clone(),
                    enc.text_mask[i].clone(),
                )
                found[caption] = row
                self._keep(caption, row)
        return TextEncoding(*(torch.stack([found[c][k] for c in captions]) for k in range(3)))

    def _keep(self, caption: str, row: Row) -> None:
        size = sum(t.numel() * t.element_size() for t in row)
        if size > self.max_bytes:
            return
        self.rows[caption] = row
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.rows.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)

    def __len__(self) -> int:
        return len(self.rows)
