"""What both prior trainers (diffusion and autoregressive) take from a batch of image–caption
pairs: the frozen CLIP's image embeddings and text encodings (:func:`embed_batch`).
"""

from __future__ import annotations

import torch

from unclip.nets.clip import CLIP
from unclip.nets.text_encoding import TextEncoding
from unclip.train.text_cache import TextEncodingCache


def embed_batch(
    clip: CLIP | TextEncodingCache, batch: dict, device
) -> tuple[torch.Tensor, TextEncoding]:
    text = clip.encode_text(batch["caption"]).to(device)
    if "image_embed" in batch:
        image_embed = torch.nn.functional.normalize(batch["image_embed"].float(), dim=-1).to(device)
    else:
        image_embed = clip.encode_image(batch["image"].to(device))
    return image_embed, text
