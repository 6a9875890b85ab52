"""``unclip plan``: one training step of a stage on fake CUDA tensors, and a per-GPU memory plan.

No GPU is needed. The step runs through the project's own training code — the stage's model build
(:func:`~unclip.train.decoder.build_image_model`, :func:`~unclip.train.prior.build_prior_model`),
:meth:`TrainLoop.prepare <unclip.train.loop.TrainLoop.prepare>` (Accelerate with fp16 autocast and
loss scaling, AdamW, EMA), the stage's loss, clipping, the optimizer step and the EMA update — on
PyTorch's ``FakeTensorMode``: every tensor has its shape, dtype and device (``cuda:0``) but no
storage, so a 3.5B-parameter decoder "trains" in seconds on a laptop and any device or dtype
mismatch raises exactly where it would on a GPU.

What a fake tensor cannot do, and what the dry run does instead:

* **read a value** (``loss.item()``, the grad scaler's overflow flag, ``bool(isfinite(norm))``): a
  read returns 0 (``True`` for a boolean), so the step takes the path of a healthy step; AdamW runs
  on the foreach path a GPU takes, in its ``capturable`` mode (its step counter is a tensor on the
  GPU, never read);
* **run the autograd engine on "cuda" without a driver** (pytorch/pytorch#92627):
  :meth:`PlanLoop.backward` runs the real graph's backward formulas with the engine's scheduling
  written in Python (:mod:`unclip.train.plan_backward`), checkpointed blocks recomputed and fused
  attention's backward included; a trained parameter left without a gradient is an error naming
  it.

Every micro-batch of the config's accumulation runs, then the clipping, the optimizer step, the
EMA update and the checkpoint write (the loop's own code; the files' tensor bytes counted, nothing
written).

Memory is counted by :class:`MemoryTracker`: every tensor the step allocates on the device, each
storage rounded up to 512 bytes as the CUDA caching allocator does, freed when its last reference
dies. The plan for ``N`` GPUs and a sharding strategy is then exact arithmetic on the measured parts
(:mod:`unclip.train.strategies`); ``docs/full_scale.md`` states the method's error against real CPU
steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Optional
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from unclip.train.decoder import clip_device
from unclip.train.distributed import fsdp_units
from unclip.train.kandinsky import kandinsky_task, skeleton_parts
from unclip.train.loop import TrainLoop
from unclip.train.plan_backward import (
    autocast_copies,
    check_devices,
    checkpoint_sink,
    fake_backward,
    gpu_attention,
    tensor_inputs_recorded,
)
from unclip.train.plan_build import (
    _build,
    _build_token_family,
    _is_kandinsky,
    _is_token_family,
    _synthetic_batch,
    _trimmed_text_positions,
)
from unclip.utils.precision import dtype_name

__all__ = [
    "MemoryTracker",
    "StepMeasure",
    "PlanLoop",
    "missing_gradients",
    "measure_step",
]

#: the CUDA caching allocator rounds every block up to this many bytes
ALLOC_ROUND = 512


def _round(nbytes: int) -> int:
    return max(ALLOC_ROUND, -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND) if nbytes else 0


class MemoryTracker(TorchDispatchMode):
    """Live bytes of the tensors on ``device_type``: each storage counted once, from the op that
    made it until its last reference dies. ``current`` and ``peak`` in bytes; :meth:`track` adds
    tensors made before the tracker started. Works on real and fake tensors alike."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0
        self.largest = 0  # the largest single storage seen

    def track(self, *tensors) -> None:
        for t in tree_leaves(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            t = getattr(t, "_local_tensor", t)  # an FSDP2 DTensor: its shard holds the storage
            st = t.untyped_storage()
            key = id(st)
            if key in self.live:
                continue
            n = _round(st.nbytes())
            self.live[key] = (weakref.ref(st, partial(self._free, key)), n)
            self.current += n
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, n)

    def resized(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage at its present size: FSDP2 frees and reallocates the gathered
        weights by resizing their storages in place (no op the tracker sees)."""
        st = t.untyped_storage()
        entry = self.live.get(id(st))
        if entry is None:
            self.track(t)
            return
        n = _round(st.nbytes())
        self.live[id(st)] = (entry[0], n)
        self.current += n - entry[1]
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, _ref) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


_ANY = (torch.ops.aten.any.default, torch.ops.aten.any.dim, torch.ops.aten.any.dims)


class _FakeCUDA(FakeTensorMode):
    """Fake tensors whose value reads take a healthy step's path: numbers read 0, a boolean reads
    ``True`` (``x.all()``, ``isfinite(norm)``) unless it came from ``any()`` (``(std <= 0).any()``),
    which reads ``False``. See the module doc."""

    def __init__(self):
        super().__init__()
        self._from_any: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if t.dtype == torch.bool:
                return t not in self._from_any
            return 0.0 if t.is_floating_point() else 0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _ANY:
            self._from_any.add(out)
        return out


@contextlib.contextmanager
def _cuda_reported(count: int = 1) -> Iterator[None]:
    """torch reports ``count`` CUDA devices (Accelerate then picks ``cuda:0``, fp16 autocast and a
    grad scaler). Only around Accelerate's setup: fake tensors must not see a CUDA they would try to
    initialise."""
    with contextlib.ExitStack() as stack:
        for name, value in (
            ("is_available", lambda: True),
            ("device_count", lambda: count),
            ("set_device", lambda device: None),
            ("current_device", lambda: 0),
            ("is_bf16_supported", lambda *a, **k: True),
        ):
            stack.enter_context(mock.patch(f"torch.cuda.{name}", value))
        yield


class PlanLoop(TrainLoop):
    """:class:`TrainLoop` whose backward runs without the autograd engine (see the module doc)."""

    def backward(self, loss: torch.Tensor) -> None:
        acc = self.accelerator
        loss = loss / acc.gradient_accumulation_steps
        if acc.scaler is not None:
            loss = acc.scaler.scale(loss)  # the scaler creates its scale on the loss's device
        held = [loss]
        del loss  # the graph is released node by node (see fake_backward)
        # a checkpointed block's recompute enters CUDA autocast afresh, which torch turns off
        # when it finds no CUDA (and refuses bf16 without a device that has it); on an A100 it
        # is on in either precision
        with (
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", lambda: False),
            mock.patch("torch.cuda.is_bf16_supported", lambda *a, **k: True),
        ):
            fake_backward(held)


def missing_gradients(model: torch.nn.Module) -> list[str]:
    """The trained parameters of ``model`` that backward gave no gradient."""
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


@dataclasses.dataclass
class StepMeasure:
    """What one fake-CUDA training step of a stage measured (bytes on one GPU, one process)."""

    stage: str
    component: str
    params_total: int  # parameters of the trained network
    params_trainable: int
    clip_params: int
    micro_batch: int
    grad_accum_steps: int
    mixed_precision: str
    gradient_checkpointing: bool
    weights: int  # the trained network's parameters and buffers
    clip: int  # the frozen CLIP's weights
    ema: int
    grads: int
    optimizer: int
    activations: int  # live at the end of one micro-batch's forward (saved for backward)
    autocast_copies: int  # half-precision weight copies kept for backward (in activations)
    recompute: int  # the largest checkpointed block's forward, recomputed during backward
    transient: int  # the largest single tensor of the step, twice: an activation and its gradient
    block_weights: int  # the largest FSDP unit's weights (FULL_SHARD gathers one at a time)
    root_weights: int  # weights in no FSDP unit: the root group, gathered for the whole step
    forward_peak: int  # the tracker's peak while the forward ran
    optimizer_peak: int  # the tracker's peak through clipping, the optimizer step and EMA
    param_dtypes: list[str]
    loss_dtype: str
    text_cache: int = 0  # the prior's caption-encoding cache at its budget (train.text_cache_mb)
    forward_flops: int = 0  # one micro-batch's forward (frozen CLIP included), counted per op
    clip_flops: int = 0  # the frozen CLIP's part of it (no backward)
    recompute_flops: int = 0  # what backward's recomputes of checkpointed blocks ran, counted
    # caption positions counted in full that a real batch runs only up to its longest caption
    # (the dry run's tensors hold no values to find it in); 0 where every position runs
    trimmed_text_positions: int = 0
    backward_peak: int = 0  # measured during a micro-batch's backward (before AdamW's moments)
    optimizer_path: str = ""  # which AdamW implementation ran
    checkpoint_files: dict = dataclasses.field(default_factory=dict)  # file → tensor bytes
    checkpoint_peak_extra: int = 0  # device memory the checkpoint write added at its peak

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.checkpoint_files.values())

    @property
    def train_flops_per_sample(self) -> float:
        """The trained network's forward + backward (twice the forward) — the usual 3× rule —
        plus, with gradient checkpointing, backward's recomputes of the checkpointed blocks (as
        far as they ran: PyTorch stops one once it has what backward needs), and the frozen CLIP's
        forward once."""
        trained = self.forward_flops - self.clip_flops
        return (trained * 3 + self.recompute_flops + self.clip_flops) / self.micro_batch

    @property
    def static(self) -> int:
        return self.weights + self.clip + self.text_cache + self.ema + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The step's peak on one GPU without sharding: the static state plus a micro-batch's
        activations, the recomputed block and the backward's transient, or a measured peak
        (forward, backward, optimizer step) if higher."""
        backward = self.static + self.activations + self.recompute + self.transient
        # the measured backward ran before AdamW made its moments (at the first step)
        measured = self.backward_peak + self.optimizer
        return max(backward, self.forward_peak, measured, self.optimizer_peak)


