"""The base every pipeline family subclasses: :class:`BasePipeline`.

A family (unCLIP's cascade, the DALL-E and DALL-E Mega token pipelines, the next one) is a set of
components and a ``__call__`` that chains them. Everything else a user reaches for on any pipeline
is the same whichever family it is, and lives here once:

- **components and devices**: :meth:`~BasePipeline.modules`, :attr:`~BasePipeline.device`,
  :attr:`~BasePipeline.dtype`, :meth:`~BasePipeline.to`, the autocast setting
  (:attr:`~BasePipeline.autocast_dtype`), :meth:`~BasePipeline.compile`;
- **offload**: :meth:`~BasePipeline.enable_model_cpu_offload` and Accelerate's sequential offload;
- **settings**: each stage's sampling settings resolved once per call into a
  :class:`ResolvedSampling` that is passed down (a stage method given one reads its entry instead
  of resolving again);
- **the upsampler chain**: unCLIP upsamplers after whatever makes the first image
  (:meth:`~BasePipeline.upsample`), with their diffusion and sampling settings per stage;
- **diffusers' surface**: ``components`` (the constructor's arguments, so
  ``type(pipe)(**pipe.components)`` rebuilds it), :meth:`~BasePipeline.from_pipe`,
  :meth:`~BasePipeline.set_progress_bar_config`, callbacks through
  :func:`~unclip.sampling.stages.stage_callback`.

A family subclass defines what only it knows:

========================  ==========================================================
``modules()``             ``{name: module}`` of every component (offload, dtype, freezing)
``denoisers()``           the networks of every sampling step (compile, attention options)
``stage_names``           its stages in sampling order, upsamplers last
``sampling_settings()``   its defaults with overrides, as a :class:`ResolvedSampling`
``_anchor()``             the module whose device and dtype are the pipeline's
``_init_kwargs()``        the constructor's arguments that rebuild it from its components
``_prepare_stage(name)``  optional: work to do before ``name``'s component is brought in
``_forget_device_state``  optional: drop caches tied to a device (e.g. an encoded caption)
========================  ==========================================================

Capabilities that only some families have are mixins used by more than one class, as diffusers'
loaders are: :class:`~unclip.pipeline.memory.MemoryMixin` (attention slicing, xformers) and
:class:`~unclip.pipeline.lora.LoraMixin` (LoRA adapters). A capability a family lacks is absent
from it, not stubbed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Self, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import Generator
from unclip.io.card import check_card_fields
from unclip.io.hub import push_folder
from unclip.io.weights import check_variant, name_variant_files
from unclip.nets.decoder import UnCLIPUpsampler
from unclip.sampling.settings import UpsamplerSampling
from unclip.sampling.stages import StepCallback, sample_upsampler, stage_callback
from unclip.utils.devices import under_fake_tensors
from unclip.utils.offload import ModelOffloader, releases_gpu
from unclip.utils.precision import parse_autocast, parse_dtype, resolve_autocast

__all__ = ["BasePipeline", "ResolvedSampling"]

_log = logging.getLogger(__name__)


class ResolvedSampling(dict):
    """``{stage: settings}`` already resolved and checked by a pipeline's
    :meth:`~BasePipeline.sampling_settings`: a stage method given one takes its stage's entry as
    it is, so ``__call__`` resolves the settings once and every stage reads the same objects."""


class BasePipeline:
    """What every pipeline family shares (see the module doc)."""

    upsamplers: list[UnCLIPUpsampler]
    diffusion: dict[str, DiffusionConfig]
    sampling: dict[str, Any]
    #: the model card fields save_pretrained writes (unclip.io.card.CARD_FIELDS)
    card_info: dict
    # None, "auto" or a dtype (:attr:`autocast_dtype` resolves it)
    _autocast_dtype: Union[str, torch.dtype, None] = None
    _offloader: Optional[ModelOffloader] = None
    _sequential_device: Optional[torch.device] = None
    #: whether the family's from_pretrained reads ``variant=`` weights (save_pretrained refuses
    #: to write what cannot be read back)
    _reads_variants: bool = True

    # ------------------------------------------------------------------ what a family defines
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every component by name."""
        raise NotImplementedError

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks of every sampling step, which the speed and memory options act on."""
        raise NotImplementedError

    @property
    def stage_names(self) -> list[str]:
        """The stages in sampling order (upsamplers last), the keys of :attr:`sampling`."""
        raise NotImplementedError

    def sampling_settings(self, sampling: Optional[Mapping] = None) -> ResolvedSampling:
        """The settings every stage samples with, the defaults with ``sampling`` overrides."""
        raise NotImplementedError

    def _anchor(self) -> torch.nn.Module:
        """The component whose device and dtype are the pipeline's."""
        raise NotImplementedError

    def _init_kwargs(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this pipeline over its components."""
        raise NotImplementedError

    def _prepare_stage(self, name: str) -> None:
        """Called at a stage's entry under model offload, before its component comes in."""

    def _forget_device_state(self) -> None:
        """Drop what was cached on the device the components were on (they moved)."""

    # ------------------------------------------------------------------ structure
    def _init_base(self) -> None:
        """The shared state a family's ``__init__`` starts from."""
        self.card_info = {}
        self._progress_config: dict[str, Any] = {}

    @property
    def upsampler_names(self) -> list[str]:
        """``sr<size>`` of each upsampler, in order."""
        return [f"sr{u.config.sample_size}" for u in self.upsamplers]

    def parameter_counts(self) -> dict[str, int]:
        """Parameters per component."""
        return {k: sum(p.numel() for p in m.parameters()) for k, m in self.modules().items()}

    def _freeze(self) -> Self:
        """Every component in eval mode without gradients: what a loaded pipeline samples with."""
        for m in self.modules().values():
            m.eval().requires_grad_(False)
        return self

    def _stage_settings(self, stage: str, sampling: Optional[Mapping]) -> Any:
        """``stage``'s settings: its entry of an already :class:`ResolvedSampling`, else resolved
        from the raw overrides ``sampling``."""
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.sampling_settings(sampling)
        return sampling[stage]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ devices and arithmetic
    @property
    def device(self) -> torch.device:
        """Where sampling runs: the components' device, or the execution device of
        :meth:`enable_model_cpu_offload` (the components then wait on the CPU)."""
        if self._offloader is not None:
            return self._offloader.device
        if self._sequential_device is not None:  # the weights wait on the CPU (or meta)
            return self._sequential_device
        return next(self._anchor().parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self._anchor().parameters()).dtype

    def to(self, device=None, dtype=None, memory_format=None) -> Self:
        """Move every component: ``pipe.to("cuda")``, ``pipe.to(torch.float16)``,
        ``pipe.to("cuda", torch.bfloat16)``. Casting to float16/bfloat16 keeps the tensors the
        numerics need in float32 (:mod:`unclip.utils.precision`). ``memory_format=
        torch.channels_last`` stores the image networks' conv weights NHWC, which makes their
        activations NHWC too (faster convolutions on CPUs with oneDNN, same results to float
        rounding). With model offload on, a device ends it (every component then moves there); a
        dtype alone casts the waiting components and keeps it."""
        if isinstance(device, torch.dtype):  # pipe.to(torch.float16), as diffusers' pipelines
            device, dtype = None, device if dtype is None else dtype
        if isinstance(device, str) and device in ("float16", "bfloat16", "float32", "fp16"):
            raise TypeError(
                f"to({device!r}): a dtype is given as torch.{device} or dtype={device!r}, not as "
                "the device"
            )
        dtype = parse_dtype(dtype, "dtype")
        if self._offloader is not None:
            if device is not None:
                self.disable_model_cpu_offload()
            else:
                self._offloader.offload_all()  # cast the CPU copies, not a device copy
        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        for m in self.modules().values():
            m.to(**kwargs)
        if memory_format is not None:
            for m in self._image_networks():
                # diffusers types ModelMixin.to through functools.wraps, as an unbound call
                m.to(memory_format=memory_format)  # type: ignore[call-arg]
        self._forget_device_state()
        self._device_changed()
        return self

    def _image_networks(self) -> list[torch.nn.Module]:
        """The convolutional networks a memory format applies to (the upsamplers here)."""
        return list(self.upsamplers)

    def _device_changed(self) -> None:
        """After the components moved (capability mixins, e.g. xformers on CUDA, hook in)."""

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype every denoising network call runs in under ``torch.autocast`` on the
        pipeline's device, or ``None`` (full precision). Weights, latents, guidance and the
        scheduler stay in the pipeline's dtype.

        Set it to ``None``, ``torch.bfloat16``/``torch.float16`` (or their names) or ``"auto"``:
        float16 on a GPU, bfloat16 on a CPU that runs it natively (AVX512-BF16/AMX), else
        ``None``, and ``None`` with float16/bfloat16 weights
        (:func:`unclip.utils.precision.resolve_autocast`); ``"auto"`` follows the pipeline when
        it moves or is cast. A constructed pipeline starts at ``None`` (exact), as does a loaded
        one unless ``from_pretrained(autocast_dtype=...)`` asks; :attr:`autocast_setting` is what
        was set."""
        return resolve_autocast(self._autocast_dtype, self.device, self.dtype)

    @autocast_dtype.setter
    def autocast_dtype(self, dtype) -> None:
        self._autocast_dtype = parse_autocast(dtype)

    @property
    def autocast_setting(self):
        """What :attr:`autocast_dtype` was set to: ``None``, ``"auto"`` or a dtype."""
        return self._autocast_dtype

    def compile(self, **kwargs) -> Self:
        """``torch.compile`` every network in :meth:`denoisers` in place (``kwargs`` go to
        ``torch.compile``, e.g. ``mode="max-autotune"``); weights and state-dict names are
        unchanged. The first call of each stage compiles (minutes for a mid-size UNet on a CPU).
        A one-line notice says so when it is asked for."""
        nets = self.denoisers()
        _log.warning(
            "compiling %s with torch.compile: the first call of each stage compiles it, which "
            "takes minutes on a CPU (later calls and shapes already seen are fast)",
            ", ".join(nets),
        )
        for net in nets.values():
            net.compile(**kwargs)
        return self

    # ------------------------------------------------------------------ offload
    def enable_model_cpu_offload(
        self, gpu_id: Optional[int] = None, device: Union[str, torch.device] = "cuda"
    ) -> None:
        """Keep every component on the CPU and each on ``device`` (``cuda:<gpu_id>``; default
        the current CUDA device) only while it runs (:mod:`unclip.utils.offload`). Images equal
        those of the pipeline on ``device`` without offload. Undo with
        :meth:`disable_model_cpu_offload` or ``pipe.to`` with a device."""
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
        if self._sequential_device is not None:
            raise ValueError(
                "enable_model_cpu_offload: sequential offload is on; build the pipeline again "
                "(one offload mode at a time)"
            )
        if self._offloader is not None:
            self._offloader.remove()
        self._offloader = ModelOffloader(self.modules(), device)
        self._forget_device_state()
        self._device_changed()

    def disable_model_cpu_offload(self) -> None:
        """Remove the hooks; every component stays on the CPU (``pipe.to(device)`` next)."""
        if self._offloader is not None:
            self._offloader.remove()
            self._offloader = None
            self._forget_device_state()
            self._device_changed()  # the components are on the CPU now

    @property
    def model_cpu_offload(self) -> Optional[ModelOffloader]:
        """The active offloader (its ``device``, ``active`` component and ``loads``), or None."""
        return self._offloader

    def _offload_all(self) -> None:
        """Every component back on the CPU (before weights change)."""
        if self._offloader is not None:
            self._offloader.offload_all()

    def _onload(self, name: str) -> None:
        """At a stage's entry: its component on the device when offloading."""
        if self._offloader is None:
            return
        self._prepare_stage(name)
        self._offloader.activate(name)

    def enable_sequential_cpu_offload(
        self, gpu_id: Optional[int] = None, device: Union[torch.device, str, None] = None
    ) -> None:
        """Keep every weight on the CPU and copy each submodule to the accelerator only for its
        own forward (Accelerate's ``cpu_offload``): the least accelerator memory, and the slowest.
        ``device`` (default ``cuda:<gpu_id or 0>``) must exist. :meth:`enable_model_cpu_offload`
        moves whole components instead, which is much faster."""
        from accelerate import cpu_offload

        target = torch.device(device) if device is not None else torch.device("cuda", gpu_id or 0)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "enable_sequential_cpu_offload: no CUDA device is available (torch sees none); "
                "it only helps with an accelerator, pass device= to name another"
            )
        if self.model_cpu_offload is not None:
            raise ValueError(
                "enable_sequential_cpu_offload: model offload is on; call "
                "disable_model_cpu_offload() first"
            )
        self.to("cpu")
        for module in self.modules().values():
            cpu_offload(module, execution_device=target)
        self._sequential_device = target

    # ------------------------------------------------------------------ diffusers' surface
    @property
    def components(self) -> dict[str, Any]:
        """The constructor's arguments (modules and per-stage settings), as diffusers'
        ``components``: ``type(pipe)(**pipe.components)`` builds the same pipeline over the same
        modules. :meth:`modules` names every module instead."""
        return self._init_kwargs()

    @classmethod
    def from_pipe(cls, pipeline: BasePipeline, **kwargs) -> Self:
        """A new pipeline over ``pipeline``'s modules (no copy: they are shared), with any of its
        constructor's arguments (:attr:`components`) replaced by ``kwargs``; the autocast
        setting, the progress bar configuration and the card carry over."""
        if not isinstance(pipeline, cls):
            raise TypeError(
                f"{cls.__name__}.from_pipe takes a {cls.__name__}, got "
                f"{type(pipeline).__name__}; each family is built from its own components"
            )
        if pipeline._offloader is not None or pipeline._sequential_device is not None:
            raise ValueError(
                "from_pipe: the pipeline has CPU offload on, whose hooks sit in the shared "
                "modules; call disable_model_cpu_offload() (or build it again) first"
            )
        if getattr(pipeline, "lora_adapters", None):
            raise ValueError(
                "from_pipe: LoRA adapters are loaded into the shared modules; merge_lora() or "
                "unload_lora() first"
            )
        own = pipeline.components
        unknown = sorted(set(kwargs) - set(own))
        if unknown:
            raise TypeError(
                f"from_pipe: unknown argument {unknown[0]!r} (it takes: {', '.join(own)})"
            )
        pipe = cls(**{**own, **kwargs})
        pipe._autocast_dtype = pipeline._autocast_dtype
        pipe.card_info = dict(pipeline.card_info)
        pipe._progress_config = dict(pipeline._progress_config)
        return pipe

    def set_progress_bar_config(self, **kwargs) -> None:
        """``disable=True`` turns the progress bars of every later call off (every sampling,
        editing and stage method, as ``progress=False``), as in diffusers; other tqdm options are
        not supported."""
        unknown = sorted(set(kwargs) - {"disable"})
        if unknown:
            raise ValueError(
                f"set_progress_bar_config: only 'disable' is supported, got {', '.join(unknown)}"
            )
        self._progress_config = dict(kwargs)

    def _progress(self, progress: bool) -> bool:
        """Whether a call asked ``progress`` shows its bars (:meth:`set_progress_bar_config`)."""
        return bool(progress) and not self._progress_config.get("disable", False)

    # ------------------------------------------------------------------ folders
    def _write_folder(self, path: Path, model_card: Mapping) -> None:
        """Write the family's own folder (components, settings, model card) into ``path``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved as a folder")

    def _check_savable(self, action: str) -> None:
        """Raise if the pipeline cannot be written as it is (capabilities hook in: unmerged LoRA
        adapters are not part of the components)."""

    def save_pretrained(
        self,
        save_directory: Union[str, os.PathLike],
        safe_serialization: bool = True,
        variant: Optional[str] = None,
        push_to_hub: bool = False,
        model_card: Optional[Mapping] = None,
        **push_kwargs,
    ) -> Path:
        """Write the pipeline's self-describing folder (its components, each in its own
        subfolder with ``config.json`` and safetensors weights, the default settings, and
        ``README.md``, a model card in the Hub's format from :attr:`card_info` updated with
        ``model_card``: fields in :data:`unclip.io.card.CARD_FIELDS`), which ``from_pretrained``
        reads back.

        diffusers' keywords: ``safe_serialization`` (only safetensors are written; ``False`` is an
        error), ``variant`` (e.g. ``"fp16"``: weights named ``*.fp16.safetensors``, read back with
        ``from_pretrained(variant="fp16")``), ``push_to_hub=True`` (then upload the folder with
        :meth:`push_to_hub`, ``repo_id`` and the rest of its keywords in ``push_kwargs``).
        Refused while LoRA adapters are loaded unmerged (merge them first). Returns the
        folder."""
        if not safe_serialization:
            raise ValueError(
                "save_pretrained(safe_serialization=False): unclip writes safetensors only "
                "(pickle weights are never written or loaded)"
            )
        if push_kwargs and not push_to_hub:
            raise TypeError(
                f"save_pretrained: unknown argument {sorted(push_kwargs)[0]!r} (the Hub's "
                "arguments go with push_to_hub=True)"
            )
        self._check_savable("save_pretrained")
        if variant is not None:
            check_variant(variant)
            if not self._reads_variants:
                raise ValueError(
                    f"save_pretrained(variant=...): a {type(self).__name__} folder loads plain "
                    "weights only; save without variant"
                )
        info = {**self.card_info, **check_card_fields(model_card)}
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        if variant:
            # renamed where only this save's files are, then moved in beside what the folder holds
            # (another variant's weights stay)
            with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
                self._write_folder(Path(tmp), info)
                name_variant_files(Path(tmp), variant)
                shutil.copytree(tmp, folder, dirs_exist_ok=True)
        else:
            self._write_folder(folder, info)
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or folder.name
            self.push_to_hub(repo_id, model_card=model_card, variant=variant, **push_kwargs)
        return folder

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        token: Union[str, bool, None] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        model_card: Optional[Mapping] = None,
        variant: Optional[str] = None,
    ):
        """Upload the folder :meth:`save_pretrained` writes (with its model card, whose loading
        example names ``repo_id``) to the Hub model repo ``repo_id``, created if needed; returns
        ``huggingface_hub``'s ``CommitInfo``. ``token``: default, the one ``hf auth login``
        stored."""
        return push_folder(
            self._push_writer(repo_id, model_card, variant),
            repo_id,
            commit_message=commit_message,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )

    def _push_writer(
        self, repo_id: str, model_card: Optional[Mapping] = None, variant: Optional[str] = None
    ):
        """What :meth:`push_to_hub` uploads: a function writing :meth:`save_pretrained`'s folder
        with a card whose loading example names ``repo_id``
        (:func:`unclip.io.hub.upload_folder_of`)."""
        card = {"repo_id": repo_id, **check_card_fields(model_card)}
        return lambda folder: self.save_pretrained(folder, model_card=card, variant=variant)

    def _loaded_defaults(self, autocast, memory_format, dtype=None) -> Self:
        """The sampling defaults of a pipeline that was loaded (it owns its modules, so changing
        their layout changes nothing outside it): the autocast setting, the image networks'
        memory format, the weights' dtype."""
        self._autocast_dtype = autocast
        if dtype is not None or memory_format is not None:
            self.to(dtype=dtype, memory_format=memory_format)
        return self

    # ------------------------------------------------------------------ the upsampler chain
    @releases_gpu
    @torch.no_grad()
    def upsample(
        self,
        images: torch.Tensor,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        stages: Optional[Sequence[str]] = None,
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        latents: Optional[torch.Tensor] = None,
    ):
        """Upsamplers: ``[B, 3, h, w]`` in [-1, 1] → ``[B, 3, H, W]`` through each upsampler in
        turn (or only those named in ``stages``, in the pipeline's order). ``latents [B, 3, H,
        W]``: the first upsampler's initial noise. ``sampling``: overrides (or a
        :class:`ResolvedSampling`). With ``return_intermediates``: ``(images, {stage:
        images})``."""
        if not isinstance(images, torch.Tensor) or images.ndim != 4:
            raise TypeError("upsample: images must be a tensor [B, 3, h, w] in [-1, 1]")
        names = self.upsampler_names
        if stages is None:
            chosen = names
        else:
            if isinstance(stages, str):
                raise TypeError(f"upsample: stages is a list of stage names, got {stages!r}")
            unknown = [s for s in stages if s not in names]
            if unknown:
                raise ValueError(
                    f"upsample: no upsampler {unknown[0]!r}; this pipeline has "
                    f"{', '.join(names) or 'none'}"
                )
            chosen = [n for n in names if n in stages]
        if not isinstance(sampling, ResolvedSampling):
            sampling = self.sampling_settings(sampling)
        progress = self._progress(progress)
        by_name = dict(zip(names, self.upsamplers))
        out = images.to(self.device).float()
        inter: dict[str, torch.Tensor] = {}
        for name in chosen:
            s = sampling[name]
            assert isinstance(s, UpsamplerSampling), type(s).__name__
            self._onload(name)
            out = sample_upsampler(
                by_name[name],
                out,
                s,
                self.diffusion[name],
                generator=generator,
                progress=progress,
                autocast_dtype=self.autocast_dtype,
                callback=stage_callback(self, name, callback_on_step_end),
                latents=latents if not inter else None,
            )
            inter[name] = out
        return (out, inter) if return_intermediates else out
