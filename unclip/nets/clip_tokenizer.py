"""The tokenizer a CLIP is built with: open_clip's own for the model config, or
:class:`CompatTokenizer` (open_clip's BPE with transformers' text handling) for converted weights.
"""

from __future__ import annotations

import re
import unicodedata

import open_clip
import torch
from open_clip.tokenizer import SimpleTokenizer


class CompatTokenizer(SimpleTokenizer):
    """open_clip's CLIP BPE with the text handling of transformers' ``CLIPTokenizer`` (for
    converted weights).

    Differences from :class:`SimpleTokenizer`: text is cleaned with NFC + whitespace collapsing +
    lower case (no ftfy / HTML unescaping); sequences are padded with ``pad_token`` instead of id 0;
    and the special strings ``<|startoftext|>``, ``<|endoftext|>`` and ``pad_token`` are split out
    of the prompt and map to their ids, as transformers does for special tokens (Karlo pads with
    ``"!"``, so a ``!`` in a prompt becomes id 0 there, not the ``!</w>`` word piece).
    """

    NAMES = {"<|startoftext|>": "<start_of_text>", "<|endoftext|>": "<end_of_text>"}

    def __init__(self, context_length: int = 77, pad_token: str = "<|endoftext|>"):
        super().__init__(context_length=context_length)
        self.clean_fn = _clean_nfc
        self.pad_token = pad_token
        self.special = {}
        for tok in ("<|startoftext|>", "<|endoftext|>", pad_token):
            key = self.NAMES.get(tok, tok)
            if key not in self.encoder:
                raise ValueError(f"tokenizer pad token {tok!r} is not in the CLIP BPE vocabulary")
            self.special[tok] = self.encoder[key]
        self.pad_token_id = self.special[pad_token]
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.special) + ")")

    def encode(self, text):
        ids = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self.special[piece])
            elif piece:
                ids.extend(super().encode(piece))
        return ids

    def __call__(self, texts, context_length=None) -> torch.Tensor:
        """Token ids ``[B, L]``: start, at most ``L - 2`` tokens, end, then ``pad_token_id``."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        length = int(context_length or self.context_length)
        out = torch.full((len(texts), length), self.pad_token_id, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = [self.sot_token_id] + self.encode(text)[: length - 2] + [self.eot_token_id]
            out[i, : len(ids)] = torch.tensor(ids)
        return out


def _clean_nfc(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFC", text)).lower()


def _make_tokenizer(model_name: str, model_cfg: dict, tokenizer_cfg: dict | None = None):
    text_cfg = model_cfg.get("text_cfg", {})
    if tokenizer_cfg is not None:
        return CompatTokenizer(
            context_length=int(text_cfg.get("context_length", 77)), **tokenizer_cfg
        )
    if "hf_tokenizer_name" in text_cfg or "hf_model_name" in text_cfg:
        return open_clip.get_tokenizer(model_name)
    return SimpleTokenizer(context_length=int(text_cfg.get("context_length", 77)))
