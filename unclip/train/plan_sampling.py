"""``unclip plan --sample``: the cascade's sampling at fp16 on fake CUDA tensors, with each stage's
peak memory on one GPU.

The pipeline comes from a pipeline folder (loaded for real, then its weights become fake CUDA
tensors) or from stage configs (``configs/prior_vit_l14.yaml configs/decoder_64.yaml …``: the
networks are built on fake tensors, so a full-scale cascade costs no memory here). Sampling runs
through :class:`~unclip.pipeline.UnCLIPPipeline` itself with a few steps per stage: memory does not
grow with the number of steps, and each step runs the same code. Tensors are counted by
:class:`~unclip.train.plan.MemoryTracker`.

A sampler built by :func:`~unclip.diffusion.schedulers.build_scheduler` (UniPC, Euler, ... by name)
reads its noise schedule in NumPy and finds its step by value (``nonzero``), which fake tensors
cannot do: it runs on real CPU tensors of the right shapes and dtypes while the networks run on
fake CUDA (:class:`_CPUSteps`), and the report names it; its per-sample history (a few sample-sized
tensors) is then not counted.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Optional, Union
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from unclip.diffusion import loop as diffusion_loop
from unclip.train.plan import MemoryTracker, _FakeCUDA
from unclip.utils.precision import dtype_name

__all__ = ["SampleMeasure", "measure_sampling", "format_sampling"]


@dataclasses.dataclass
class SampleMeasure:
    stages: list[str]
    params: dict  # component → parameters
    weights: int  # bytes of every component's weights on the GPU
    stage_peaks: dict  # stage → the peak while it sampled (bytes, weights included)
    peak: int
    batch: int
    dtype: str
    output_shape: list
    offload: bool = False
    #: stage → the components with weights on the GPU while it sampled
    resident: dict = dataclasses.field(default_factory=dict)
    #: the tensors kept in float32 under a half dtype (:mod:`unclip.utils.precision`'s rule)
    fp32_tensors: list = dataclasses.field(default_factory=list)
    attention_slicing: Optional[str] = None
    #: the autocast setting and, per denoising network, the CUDA autocast dtype it ran under
    #: (None: autocast off), read inside its forward
    autocast: Optional[str] = None
    network_autocast: dict = dataclasses.field(default_factory=dict)
    #: samplers whose steps ran on real CPU tensors (fake tensors cannot run them)
    cpu_schedulers: list = dataclasses.field(default_factory=list)


class _CPUSteps:
    """Builds the samplers of :func:`~unclip.diffusion.schedulers.build_scheduler` outside fake
    mode and runs their ``set_timesteps``, ``scale_model_input`` and ``step`` on real CPU tensors:
    a fake input becomes zeros of its shape and dtype, a result becomes a fake tensor of its shape
    and dtype on the sample's device (counted as the GPU would hold it). Between calls the
    sampler's tensors are fake views, so that the sampling loop (and a candidate choice that cuts
    rows of its state) can read them under fake mode; a timestep is the one of the sampler's own
    schedule at the step reached (its value was fake). ``names``: the classes that ran so."""

    def __init__(self, fake):
        self.fake = fake
        self.names: list[str] = []

    def patch(self):
        """Installs the builder for the duration of a ``with``."""
        build = diffusion_loop.build_scheduler

        def cpu_build(*args, **kwargs):
            with unset_fake_temporarily():
                sched = build(*args, **kwargs)
            self._wrap(sched)
            return sched

        return mock.patch.object(diffusion_loop, "build_scheduler", cpu_build)

    def _wrap(self, sched) -> None:
        name = type(sched).__name__
        if name not in self.names:
            self.names.append(name)
        views: dict[int, tuple] = {}  # id(fake view) → (view, the real tensor)
        where: dict[str, Any] = {"device": torch.device("cpu"), "index": 0}

        def real(t):
            if not isinstance(t, FakeTensor):
                return t
            if id(t) in views and views[id(t)][0] is t:
                return views[id(t)][1]
            return torch.zeros(t.shape, dtype=t.dtype)  # a row cut of a view, or an input

        def each(value, fn):
            if isinstance(value, torch.Tensor):
                return fn(value)
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
            return value

        def to_real() -> None:
            for key, value in list(vars(sched).items()):
                setattr(sched, key, each(value, real))

        def to_views() -> None:
            views.clear()

            def view(t):
                v = self.fake.from_tensor(t)
                if t is getattr(sched, "timesteps", None):  # the loop's t, on its device
                    v = v.to(where["device"])
                views[id(v)] = (v, t)
                return v

            for key, value in list(vars(sched).items()):
                setattr(sched, key, each(value, view))

        def timestep(offset: int = 0):
            steps, i = sched.timesteps, where["index"] + offset
            if offset:  # the next step's timestep, None after the last
                return steps[i] if i < len(steps) else None
            return steps[min(i, len(steps) - 1)]

        def fake_like(t, device):
            return torch.zeros(t.shape, dtype=t.dtype, device=device)

        set_timesteps, scale_model_input, step = (
            sched.set_timesteps,
            sched.scale_model_input,
            sched.step,
        )

        @functools.wraps(set_timesteps)
        def cpu_set_timesteps(*args, **kwargs):
            with unset_fake_temporarily():
                to_real()
                where["device"] = torch.device(kwargs.pop("device", None) or "cpu")
                where["index"] = 0
                set_timesteps(*args, **kwargs)
            to_views()  # under fake mode: a view moves to the fake GPU

        @functools.wraps(scale_model_input)
        def cpu_scale_model_input(sample, *args, **kwargs):
            with unset_fake_temporarily():
                to_real()
                x = real(sample)
                kwargs.pop("timestep", None)
                out = scale_model_input(x, timestep(), *args[1:], **kwargs)
            to_views()
            return sample if out is x else fake_like(out, sample.device)

        @functools.wraps(step)
        def cpu_step(model_output, t, sample, *args, **kwargs):
            with unset_fake_temporarily():
                to_real()
                if "generator" in kwargs:
                    kwargs["generator"] = None  # a CPU step takes no GPU generator
                if "prev_timestep" in kwargs:
                    kwargs["prev_timestep"] = timestep(1)
                kwargs = {k: each(v, real) for k, v in kwargs.items()}
                out = step(real(model_output), timestep(), real(sample), *args, **kwargs)
                where["index"] += 1
            to_views()
            if isinstance(out, tuple):
                return tuple(each(v, lambda t: fake_like(t, sample.device)) for v in out)
            for key, value in out.items():
                out[key] = each(value, lambda t: fake_like(t, sample.device))
            return out

        to_views()
        sched.set_timesteps = cpu_set_timesteps
        sched.scale_model_input = cpu_scale_model_input
        sched.step = cpu_step


def _replace_tensors(module: torch.nn.Module, convert, attributes: bool = False) -> None:
    """Every parameter and buffer of ``module`` (and with ``attributes`` its plain tensor
    attributes, e.g. a CLIP's kept token ids) replaced by ``convert(tensor)``, assigned in place:
    ``Module.to`` would swap each fake tensor, which fake tensors do not support."""
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None:
                with torch.no_grad():  # convert sees the parameter itself (its identity counts)
                    new = convert(p).detach()
                m._parameters[key] = torch.nn.Parameter(new, requires_grad=False)
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = convert(b)
        for key, v in list(vars(m).items()) if attributes else ():
            if isinstance(v, torch.Tensor):
                setattr(m, key, convert(v))


def _kept_fp32(components: dict, dtype: torch.dtype) -> dict[int, str]:
    """``id(tensor) → name`` of the tensors :func:`unclip.utils.precision.cast_floating` keeps in
    float32 when the pipeline is cast to ``dtype`` (each class's ``_keep_in_fp32_modules``)."""
    from unclip.utils.precision import HALF_DTYPES, _kept

    kept: dict[int, str] = {}
    if dtype not in HALF_DTYPES:
        return kept
    for comp, module in components.items():
        for prefix, sub in module.named_modules():
            keep = getattr(type(sub), "_keep_in_fp32_modules", None) or ()
            for name, t in [*sub.named_parameters(), *sub.named_buffers()]:
                if keep and _kept(name, keep):
                    kept[id(t)] = ".".join(x for x in (comp, prefix, name) if x)
    return kept


def _tensor_bytes(modules) -> int:
    """Bytes of the parameters and buffers of ``modules`` (each tensor once)."""
    seen = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _pipeline_from_configs(paths):
    """An untrained pipeline built from stage configs (the first one's CLIP conditions all)."""
    from unclip.nets.clip import CLIP
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.train.config import load_stage_config

    cfgs = [load_stage_config(p) for p in paths]
    clip_cfg = cfgs[0].clip
    clip_cfg.pretrained = None
    clip = CLIP.from_config(clip_cfg)
    prior, decoder, ups = None, None, []
    diffusion, sampling = {}, {}
    for path, cfg in zip(paths, cfgs):
        if cfg.clip.model_name != clip_cfg.model_name:
            raise ValueError(
                f"{path} is conditioned on CLIP {cfg.clip.model_name}, the first config on "
                f"{clip_cfg.model_name}: a cascade shares one CLIP"
            )
        if cfg.stage == "prior":
            prior, name = cfg.prior.build(clip), "prior"
        elif cfg.stage == "decoder":
            decoder, name = cfg.decoder.build(clip), "decoder"
        else:
            ups.append(cfg.upsampler.build())
            name = f"sr{cfg.upsampler.sample_size}"
        diffusion[name], sampling[name] = cfg.diffusion, cfg.sampling
    if decoder is None:
        raise ValueError("--sample needs a decoder config among the stage configs")
    ups.sort(key=lambda u: u.config.sample_size)
    return UnCLIPPipeline(clip, prior, decoder, ups, diffusion=diffusion, sampling=sampling)


def measure_sampling(
    sources: list[Union[str, Path]],
    batch: int = 1,
    steps: int = 2,
    dtype: torch.dtype = torch.float16,
    prompt: str = "a red circle above a blue square",
    offload: bool = False,
    attention_slicing: Union[str, int, None] = None,
    autocast_dtype="auto",
) -> SampleMeasure:
    """Sample ``batch`` images of ``prompt`` through the pipeline ``sources`` describe (one pipeline
    folder, or stage configs) on fake ``cuda:0`` tensors in ``dtype``, ``steps`` per stage.
    ``offload``: with :meth:`~unclip.pipeline.UnCLIPPipeline.enable_model_cpu_offload` (weights
    wait on the CPU; each component is on the GPU only while it runs). ``attention_slicing``:
    :meth:`~unclip.pipeline.UnCLIPPipeline.enable_attention_slicing`'s argument. Floating tensors
    take ``dtype`` except those the pipeline keeps in float32 (:mod:`unclip.utils.precision`).
    ``autocast_dtype``: the pipeline's :attr:`~unclip.pipeline.UnCLIPPipeline.autocast_dtype`
    (``"auto"``, a loaded pipeline's default, is float16 autocast over float32 weights on a GPU
    and none over half-precision ones); the measure records the autocast state each network
    saw."""
    from unclip.pipeline.pipeline import UnCLIPPipeline

    paths = [Path(s) for s in sources]
    if batch < 1 or steps < 1:
        raise ValueError(f"batch and steps must be >= 1, got {batch} and {steps}")
    device = torch.device("cuda", 0)
    fake = _FakeCUDA()
    mem = MemoryTracker("cuda")
    folder = len(paths) == 1 and paths[0].is_dir()
    pipe = UnCLIPPipeline.from_pretrained(paths[0]) if folder else None
    if pipe is not None:  # real weights become fake ones: only their shapes and dtypes matter
        for m in pipe.modules().values():
            _replace_tensors(m, fake.from_tensor, attributes=True)
    with fake, mem:
        if pipe is None:
            pipe = _pipeline_from_configs(paths)
        home = torch.device("cpu") if offload else device
        kept = _kept_fp32(pipe.modules(), dtype)

        def convert(t):
            if not t.is_floating_point():
                return t.to(home)
            return t.to(home, torch.float32 if id(t) in kept else dtype)

        for m in pipe.modules().values():
            # floating tensors in the sampling dtype, on the GPU (or waiting on the CPU)
            _replace_tensors(m, convert)
        pipe._null_text = None
        # read back: the tensors that are float32 under a half dtype
        fp32_tensors = sorted(
            f"{comp}.{name}"
            for comp, m in pipe.modules().items()
            for name, t in [*m.named_parameters(), *m.named_buffers()]
            if dtype != torch.float32 and t.dtype == torch.float32
        )
        pipe.autocast_dtype = autocast_dtype
        if attention_slicing is not None:
            pipe.enable_attention_slicing(attention_slicing)
        if offload:
            pipe.enable_model_cpu_offload(device=device)
        weights = mem.current if not offload else _tensor_bytes(pipe.modules().values())
        stages = list(pipe.stage_names)
        peaks: dict[str, int] = {}
        resident: dict[str, set] = {}

        def record(_pipe, _step, _t, kwargs):
            name = kwargs["stage"]
            peaks[name] = max(peaks.get(name, 0), mem.peak)
            mem.reset_peak()
            on_gpu = {
                c for c, m in pipe.modules().items() if any(p.is_cuda for p in m.parameters())
            }
            resident[name] = resident.get(name, set()) | on_gpu
            return None

        network_autocast: dict[str, Optional[str]] = {}

        def seen(name):
            def hook(module, args):
                on = torch.is_autocast_enabled("cuda")
                dt = dtype_name(torch.get_autocast_dtype("cuda")) if on else None
                network_autocast.setdefault(name, dt)

            return hook

        nets = pipe.denoisers()
        hooks = [net.register_forward_pre_hook(seen(n)) for n, net in nets.items() if n != "prior"]
        if pipe.prior is not None:
            # the priors' samplers call parts of the transformer (a diffusion prior its blocks,
            # UnCLIPPrior.conditioned; an autoregressive one its start and step), not its forward:
            # the first of its linear layers to run reports
            hooks += [
                m.register_forward_pre_hook(seen("prior"))
                for m in nets["prior"].modules()
                if isinstance(m, torch.nn.Linear)
            ]
        cpu_steps = _CPUSteps(fake)
        mem.reset_peak()
        # the pipeline times each stage, waiting for the GPU: there is no GPU to wait for; and
        # torch.autocast("cuda") turns itself off where no CUDA is available, and refuses bf16
        # where the device cannot run it, which here only means that the tensors are fake (the
        # plan is for a GPU that can)
        with (
            torch.no_grad(),
            mock.patch("torch.cuda.synchronize", lambda *a, **k: None),
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", lambda: False),
            mock.patch("torch.cuda.is_bf16_supported", lambda *a, **k: True),
            cpu_steps.patch(),
        ):
            out = pipe(
                prompt,
                num_images_per_prompt=batch,
                sampling={name: {"steps": steps} for name in stages},
                output_type="pt",
                progress=False,
                callback_on_step_end=record,
            )
        for h in hooks:
            h.remove()
        images = out.images
        # what the sampling ran under, read before offload ends and the pipeline is on the CPU
        autocast = dtype_name(pipe.autocast_dtype)
        params = {
            name: sum(p.numel() for p in m.parameters()) for name, m in pipe.modules().items()
        }
        if offload:
            pipe.disable_model_cpu_offload()
    return SampleMeasure(
        stages=stages,
        params=params,
        weights=weights,
        stage_peaks=peaks,
        peak=max([0 if offload else weights, *peaks.values()]),
        batch=batch,
        dtype=dtype_name(dtype),
        output_shape=list(images.shape),
        offload=offload,
        resident={k: sorted(v) for k, v in resident.items()},
        fp32_tensors=fp32_tensors,
        attention_slicing=None if attention_slicing is None else str(attention_slicing),
        autocast=autocast,
        network_autocast=network_autocast,
        cpu_schedulers=cpu_steps.names,
    )


def format_sampling(m: SampleMeasure, gpu_memory: Optional[int] = None) -> str:
    from unclip.train.strategies import CUDA_CONTEXT, FRAGMENTATION, GiB

    lines = [
        f"fake-CUDA sampling passed: {' → '.join(m.stages)} at {m.dtype}"
        + (f" with {m.autocast} autocast" if m.autocast else "")
        + f", {m.batch} image(s) of shape {m.output_shape[1:]} on cuda:0, no device or dtype "
        "mismatch"
        + (", per-stage model offload" if m.offload else "")
        + (f", attention slicing {m.attention_slicing}" if m.attention_slicing else ""),
        "parameters: "
        + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in m.params.items() if v)
        + f"; weights {m.weights / GiB:.2f} GiB"
        + (" (on the CPU; one component on the GPU at a time)" if m.offload else " on the GPU"),
        "peak per stage (weights included), GiB: "
        + ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.stage_peaks.items()),
        f"peak {m.peak / GiB:.2f} GiB",
        "autocast inside the networks: "
        + ", ".join(f"{k} {v or 'off'}" for k, v in m.network_autocast.items()),
    ]
    if m.cpu_schedulers:
        lines.append(
            f"steps of {', '.join(m.cpu_schedulers)} ran on real CPU tensors (fake tensors cannot "
            "run them): their per-sample history is not counted"
        )
    if gpu_memory is not None:
        budget = (gpu_memory - CUDA_CONTEXT) / (1 + FRAGMENTATION)
        fits = "fits" if m.peak <= budget else "does not fit"
        lines.append(f"{fits} on one GPU of {gpu_memory / GiB:.0f} GiB (usable {budget / GiB:.1f})")
    return "\n".join(lines)
