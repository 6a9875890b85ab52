"""The text encoding every stage takes (:class:`TextEncoding`: pooled embedding, token states and
mask of a batch of captions) and the check of prompts given by a user.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch


@dataclass
class TextEncoding:
    """CLIP text conditioning: ``text_embed [B, D]``, ``text_tokens [B, L, W]``,
    ``text_mask [B, L]``."""

    text_embed: torch.Tensor
    text_tokens: torch.Tensor
    text_mask: torch.Tensor

    def __len__(self) -> int:
        return self.text_embed.shape[0]

    def repeat_interleave(self, n: int) -> TextEncoding:
        """Each row repeated ``n`` times in place (for ``num_images_per_prompt``)."""
        if n == 1:
            return self
        return TextEncoding(
            *(
                t.repeat_interleave(n, dim=0)
                for t in (self.text_embed, self.text_tokens, self.text_mask)
            )
        )

    def to(self, *args, **kwargs) -> TextEncoding:
        """Embeddings and token states as ``Tensor.to(*args, **kwargs)``; the boolean mask only
        follows a device move."""
        positional = args[0] if args and not isinstance(args[0], torch.dtype) else None
        device = kwargs.get("device", self.text_mask.device if positional is None else positional)
        return TextEncoding(
            self.text_embed.to(*args, **kwargs),
            self.text_tokens.to(*args, **kwargs),
            self.text_mask.to(device),
        )

    def __getitem__(self, idx) -> TextEncoding:
        return TextEncoding(self.text_embed[idx], self.text_tokens[idx], self.text_mask[idx])

    @staticmethod
    def cat(encodings: Sequence[TextEncoding]) -> TextEncoding:
        """The rows of ``encodings`` one after another (e.g. ``[uncond; cond]`` for guidance)."""
        fields = ("text_embed", "text_tokens", "text_mask")
        return TextEncoding(*(torch.cat([getattr(e, f) for e in encodings]) for f in fields))


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
