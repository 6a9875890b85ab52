"""unclip: the trainable unCLIP (DALL-E 2) text-to-image library."""

__version__ = "0.1.0"

# the facade wires in the layer that extends the core: diffusers/Karlo folders load through
# UnCLIPPipeline.from_pretrained once unclip.interop has registered its reader
import unclip.interop  # noqa: F401
from unclip.clip import CLIP, FrozenCLIP, TextEncoding
from unclip.config import load_config
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.pipeline import UnCLIPOutput, UnCLIPPipeline, slerp
from unclip.prior import UnCLIPPrior

__all__ = [
    "UnCLIPPipeline",
    "UnCLIPOutput",
    "CLIP",
    "FrozenCLIP",
    "TextEncoding",
    "UnCLIPPrior",
    "UnCLIPDecoder",
    "UnCLIPUpsampler",
    "load_config",
    "slerp",
    "__version__",
]
