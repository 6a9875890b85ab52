"""The hooks of per-stage model offload for every pipeline family (its methods are the pipeline
base's, :class:`~unclip.pipeline.base.BasePipeline`)::

    pipe.enable_model_cpu_offload()        # each component on cuda:0 only while it runs
    pipe.enable_model_cpu_offload(gpu_id=1)
    pipe.disable_model_cpu_offload()       # everything back on the CPU, hooks removed

The cascade's components (CLIP, prior, decoder, each upsampler, the optional reranker) stay in CPU
memory; the one that is about to run is copied to the execution device and the one that ran before
it goes back, so the accelerator holds one component's weights at a time plus the activations of
the stage running. A full-scale cascade's weights no longer have to fit at once, for the price of
one host-to-device copy of each component per stage it runs in (the CLIP twice when candidates are
reranked after the decoder, and the decoder twice when they are chosen part-way, ``rerank_at``,
three times when they are pruned before that, ``prune_at``).

How a component is brought in: an Accelerate hook (:class:`accelerate.hooks.ModelHook`) on every
submodule of every component runs before the submodule's ``forward`` and activates its component,
so any path that reaches a weight through a module call (the pipeline, the edits, a user calling
``pipe.decoder(...)``) finds it on the device. Some tensors are read before any module call: the
CLIP's ``encode_text``/``encode_image`` (wrapped to activate the CLIP) and each stage's entry in
the pipeline (it activates the stage: the autoregressive prior reads its PCA basis directly).

Parameters are replaced in place (``module._parameters[name] = Parameter(copy)``, tied tensors
kept tied) rather than moved with ``Module.to``: the same operation on real tensors, and it also
runs on PyTorch's fake CUDA tensors, which is how this module is tested without a GPU. Going back
to the CPU costs no device-to-host copy: the CPU parameter a weight came from is kept and put back
(the same object, so references to it stay valid), unless the weight was changed in place or
replaced while on the device (e.g. LoRA merged into it), in which case the new values are copied
back.

Inference only: gradients through offloaded components are not supported (the CPU copies are the
weights' home, and an optimizer would hold the device copies).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

#: component methods that read weights before any submodule's forward (the CLIP moves token ids
#: to its device first): each activates its component when called
ENTRY_METHODS = ("encode_text", "encode_image")


class Activate(ModelHook):
    """Before a submodule's forward: make sure its component is the one on the device."""

    def __init__(self, offloader: ModelOffloader, name: str):
        self.offloader = offloader
        self.name = name

    def pre_forward(self, module, *args, **kwargs):
        if self.offloader.active != self.name:
            self.offloader.activate(self.name)
        return args, kwargs


class ModelOffloader:
    """Keeps at most one of ``components`` on ``device``; the rest on the CPU (module doc)."""

    def __init__(self, components: dict[str, torch.nn.Module], device: torch.device):
        self.components = dict(components)
        self.device = torch.device(device)
        self.active: Optional[str] = None
        #: counts of host-to-device component copies, by component (what offload costs)
        self.loads: dict[str, int] = {name: 0 for name in self.components}
        # id(device tensor) -> (device tensor, its CPU origin, the device tensor's state)
        self._origin: dict[int, tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        owners: dict[int, str] = {}
        for name, module in self.components.items():
            for sub in module.modules():
                if owners.setdefault(id(sub), name) != name:
                    raise ValueError(
                        f"model offload: {name} and {owners[id(sub)]} share the submodule "
                        f"{type(sub).__name__}; each component must own its modules"
                    )
                if getattr(sub, "_hf_hook", None) is not None:
                    raise ValueError(
                        f"model offload: a module of {name} ({type(sub).__name__}) already has an "
                        "Accelerate hook (device_map / another offload); remove it first"
                    )
        # modules whose forward is their class's: removing Accelerate's hook leaves an instance
        # attribute behind (a reference cycle, and code that checks vars(m) for a patched forward)
        self._class_forward = [
            sub
            for m in self.components.values()
            for sub in m.modules()
            if "forward" not in vars(sub)
        ]
        for name, module in self.components.items():
            _move(module, torch.device("cpu"), None)
            for sub in module.modules():
                add_hook_to_module(sub, Activate(self, name))
            for method in ENTRY_METHODS:
                if callable(getattr(module, method, None)):
                    setattr(module, method, self._activating(name, getattr(module, method)))

    def _activating(self, name: str, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            self.activate(name)
            return method(*args, **kwargs)

        return call

    def activate(self, name: str) -> None:
        """Bring component ``name`` to the device, after sending the active one back."""
        if name == self.active:
            return
        if name not in self.components:
            raise KeyError(f"no component {name!r}; components: {sorted(self.components)}")
        self.offload_all()
        _move(self.components[name], self.device, self._origin)
        self.active = name
        self.loads[name] += 1

    def offload_all(self) -> None:
        """Send the active component (if any) back to the CPU."""
        if self.active is not None:
            _move(self.components[self.active], torch.device("cpu"), self._origin)
            self.active = None
        self._origin.clear()

    def remove(self) -> None:
        """Every component back on the CPU and every hook removed."""
        self.offload_all()
        for module in self.components.values():
            remove_hook_from_module(module, recurse=True)
            for method in ENTRY_METHODS:
                module.__dict__.pop(method, None)
        for sub in self._class_forward:
            sub.__dict__.pop("forward", None)
        self._class_forward = []


def _state(t: torch.Tensor) -> tuple:
    """What says a device copy is still the one made: in-place ops bump the version; assigning
    ``.data`` (peft's merge, a dtype cast) swaps the storage, dtype or shape."""
    return (t._version, t.untyped_storage()._cdata, t.dtype, t.shape)


def _move(module: torch.nn.Module, device: torch.device, origin: Optional[dict]) -> None:
    """Every parameter and buffer of ``module`` on ``device``, replaced in place (module doc).
    ``origin``: to the device, remember each copy's CPU tensor; back to the CPU, reuse it when
    the device copy is still the one made, unchanged. Every new tensor is made before any is
    assigned, so a failure leaves the module as it was."""

    def convert(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if t.device == device:
            return t
        if device.type == "cpu" and origin is not None:
            kept = origin.get(id(t))
            if kept is not None and kept[0] is t and _state(t) == kept[2]:
                return kept[1]  # the very tensor (or Parameter) that was there before
        new = t.detach().to(device, non_blocking=device.type == "cuda")
        return torch.nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new

    done: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor
    # the stores are _parameters or _buffers: keyed by name, holding parameters or tensors
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    # copies made inside torch.inference_mode() would be inference tensors, whose version
    # cannot be read and which could not be used outside it
    with torch.inference_mode(False), torch.no_grad():
        for m in module.modules():
            for store, is_param in ((m._parameters, True), (m._buffers, False)):
                for key, t in store.items():
                    if t is None:
                        continue
                    if id(t) not in done:
                        done[id(t)] = convert(t, is_param)
                    slots.append((store, key, t))
    for target, key, t in slots:
        new = done[id(t)]
        if device.type != "cpu" and origin is not None and new is not t:
            origin[id(new)] = (new, t, _state(new))
        target[key] = new


def releases_gpu(method):
    """Decorator for the pipeline's public sampling methods: with model offload on, the outermost
    call sends the last component back to the CPU when it returns, so no weights stay on the GPU
    between calls (nested calls, e.g. ``decode`` inside ``__call__``, leave that to the outer)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._offloader is None:
            return method(self, *args, **kwargs)
        self._offload_depth = getattr(self, "_offload_depth", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._offload_depth -= 1
            if self._offload_depth == 0 and self._offloader is not None:
                self._offloader.offload_all()

    return call
