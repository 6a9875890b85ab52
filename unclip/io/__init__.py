"""Weights and files: safetensors loading with pickle refusal, the Hub, model cards."""

from unclip._compat import package_getattr

# names of the module this package replaced (``unclip.io``), with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
