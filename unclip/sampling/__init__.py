"""Per-stage sampling: settings, each stage's sampler, autoregressive sampling, and the decoder's
candidate choice with its scorers.
"""

from unclip._compat import package_getattr

# names of the module this package replaced (``unclip.sampling``), with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
