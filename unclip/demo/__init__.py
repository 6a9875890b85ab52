"""The local web demo behind ``unclip serve`` (Gradio, an optional extra)."""

from unclip._compat import package_getattr

# names of the module this package replaced (``unclip.demo``), with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
