"""Weights in and out of the ecosystem: diffusers/Karlo unCLIP folders
(:mod:`unclip.interop.diffusers`) and transformers CLIP ↔ open_clip (:mod:`unclip.interop.clip`).

Importing this package registers the diffusers folder layout with
``UnCLIPPipeline.from_pretrained``.
"""

from unclip.interop.diffusers_export import export_diffusers
from unclip.interop.diffusers_import import load_diffusers_unclip
from unclip.pipeline.folders import register_folder_format

register_folder_format("model_index.json", load_diffusers_unclip)

__all__ = ["export_diffusers", "load_diffusers_unclip"]
