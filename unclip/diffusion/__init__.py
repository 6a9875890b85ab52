"""The Gaussian diffusion process: noise-schedule configs, the one training loss, the one denoising
loop (with a per-step hook), scheduler construction, and the variational bound.
"""

from unclip._compat import package_getattr

# names of the module this package replaced (``unclip.diffusion``), with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
