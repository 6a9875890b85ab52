"""unclip: the trainable unCLIP (DALL-E 2) text-to-image library."""

__version__ = "0.1.0"

# the package facade wires in the layers that extend the core: diffusers/Karlo folders load through
# UnCLIPPipeline.from_pretrained once unclip.interop has registered its reader
import unclip.interop  # noqa: E402,F401  (registration)
from unclip.clip import FrozenCLIP, TextEncoding
from unclip.config import load_config
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.pipeline import UnCLIPOutput, UnCLIPPipeline, slerp
from unclip.prior import UnCLIPPrior

__all__ = [
    "UnCLIPPipeline",
    "UnCLIPOutput",
    "FrozenCLIP",
    "TextEncoding",
    "UnCLIPPrior",
    "UnCLIPDecoder",
    "UnCLIPUpsampler",
    "load_config",
    "slerp",
    "__version__",
]
