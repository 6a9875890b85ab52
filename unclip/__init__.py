"""unclip: the trainable unCLIP (DALL-E 2) text-to-image library."""
__version__ = "0.1.0"

from .clip import FrozenCLIP, TextEncoding
from .config import StageConfig, load_config
from .decoder import UnCLIPDecoder, UnCLIPUpsampler
from .pipeline import UnCLIPOutput, UnCLIPPipeline, slerp
from .prior import UnCLIPPrior

__all__ = ["UnCLIPPipeline", "UnCLIPOutput", "FrozenCLIP", "TextEncoding", "UnCLIPPrior", "UnCLIPDecoder",
           "UnCLIPUpsampler", "StageConfig", "load_config", "slerp", "__version__"]
