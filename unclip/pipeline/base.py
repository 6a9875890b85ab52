"""What the mixins of :class:`~unclip.pipeline.pipeline.UnCLIPPipeline` may rely on.

The pipeline is assembled from mixins (stages, loading, devices, editing, memory, offload, LoRA,
diffusers' interface), each of which uses the pipeline's components and methods the others
define. :class:`PipelineBase` is their common base: it declares the component attributes
``UnCLIPPipeline.__init__`` sets and, for type checkers only, the methods one mixin calls on
another, so every mixin is checked against the same contract without importing the pipeline.
At run time it adds nothing: the annotations create no attributes and the method stubs exist only
under ``TYPE_CHECKING``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Self, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.nets.text_encoding import TextEncoding
from unclip.sampling.settings import StageSampling
from unclip.utils.offload import ModelOffloader

__all__ = ["PipelineBase"]


class PipelineBase:
    """The attributes and cross-mixin methods of an ``UnCLIPPipeline`` (see the module doc)."""

    clip: CLIP
    prior: Optional[UnCLIPPrior]
    decoder: UnCLIPDecoder
    upsamplers: list[UnCLIPUpsampler]
    reranker: Optional[CLIP]
    diffusion: dict[str, DiffusionConfig]
    sampling: dict[str, StageSampling]
    prior_clip_range: Optional[float]
    card_info: dict
    _null_text: Optional[TextEncoding]
    # None, "auto" or a dtype (DevicesMixin.autocast_dtype resolves it)
    _autocast_dtype: Union[str, torch.dtype, None]
    _offloader: Optional[ModelOffloader] = None

    if TYPE_CHECKING:
        # UnCLIPPipeline
        @property
        def upsampler_names(self) -> list[str]: ...

        @property
        def stage_names(self) -> list[str]: ...

        def modules(self) -> dict[str, torch.nn.Module]: ...

        def sampling_settings(
            self, sampling: Optional[Mapping] = None
        ) -> dict[str, StageSampling]: ...

        def _stage_settings(self, stage: str, sampling: Optional[Mapping]) -> StageSampling: ...

        # DevicesMixin
        @property
        def device(self) -> torch.device: ...

        @property
        def dtype(self) -> torch.dtype: ...

        @property
        def autocast_dtype(self) -> Optional[torch.dtype]: ...

        def to(self, device=None, dtype=None, memory_format=None) -> Self: ...

        def denoisers(self) -> dict[str, torch.nn.Module]: ...

        # StagesMixin
        def null_text(self, batch: int) -> TextEncoding: ...

        def _decoder_captions(self, text, b: int) -> tuple[Any, Any]: ...

        def _decoder_negative(self, negative, b: int) -> Any: ...

        # the stage methods' own signatures are checked where they are defined (StagesMixin)
        def sample_image_embeds(self, *args: Any, **kwargs: Any) -> Any: ...

        def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

        def upsample(self, *args: Any, **kwargs: Any) -> Any: ...

        # OffloadMixin
        @property
        def model_cpu_offload(self) -> Optional[ModelOffloader]: ...

        def disable_model_cpu_offload(self) -> None: ...

        def _offload_all(self) -> None: ...

        def _onload(self, name: str) -> None: ...

        # MemoryMixin
        def _auto_xformers(self) -> None: ...

        # LoraMixin
        def _refuse_unmerged_lora(self, action: str) -> None: ...

        # DiffusersInterfaceMixin
        def _progress(self, progress: bool) -> bool: ...
