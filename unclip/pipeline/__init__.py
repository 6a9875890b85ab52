"""The unCLIP pipeline: :class:`UnCLIPPipeline`, its folders, editing, memory and offload, LoRA
methods, outputs and generate-to-folder.
"""

from unclip._compat import package_getattr

# names of the module this package replaced (``unclip.pipeline``), with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
