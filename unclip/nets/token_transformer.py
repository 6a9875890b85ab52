"""The token transformers of the two other seed families, in one import: DALL-E's decoder-only
transformer (:mod:`unclip.nets.dalle_transformer`) and DALL-E Mega's BART-style encoder–decoder
(:mod:`unclip.nets.mega_transformer`); what they share is :mod:`unclip.nets.token_common`."""

from unclip.nets.dalle_transformer import (
    MASK_KINDS,
    DalleConfig,
    DalleLoss,
    DalleTransformer,
    dalle_attention_mask,
    dalle_layer_kinds,
)
from unclip.nets.mega_transformer import MegaConfig, MegaLayer, MegaTransformer
from unclip.nets.token_common import parameter_count

__all__ = [
    "MASK_KINDS",
    "dalle_attention_mask",
    "dalle_layer_kinds",
    "DalleConfig",
    "DalleTransformer",
    "DalleLoss",
    "MegaConfig",
    "MegaLayer",
    "MegaTransformer",
    "parameter_count",
]
