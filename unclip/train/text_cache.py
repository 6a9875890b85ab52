"""Caption encodings of the frozen CLIP kept between training steps (``train.text_cache_mb``).

The prior conditions on the CLIP's encoding of each caption (pooled embedding and token states).
The CLIP is frozen while the prior trains, so a caption seen again — repeated captions, a second
epoch, the shapes world's finite vocabulary — would be encoded to the same numbers again; in the
mid-size prior of ``benchmarks/bench_peers.py`` the encoding was 18 % of a training step.

The cache is exact. Captions it does not hold are encoded in batches of one fixed size (the
micro-batch size), padded with the empty caption: within a batch of fixed shape a row's encoding
does not depend on what the other rows hold, but it changes in the last bits with the batch's
size (the blocked matrix products round differently). So a cached encoding is the same numbers a
fresh one would be, a full micro-batch gets the encoding it would get without the cache, and a
resumed run, which starts with an empty cache, continues bit for bit. The first encoding checks
that premise on the device at hand (the same captions in reverse order must give the same rows);
where it does not hold — a GEMM kernel that rounds by tile position, an attention mask dropped for
batches without padding — the cache turns itself off with a warning.

What it saves: the CLIP runs whenever a micro-batch holds a caption not in the cache (one padded
batch), so the saving is the share of micro-batches whose captions are all cached — nearly all of
them once a small caption set has been seen (the shapes world, fine-tuning sets), few for web-scale
data. ``encoded_rows`` counts the rows the CLIP ran, padding included.

Least recently used captions are dropped beyond ``max_mb`` megabytes of stored encodings (tensor
payload; small rows cost up to half as much again in allocator and bookkeeping overhead).

For a prior with its own caption transformer (``prior.text_encoder: transformer``) the cache keeps
the pooled text embedding only (``tokens=False``): that prior reads the caption's token ids, which
the training step tokenizes itself, and never the CLIP's token states, which would be ~77× the
bytes per caption. Its encodings then carry empty token states ``[B, 0, W]`` and masks ``[B, 0]``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Union

import torch

from unclip.nets.clip import CLIP
from unclip.nets.text_encoding import TextEncoding

__all__ = ["TextEncodingCache"]

logger = logging.getLogger("unclip.train")

Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TextEncodingCache:
    """``encode_text`` of a frozen ``clip`` with the encodings of seen captions kept (see module
    doc); ``encode_image`` is the CLIP's. ``chunk``: the batch size misses are encoded in (the
    micro-batch size); ``max_mb``: megabytes of encodings kept (0: no cache, every call encodes).
    ``served`` / ``encoded`` count captions returned and captions the CLIP encoded;
    ``encoded_rows`` the rows the CLIP ran (padding included). ``tokens=False``: only the pooled
    embeddings are kept and returned (empty token states; see module doc)."""

    def __init__(self, clip: CLIP, chunk: int, max_mb: float, tokens: bool = True):
        if chunk < 1:
            raise ValueError(f"TextEncodingCache: chunk must be >= 1, got {chunk}")
        if max_mb < 0:
            raise ValueError(f"TextEncodingCache: max_mb must be >= 0, got {max_mb}")
        self.clip, self.chunk, self.tokens = clip, chunk, tokens
        self.max_bytes = int(max_mb * 2**20)
        self.rows: OrderedDict[str, Row] = OrderedDict()
        self.bytes = 0
        self.served = 0
        self.encoded = 0
        self.encoded_rows = 0
        self.checked = False

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.clip.encode_image(images)

    def encode_text(self, captions: Union[str, Sequence[str], torch.Tensor]) -> TextEncoding:
        enc = self._encode_text(captions)
        if self.tokens or enc.text_tokens.shape[1] == 0:
            return enc
        return TextEncoding(enc.text_embed, enc.text_tokens[:, :0], enc.text_mask[:, :0])

    def _encode_text(self, captions: Union[str, Sequence[str], torch.Tensor]) -> TextEncoding:
        if isinstance(captions, torch.Tensor):  # token ids: not cached
            return self.clip.encode_text(captions)
        captions = [captions] if isinstance(captions, str) else list(captions)
        self.served += len(captions)
        if self.max_bytes == 0:
            self.encoded += len(captions)
            self.encoded_rows += len(captions)
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
            padded = part + [""] * (self.chunk - len(part))
            enc = self.clip.encode_text(padded)
            self.encoded += len(part)
            self.encoded_rows += self.chunk
            if not self.checked and not self._rows_independent(padded, enc):
                self.max_bytes = 0
                self.rows.clear()
                self.bytes = 0
                encoded = self.clip.encode_text(captions)  # what the step gets without a cache
                self.encoded += len(captions) - len(part)
                self.encoded_rows += len(captions)
                return encoded
            for i, caption in enumerate(part):
                # copies, so that a kept row does not hold its whole batch in memory; no token
                # states where the prior does not read them
                length = enc.text_tokens.shape[1] if self.tokens else 0
                row = (
                    enc.text_embed[i].clone(),
                    enc.text_tokens[i, :length].clone(),
                    enc.text_mask[i, :length].clone(),
                )
                found[caption] = row
                self._keep(caption, row)
        return TextEncoding(*(torch.stack([found[c][k] for c in captions]) for k in range(3)))

    def _rows_independent(self, batch: list[str], enc: TextEncoding) -> bool:
        """Whether the CLIP gives each caption of ``batch`` the same rows with the batch reversed
        (checked once): what makes cached rows exact. Warns when it does not."""
        self.checked = True
        if len(batch) < 2:
            return True
        back = self.clip.encode_text(batch[::-1])
        self.encoded_rows += len(batch)
        same = all(
            torch.equal(a, b.flip(0))
            for a, b in zip(
                (enc.text_embed, enc.text_tokens, enc.text_mask),
                (back.text_embed, back.text_tokens, back.text_mask),
            )
        )
        if not same:
            logger.warning(
                "train.text_cache_mb: turned off — on %s this CLIP's encoding of a caption depends "
                "on where it sits in the batch, so cached encodings would not be exact",
                enc.text_embed.device,
            )
        return same

    def _keep(self, caption: str, row: Row) -> None:
        size = _nbytes(row)
        if size > self.max_bytes:
            return
        self.rows[caption] = row
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.rows.popitem(last=False)
            self.bytes -= _nbytes(old)

    def __len__(self) -> int:
        return len(self.rows)


def _nbytes(row: Row) -> int:
    return sum(t.numel() * t.element_size() for t in row)
