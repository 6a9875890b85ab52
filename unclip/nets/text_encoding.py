"""The text encoding every stage takes (:class:`TextEncoding`: pooled embedding, token states and
mask of a batch of captions) and the check of prompts given by a user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class TextEncoding:
    """CLIP text conditioning: ``text_embed [B, D]``, ``text_tokens [B, L, W]``,
    ``text_mask [B, L]``; ``caption_ids [B, C]`` (long, optional): the captions' token ids for a
    network with its own caption transformer (a diffusion prior with ``text_encoder:
    transformer``), which reads them in place of the CLIP's token states."""

    text_embed: torch.Tensor
    text_tokens: torch.Tensor
    text_mask: torch.Tensor
    caption_ids: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.text_embed.shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TextEncoding:
        """``fn`` applied to every field (``caption_ids`` only when present)."""
        ids = None if self.caption_ids is None else fn(self.caption_ids)
        return TextEncoding(fn(self.text_embed), fn(self.text_tokens), fn(self.text_mask), ids)

    def with_caption_ids(self, caption_ids: Optional[torch.Tensor]) -> TextEncoding:
        """The same encoding carrying ``caption_ids [B, C]`` (None: none)."""
        if caption_ids is not None and caption_ids.shape[0] != len(self):
            raise ValueError(
                f"caption_ids have {caption_ids.shape[0]} rows for {len(self)} encoded captions"
            )
        return dataclasses.replace(self, caption_ids=caption_ids)

    def repeat_interleave(self, n: int) -> TextEncoding:
        """Each row repeated ``n`` times in place (for ``num_images_per_prompt``)."""
        if n == 1:
            return self
        return self._map(lambda t: t.repeat_interleave(n, dim=0))

    def to(self, *args, **kwargs) -> TextEncoding:
        """Embeddings and token states as ``Tensor.to(*args, **kwargs)``; the boolean mask and
        the token ids only follow a device move."""
        positional = args[0] if args and not isinstance(args[0], torch.dtype) else None
        device = kwargs.get("device", self.text_mask.device if positional is None else positional)
        ids = None if self.caption_ids is None else self.caption_ids.to(device)
        return TextEncoding(
            self.text_embed.to(*args, **kwargs),
            self.text_tokens.to(*args, **kwargs),
            self.text_mask.to(device),
            ids,
        )

    def __getitem__(self, idx) -> TextEncoding:
        return self._map(lambda t: t[idx])

    @staticmethod
    def cat(encodings: Sequence[TextEncoding]) -> TextEncoding:
        """The rows of ``encodings`` one after another (e.g. ``[uncond; cond]`` for guidance);
        ``caption_ids`` are kept when every encoding has them."""
        fields = ("text_embed", "text_tokens", "text_mask")
        parts = [torch.cat([getattr(e, f) for e in encodings]) for f in fields]
        has_ids = [e.caption_ids is not None for e in encodings]
        if any(has_ids) and not all(has_ids):
            raise ValueError(
                "TextEncoding.cat: some encodings carry caption_ids and some do not; encode all "
                "of them for the same prior"
            )
        ids = None
        if all(has_ids):
            ids = torch.cat([e.caption_ids for e in encodings if e.caption_ids is not None])
        return TextEncoding(parts[0], parts[1], parts[2], ids)


def check_prompts(prompt: Union[str, Sequence[str]], what: str = "prompt") -> list[str]:
    """Normalise ``prompt`` to a non-empty list of strings or raise a clear error."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, (list, tuple)):
        prompts = list(prompt)
    else:
        raise TypeError(
            f"{what} must be a string or a list of strings, got {type(prompt).__name__}"
        )
    if not prompts:
        raise ValueError(f"{what} list is empty: pass at least one string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"{what}[{i}] must be a string, got {type(p).__name__} ({p!r})")
    return prompts