class _FlopCount(TorchDispatchMode):
    """Counts the FLOPs of the ops that reach it (``torch.utils.flop_counter``'s formulas; an op
    without one is decomposed, as ``FlopCounterMode`` does) into every count open in :meth:`count`.

    It sits below the :class:`MemoryTracker`: the tracker sees each op as the step calls it, not
    the decomposition's temporaries, which no real kernel allocates (above it, they made a counted
    backward peak higher than a real step's). ``FlopCounterMode`` itself also attributes FLOPs to
    modules with multi-grad hooks on every module's inputs and outputs, whose reference cycles kept
    checkpointed blocks' recomputed tensors alive until the garbage collector ran."""

    def __init__(self):
        super().__init__()
        self.open: list[list[int]] = []

    @contextlib.contextmanager
    def count(self) -> Iterator[list[int]]:
        """``[flops]`` of the ops run inside the block."""
        total = [0]
        self.open.append(total)
        try:
            yield total
        finally:
            # by identity: two counts holding the same number are equal lists
            self.open = [t for t in self.open if t is not total]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.open:
            return func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func is not torch.ops.prim.device.default:
            with self:  # the decomposition's ops come back here to be counted
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            for total in self.open:
                total[0] += flops
        return out


def _count(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += _round(st.nbytes())
    return total


def measure_step(
    cfg,
    micro_batch: Optional[int] = None,
    device_type: str = "cuda",
    accumulation: Optional[int] = None,
) -> StepMeasure:
    """Run one training step of ``cfg`` (a stage config) on fake tensors and measure its memory.

    ``device_type="cuda"``: fake ``cuda:0`` tensors with the config's mixed precision (``auto`` →
    fp16 with loss scaling); ``"cpu"``: fake CPU tensors (used to check the method against a real
    CPU run). ``micro_batch`` overrides ``data.batch_size``; ``accumulation`` the number of
    micro-batches run (default: ``train.grad_accum_steps``). Raises whatever a GPU would: device and
    dtype mismatches included, and a trained parameter that gets no gradient."""
    from unclip.nets.clip import CLIP
    from unclip.train.optimizers import PRECONDITIONED

    if cfg.train.optimizer in PRECONDITIONED:
        # the plan's step runs AdamW's capturable mode; heavyball's preconditioners (two
        # Kronecker factors and eigenbases per preconditioned dimension) are not modelled
        raise ValueError(
            f"unclip plan measures AdamW's optimizer state; train.optimizer="
            f"{cfg.train.optimizer} is not modelled: plan with train.optimizer=adamw"
        )
    cfg = copy.deepcopy(cfg)
    if micro_batch is not None:
        cfg.data.batch_size = micro_batch
    token_family = _is_token_family(cfg)
    kandinsky = _is_kandinsky(cfg)
    if not token_family and not kandinsky:
        cfg.clip.pretrained = None  # shapes only: nothing is downloaded or read
    cfg.train.init_weights = None
    cfg.train.init_weights_partial = False
    cfg.train.trackers = []
    cfg.train.progress = False
    steps = accumulation or cfg.train.grad_accum_steps
    cfg.train.grad_accum_steps = steps
    # counted at its full budget; measured without it, so that every micro-batch runs the CLIP
    # (the synthetic batches repeat one caption)
    cached = getattr(cfg, "stage", "") == "prior" and not kandinsky  # Kandinsky's prior keeps none
    text_cache = int(cfg.train.text_cache_mb * 2**20) if cached else 0
    cfg.train.text_cache_mb = 0
    if kandinsky:
        # keyed by the images' bytes, which fake tensors do not have; its budget is the user's
        # kandinsky.latent_cache_mb on top of the plan (docs/kandinsky.md)
        cfg.kandinsky.latent_cache_mb = 0
    with (
        _fresh_accelerate_state(),
        torch.random.fork_rng(devices=[]),  # the seed below must not change the caller's RNG
        tempfile.TemporaryDirectory(prefix="unclip-plan-") as tmp,
    ):
        cfg.train.output_dir = tmp
        if device_type == "cuda":
            with _cuda_reported():
                loop = PlanLoop(cfg, overwrite=True)
        else:
            loop = PlanLoop(cfg, overwrite=True)
        # the model is built on the device (as the training commands do); Accelerate's own move
        # would swap fake parameters, which fake tensors do not support
        loop.accelerator.device_placement = False
        fake = _FakeCUDA()
        mem = MemoryTracker(device_type)
        recompute = [0]
        # the FLOPs of the micro-batch being counted (through its backward), and the FLOPs
        # backward's recomputes of checkpointed blocks run
        flops = _FlopCount()
        counter: list[Optional[list[int]]] = [None]
        recompute_flops = [0]
        real_checkpoint = torch.utils.checkpoint.checkpoint

        def measured_checkpoint(fn, *args, **kwargs):
            # a checkpointed block's forward temporaries are what backward recomputes
            start, mem.peak = mem.peak, mem.current
            base = mem.current
            calls = [0]

            def counted(*a, **kw):
                # the first call is the forward, a later one backward's recompute, which PyTorch
                # stops as soon as it has what backward needs: counted as far as it runs
                calls[0] += 1
                if calls[0] == 1 or counter[0] is None:
                    return fn(*a, **kw)
                total = counter[0]
                before = total[0]
                try:
                    return fn(*a, **kw)
                finally:
                    recompute_flops[0] += total[0] - before

            out = real_checkpoint(counted, *args, **kwargs)
            recompute[0] = max(recompute[0], mem.peak - base)
            mem.peak = max(start, mem.peak)
            return out

        with (
            fake,
            flops,  # below the tracker (see _FlopCount)
            mem,
            mock.patch("torch.utils.checkpoint.checkpoint", measured_checkpoint),
            gpu_attention() if device_type == "cuda" else contextlib.nullcontext(),
            tensor_inputs_recorded(),
        ):
            device = torch.device(device_type, 0) if device_type == "cuda" else loop.device
            torch.manual_seed(cfg.train.seed)
            parts = None
            if token_family:  # no CLIP: the caption is BPE ids
                clip = None
            elif kandinsky:  # the folders' architectures with fresh weights
                with torch.device(device):
                    parts = skeleton_parts(cfg)
                clip = parts["clip"]
            else:
                with torch.device(clip_device(cfg, device)):
                    clip = CLIP.from_config(cfg.clip)
            methods = ("encode_text", "encode_image", "layer_features")
            clip_flops = [0] if clip is None else _count_flops_of(clip, methods, flops)
            # the frozen towers (a Kandinsky run builds its parts together: counted by size)
            clip_bytes = _bytes(parts["clip"].model) if parts is not None else mem.current
            if token_family:
                model, task = _build_token_family(cfg, device, loop)
            elif parts is not None:
                model, task = kandinsky_task(cfg, parts, device, loop.mixed_precision)
            else:
                model, task = _build(cfg, clip, device, loop.mixed_precision)
            # the frozen autoencoder a latent decoder's task encodes batches with
            frozen = getattr(task, "movq", None) or getattr(task, "latent_space", None)
            if frozen is not None:
                _count_flops_of(frozen, ("encode",), flops, clip_flops)
            weights = mem.current - clip_bytes
            params = list(model.parameters())
            trainable = [p for p in params if p.requires_grad]
            if device_type == "cuda":
                with _cuda_reported():
                    model = loop.prepare(model)
            else:
                model = loop.prepare(model)
            # no value can be read: the step counter stays a tensor (see the module doc). A GPU
            # runs AdamW's foreach path (torch's default on CUDA; a fake tensor's type would send
            # it to the per-tensor loop); on a CPU, where the capturable mode does not exist, the
            # fused kernel keeps the counter a tensor too
            path = {"foreach": True, "capturable": True} if device_type == "cuda" else {}
            for group in loop.optimizer.param_groups:
                group.update(path or {"fused": True})
            ema = mem.current - clip_bytes - weights
            batch = _synthetic_batch(cfg, clip, cfg.data.batch_size)
            model.train()
            # forward and backward of each micro-batch, measured one at a time
            act, fwd_peak, bwd_peak, copies, largest, loss_dtype = 0, 0, 0, 0, 0, "float32"
            forward_flops: Optional[int] = None
            for _ in range(steps):
                before = mem.current
                mem.reset_peak()
                mem.largest = 0
                with loop.accelerator.accumulate(model):
                    gens = loop.generators(cfg.data.batch_size)
                    clip_flops[0] = 0
                    # FLOPs are the same every micro-batch: counted once
                    counting = forward_flops is None
                    with (
                        autocast_copies(params) as casts,
                        flops.count() if counting else contextlib.nullcontext() as forward,
                    ):
                        loss = task.loss(model, batch, gens)
                    if counting:
                        assert forward is not None  # the counter's list, when counting
                        forward_flops, frozen_flops = forward[0], clip_flops[0]
                    act = max(act, mem.current - before)
                    largest = max(largest, mem.largest)
                    fwd_peak = max(fwd_peak, mem.peak)
                    copies = max(copies, _count([c() for c in casts if c() is not None]))
                    loss_dtype = dtype_name(loss.dtype)
                    mem.reset_peak()
                    held = [loss]
                    del loss
                    with flops.count() if counting else contextlib.nullcontext() as backward:
                        counter[0] = backward
                        loop.backward(held.pop())  # no reference left here to keep the graph
                    counter[0] = None
                    bwd_peak = max(bwd_peak, mem.peak)
            missing = missing_gradients(loop.unwrapped)
            if missing:
                raise RuntimeError(
                    f"{len(missing)} trained parameters got no gradient on {device} "
                    f"(first: {', '.join(missing[:3])}): the loss does not reach them"
                )
            grads = _count([p.grad for p in trainable if p.grad is not None])
            mem.reset_peak()
            before_opt = mem.current
            if loop.optimize(True):
                loop.update_ema()
            opt_peak = mem.peak
            optimizer = mem.current - before_opt + grads  # zero_grad freed the gradients
            mem.reset_peak()
            before_save = mem.current
            with checkpoint_sink() as files:
                loop.save_checkpoint()  # the loop's own code; the sink writes no tensor data
            save_extra = mem.peak - before_save
            check_devices(loop, model, device)
            units = fsdp_units(loop.unwrapped)  # what FSDP would shard unit by unit
            assert forward_flops is not None  # counted in the first of the steps (>= 1)
            measure = StepMeasure(
                stage=getattr(cfg, "stage", task.name),
                component=task.name,
                params_total=sum(p.numel() for p in params),
                params_trainable=sum(p.numel() for p in trainable),
                clip_params=0 if clip is None else sum(p.numel() for p in clip.model.parameters()),
                micro_batch=cfg.data.batch_size,
                grad_accum_steps=steps,
                mixed_precision=loop.mixed_precision,
                gradient_checkpointing=bool(cfg.train.gradient_checkpointing),
                weights=weights,
                clip=clip_bytes,
                text_cache=text_cache,
                ema=ema,
                grads=grads,
                optimizer=optimizer,
                activations=act,
                autocast_copies=copies,
                recompute=recompute[0],
                recompute_flops=recompute_flops[0],
                trimmed_text_positions=_trimmed_text_positions(cfg, clip),
                transient=2 * largest,
                block_weights=max([_bytes(u) for u in units] or [0]),
                root_weights=_bytes(model) - sum(_bytes(u) for u in units),
                forward_peak=fwd_peak,
                optimizer_peak=opt_peak,
                param_dtypes=sorted({dtype_name(p.dtype) for p in params}),
                loss_dtype=loss_dtype,
                forward_flops=forward_flops,
                clip_flops=frozen_flops,
                backward_peak=bwd_peak,
                optimizer_path="foreach (capturable)" if path else "fused",
                checkpoint_files=dict(files),
                checkpoint_peak_extra=save_extra,
            )
        loop.accelerator.end_training()
    return measure


@contextlib.contextmanager
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps the device it chose in a process-wide state: the dry run's fake GPU must
    neither inherit this process's device nor leave its own behind for a real run."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _count_flops_of(obj, methods, flops: _FlopCount, counter=None) -> list[int]:
    """Wrap ``obj``'s ``methods`` so the FLOPs they run are added to the returned counter
    (``counter``, or a new one): frozen networks (the CLIP, an autoencoder) run forward only and
    are counted once, not with the backward's factor."""
    counter = [0] if counter is None else counter
    for name in methods:
        fn = getattr(obj, name)

        def run(*args, _fn=fn, **kwargs):
            with flops.count() as inner:
                out = _fn(*args, **kwargs)
            counter[0] += inner[0]
            return out

        setattr(obj, name, run)
    return counter
