"""Per-stage model offload for :class:`~unclip.pipeline.pipeline.UnCLIPPipeline`::

    pipe.enable_model_cpu_offload()        # each component on cuda:0 only while it runs
    pipe.enable_model_cpu_offload(gpu_id=1)
    pipe.disable_model_cpu_offload()       # everything back on the CPU, hooks removed

The cascade's components stay in CPU memory and the one about to run is copied to the execution
device, so the accelerator holds one component's weights at a time. How a component is brought in
and sent back (Accelerate hooks, parameters replaced in place, tested on fake CUDA tensors) is in
:mod:`unclip.utils.offload`. Inference only.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from unclip.pipeline.base import PipelineBase
from unclip.utils.devices import under_fake_tensors
from unclip.utils.offload import ModelOffloader

__all__ = ["OffloadMixin"]


class OffloadMixin(PipelineBase):
    """``enable_model_cpu_offload`` / ``disable_model_cpu_offload`` (see the module doc)."""

    def enable_model_cpu_offload(
        self, gpu_id: Optional[int] = None, device: Union[str, torch.device] = "cuda"
    ) -> None:
        """Keep every component on the CPU and each on ``device`` (``cuda:<gpu_id>``; default
        the current CUDA device) only while it runs. Images equal those of the pipeline on
        ``device`` without offload. Undo with :meth:`disable_model_cpu_offload` or ``pipe.to``
        with a device."""
        device = torch.device(device)
        if gpu_id is not None:
            if device.index is not None and device.index != gpu_id:
                raise ValueError(f"gpu_id={gpu_id} contradicts device={device}; give one of them")
            device = torch.device(device.type, gpu_id)
        if device.type == "cpu":
            raise ValueError(
                "model offload moves components between the CPU and an accelerator; on the CPU "
                "there is nothing to offload (give device='cuda' or another accelerator)"
            )
        if device.type == "cuda" and not torch.cuda.is_available() and not under_fake_tensors():
            # else torch's own "Found no NVIDIA driver" surfaces from deep inside the first copy
            raise ValueError(
                "enable_model_cpu_offload needs a CUDA GPU and torch finds none "
                "(torch.cuda.is_available() is False); on a CPU-only machine run without offload "
                "(the weights are in RAM already), or pass device= for another accelerator"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._offloader is not None:
            self._offloader.remove()
        self._offloader = ModelOffloader(self.modules(), device)
        self._null_text = None  # cached on the device the CLIP was on
        self._auto_xformers()

    def disable_model_cpu_offload(self) -> None:
        """Remove the hooks; every component stays on the CPU (``pipe.to(device)`` next)."""
        if self._offloader is not None:
            self._offloader.remove()
            self._offloader = None
            self._null_text = None
            self._auto_xformers()  # off again: the components are on the CPU now

    @property
    def model_cpu_offload(self) -> Optional[ModelOffloader]:
        """The active offloader (its ``device``, ``active`` component and ``loads``), or None."""
        return self._offloader

    def _offload_all(self) -> None:
        """Every component back on the CPU (before weights change)."""
        if self._offloader is not None:
            self._offloader.offload_all()

    def _onload(self, name: str) -> None:
        """At a stage's entry: its component on the device when offloading (module doc)."""
        if self._offloader is None:
            return
        if name in ("prior", "decoder") and self._null_text is None:
            # guidance encodes the empty caption lazily, mid-stage: encode it now, so the CLIP
            # does not swap in and out of the stage
            self.null_text(1)
        self._offloader.activate(name)
