"""The training loop shared by every stage: one visible step, the same for all of them.

A stage supplies a *task* (:class:`Task`): its loss on one micro-batch, and optionally a grid of
samples. :class:`TrainLoop` does the rest, as guided-diffusion's ``TrainLoop``::

    run:       next micro-batches -> run_step -> step += 1 -> log_step -> samples -> checkpoint
    run_step:  forward_backward -> optimize -> update_ema

* the ``Accelerator`` (mixed precision: ``auto`` = fp16 with loss scaling on GPU, bf16 on a CPU with
  native bf16, else fp32; gradient accumulation; trackers) and the strategy the launch chose
  (DDP with an optional PowerSGD hook that survives fp16 overflows, FSDP2, DeepSpeed:
  :mod:`unclip.train.distributed`; checkpoints hold whole tensors under each:
  :mod:`unclip.train.state_files`);
* AdamW (or 8-bit AdamW, SOAP, KL-Shampoo: ``train.optimizer``, :mod:`unclip.train.optimizers`)
  and a LambdaLR schedule: linear warmup to ``lr`` then cosine decay to the ``min_lr`` floor;
* optional initial weights (``init_weights``: fine-tune an exported component), and a LoRA adapter
  of them (``lora``: only the adapter trains and is exported; :mod:`unclip.train.lora`);
* gradient clipping at ``max_grad_norm``, EMA weights (``diffusers.training_utils.EMAModel``);
* optionally DALL-E's per-resblock gradient scaling (``resblock_grad_scaling``,
  :mod:`unclip.train.grad_scaling`): each UNet residual block's scale is divided out of its
  gradients before clipping and adapted after each step;
* non-finite losses/gradients: the optimizer step is skipped and counted; after
  ``max_consecutive_nonfinite`` in a row training stops with a clear message (after a checkpoint);
* checkpoints every ``checkpoint_every`` steps and at the end, keeping the last ``keep_last``:
  safetensors and JSON only, written to a temporary folder with a manifest (sizes, SHA-256) last and
  renamed (:mod:`unclip.train.checkpoint`); exact resume (model, optimizer, LR schedule, EMA, grad
  scaler, RNG and data position) with ``--resume latest`` (the newest intact checkpoint; damaged
  ones are skipped with a warning) or a checkpoint path (checked; a damaged one is an error);
* a run's ``output_dir`` is its own: a folder holding files is refused unless the run resumes
  (``--resume``) or starts afresh (``overwrite``: the old run's files are removed first);
* a full disk while writing a checkpoint or the export stops the run with a one-line
  :class:`~unclip.train.checkpoint.DiskFullError`; the last intact checkpoint is kept;
* per-sample randomness: every sample's noise, timestep and condition dropout come from a
  ``torch.Generator`` seeded by ``(seed, rank, sample number)``
  (:func:`unclip.pipeline_utils.sample_seed`), so results do not depend on how samples are grouped
  into micro-batches and resume is exact;
* logging: tqdm (loss, samples/s), ``metrics.jsonl`` and Accelerate trackers;
* export: ``<output_dir>/final/<component>`` with the EMA weights, each folder written to a
  temporary folder and renamed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Optional, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from diffusers.training_utils import EMAModel
from safetensors import SafetensorError
from tqdm.auto import tqdm

from unclip.diffusion.config import diffusion_to_save
from unclip.pipeline.folders import STAGE_META_FILE, stage_meta
from unclip.sampling.settings import sampling_to_save
from unclip.sampling.utils import sample_seed
from unclip.train import checkpoint as ckpt
from unclip.train import distributed as dist_utils
from unclip.train import state_files
from unclip.train.checkpoint import CheckpointError, DiskFullError
from unclip.train.grad_scaling import ResblockGradScaler
from unclip.train.optimizers import PRECONDITIONED, make_optimizer
from unclip.train.repa import exported_model, exported_state
from unclip.utils.config import save_config, to_dict
from unclip.utils.precision import resolve_autocast

__all__ = [
    "TrainLoop",
    "Task",
    "warmup_cosine",
    "sample_generators",
    "NonFiniteError",
    "STAGE_META_FILE",
    "load_initial_weights",
    "auto_mixed_precision",
    "CheckpointError",
    "DiskFullError",
    "RUN_FILES",
]

logger = logging.getLogger("unclip.train")


def load_initial_weights(model: torch.nn.Module, path, partial: bool = False) -> Path:
    """Load a component's weights (a component folder, or a ``.safetensors`` file) into ``model``.

    Every tensor of the model must be present with the same shape (the configs must match); dtypes
    are converted (e.g. fp16 shipped weights into an fp32 model). With ``partial`` the tensors whose
    name and shape fit are loaded and the model's others keep their fresh initialisation (a changed
    or added part, e.g. a decoder given its own caption transformer); what was left out is logged,
    and weights of which nothing fits are an error. Returns ``path``."""
    from safetensors.torch import load_file

    from unclip.io.weights import load_weights, state_mismatch

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"init_weights: {path} does not exist; give a component folder or a .safetensors file"
        )
    state = load_weights(path, "init_weights") if path.is_dir() else load_file(str(path))
    state = exported_state(state)  # a repa checkpoint's model.safetensors: the decoder's part
    own = model.state_dict()
    problems = state_mismatch(
        {k: tuple(v.shape) for k, v in own.items()},
        {k: tuple(v.shape) for k, v in state.items()},
        "in the model",
    )
    if problems and not partial:
        raise ValueError(
            f"init_weights {path} do not fit this model: {problems}"
            ". The stage config must describe the same architecture (and CLIP) as the weights"
            " (or set train.init_weights_partial to load only the tensors that fit)."
        )
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    for prefix, module in model.named_modules():
        # tensors that only mean something together (e.g. the AR prior's quantiser fit and its
        # "fitted" flag): all of them load, or none and the module keeps its fresh state
        for group in getattr(module, "_load_together", ()):
            keys = [f"{prefix}.{name}" if prefix else name for name in group]
            if not all(k in fits for k in keys):
                for k in keys:
                    fits.pop(k, None)
    if not fits:
        raise ValueError(
            f"init_weights {path}: no tensor fits this model by name and shape ({problems}); "
            "are they weights of this stage?"
        )
    if problems:
        fresh = sum(own[k].numel() for k in own if k not in fits)
        logger.warning(
            "init_weights %s loaded partially: %d of the model's %d tensors; %s parameters keep "
            "their fresh initialisation (%s)",
            path,
            len(fits),
            len(own),
            f"{fresh:,}",
            problems,
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in fits.items()}, strict=not problems)
    return path


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite losses or gradients."""


def warmup_cosine(step: int, *, warmup: int, total: int, base_lr: float, min_lr: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from ``base_lr`` to
    ``min_lr``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    lr = min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))
    return lr / base_lr


def auto_mixed_precision(requested: str, gpu: bool | None = None) -> str:
    """Resolve ``mixed_precision: auto``: fp16 (with loss scaling) on a GPU, bf16 on a CPU that runs
    it natively, else ``no`` (fp32): the rule of :func:`unclip.precision.resolve_autocast`, which
    sampling follows too. ``gpu``: whether the training runs on a GPU (default: whether one is
    available). Other values are returned unchanged."""
    if requested != "auto":
        return requested
    gpu = torch.cuda.is_available() if gpu is None else gpu
    dtype = resolve_autocast("auto", "cuda" if gpu else "cpu")
    return {torch.float16: "fp16", torch.bfloat16: "bf16", None: "no"}[dtype]


def sample_generators(seed: int, rank: int, start: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample ``start … start+count-1`` of ``rank`` in a run seeded
    ``seed``."""
    return [
        torch.Generator().manual_seed(sample_seed(seed, rank, i))
        for i in range(start, start + count)
    ]


class Task(Protocol):
    """What a stage supplies to :class:`TrainLoop`.

    ``name``: the component this stage trains (``prior``, ``decoder``, ``sr64``, ``clip``).
    ``loss(model, batch, generators)``: the scalar loss of one micro-batch; ``model`` is the
    prepared (possibly DDP-wrapped) model, ``generators`` one ``torch.Generator`` per sample of
    ``batch``.

    Optional methods: ``sample_grid(model, batch) -> PIL.Image`` (called on the main process with
    the EMA weights in place, in eval mode, every ``train.sample_every`` steps; ``batch`` is the
    first micro-batch of the run), ``after_optimizer_step(model)`` (after each optimizer step
    that was taken, before the EMA update) and ``log_metrics() -> dict`` (the task's own figures
    since the last log, e.g. one term of its loss, logged beside the loss every
    ``train.log_every`` steps).
    """

    name: str

    def loss(self, model: torch.nn.Module, batch: dict, generators: list) -> torch.Tensor: ...


def batch_size_of(batch: dict) -> int:
    """Number of samples in a collated batch (every batch carries its captions)."""
    return len(batch["caption"])


#: what a run writes in its ``output_dir`` (removed by ``overwrite``; other files are left alone)
RUN_FILES = (
    "checkpoints",
    "final",
    "samples",
    "logs",
    "config.yaml",
    "metrics.jsonl",
    "rank_checksums.json",
    "retrieval.json",
)


class _RunState:
    """Counters saved in every checkpoint (the data position among them)."""

    def __init__(self):
        self.step = 0  # optimizer steps attempted
        self.samples = 0  # samples consumed by this rank
        self.skipped_data = 0  # bad samples skipped (this rank)
        self.nonfinite = 0  # optimizer steps skipped for non-finite loss/grad
        self.consecutive_nonfinite = 0

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        for key in vars(self):
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"run state '{key}' must be a count, got {value!r}")
            setattr(self, key, value)


class TrainLoop:
    """Accelerator, optimizer, schedule, EMA, checkpoints and logging for one run (see module doc).

    Usage::

        loop = TrainLoop(cfg, resume="latest")  # or overwrite=True to replace an earlier run
        model = loop.prepare(build_model())
        finished = loop.run(task, make_batches(..., start=loop.state.samples))
        if finished:
            loop.export("decoder", save_fn, meta)
        loop.finish()

    ``cfg`` is any config with a ``train`` section (:class:`~unclip.train.config.TrainConfig`); the
    whole config is saved beside the run and every checkpoint. ``resume``: ``"latest"`` or a
    checkpoint folder; ``overwrite``: remove an earlier run's files from ``output_dir`` first (a
    folder holding files is refused otherwise).
    """

    def __init__(
        self,
        cfg,
        resume: Optional[str] = None,
        max_steps_this_run: Optional[int] = None,
        overwrite: bool = False,
    ):
        self.cfg = cfg
        if max_steps_this_run is not None and max_steps_this_run < 1:
            raise ValueError(f"--max-steps-this-run must be >= 1, got {max_steps_this_run}")
        if resume and overwrite:
            raise ValueError(
                "--resume and --overwrite exclude each other: resume the run, or replace it"
            )
        self.max_steps_this_run = max_steps_this_run
        t = cfg.train
        t.validate()  # again: the config may have been changed since it was built
        if hasattr(cfg, "data") and hasattr(cfg.data, "validate"):
            cfg.data.validate()
        self.out = Path(t.output_dir)
        mp = auto_mixed_precision(t.mixed_precision)
        # DDP: the gradients are views into the communication buckets (one gradient copy fewer);
        # PowerSGD is registered after prepare (dist_utils.register_powersgd)
        handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
        trackers = [x for x in t.trackers if x]
        # a second run in the same process (tests, notebooks) may use another precision:
        # Accelerate keeps its settings in a process-wide singleton, so start it afresh (keeping the
        # process group)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        # a multi-process launch without GPUs (torchrun/accelerate on CPU) trains with DDP over gloo
        multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        self.accelerator = Accelerator(
            cpu=multi_cpu,
            mixed_precision=mp,
            kwargs_handlers=handlers,
            log_with=trackers or None,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=t.grad_accum_steps, sync_with_dataloader=False
            ),
            project_config=ProjectConfiguration(
                project_dir=str(self.out), logging_dir=str(self.out / "logs")
            ),
        )
        if multi_cpu and dist_utils.env_flag("ACCELERATE_USE_FSDP"):
            dist_utils.use_fsdp_on_cpu(self.accelerator, mp)
        dist_utils.check_strategy(self.accelerator)
        shortfall = dist_utils.launch_shortfall(self.accelerator.num_processes)
        if shortfall:
            logger.warning(shortfall)
        self.strategy = dist_utils.strategy_of(self.accelerator)
        self.sharded = dist_utils.is_sharded(self.accelerator)
        self.mixed_precision = mp
        logger.info("strategy: %s on %d processes", self.strategy, self.accelerator.num_processes)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.state = _RunState()
        self.resume = resume
        self.ema: Optional[EMAModel] = None
        self._saved_step: Optional[int] = None  # the step of the checkpoint on disk, if current
        self.claim_output_dir(overwrite)
        if self.accelerator.is_main_process:
            with ckpt.disk_full_is_an_error(self.out / "config.yaml"):
                self.out.mkdir(parents=True, exist_ok=True)
                save_config(cfg, self.out / "config.yaml")
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
            logging.getLogger("unclip").setLevel(logging.INFO)
        if trackers:
            self.accelerator.init_trackers("unclip", config=_flat(cfg))

    # ------------------------------------------------------------------ setup
    def claim_output_dir(self, overwrite: bool) -> None:
        """Refuse an ``output_dir`` that already holds files unless this run resumes; with
        ``overwrite``, remove the earlier run's files (:data:`RUN_FILES`) first. Every process
        looks before any writes."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise ValueError(f"train.output_dir {out} is a file; choose a folder")
        held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if held and not self.resume and not overwrite:
            raise ValueError(
                f"train.output_dir {out} already holds files ({', '.join(held[:4])}"
                f"{', ...' if len(held) > 4 else ''}): continue that run with --resume latest, "
                "or replace it with --overwrite"
            )
        self.accelerator.wait_for_everyone()
        if overwrite and held and self.accelerator.is_main_process:
            for name in RUN_FILES:
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            logger.info("--overwrite: removed the earlier run's files from %s", out)
        self.accelerator.wait_for_everyone()

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def prepare(
        self,
        model: torch.nn.Module,
        no_weight_decay: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    ) -> torch.nn.Module:
        """Initial weights if given, optimizer, schedule, EMA, checkpoint registration, then resume
        if asked. ``no_weight_decay(name, param)``: parameters exempt from weight decay (default:
        those with fewer than 2 dimensions: biases, norms). Returns the wrapped model."""
        t = self.cfg.train
        if t.init_weights:  # into the exported network, not a training-only head around it
            src = load_initial_weights(
                exported_model(model), t.init_weights, partial=t.init_weights_partial
            )
            logger.info("initial weights from %s", src)
        if getattr(t, "lora", None) is not None:  # freezes the base: the optimizer sees the adapter
            from unclip.train.lora import add_training_adapter

            add_training_adapter(model, t)
        self.optimizer = self.make_optimizer(model, no_weight_decay)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_cosine(
                s, warmup=t.warmup_steps, total=t.max_steps, base_lr=t.lr, min_lr=t.min_lr
            ),
        )
        dist_utils.fit_fsdp_wrapping(self.accelerator, model)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        self.powersgd = None
        if t.powersgd_rank > 0 and self.sharded:
            logger.warning("train.powersgd_rank applies to DDP only: off under %s", self.strategy)
        if t.powersgd_rank > 0 and self.strategy == "ddp":
            self.powersgd = dist_utils.register_powersgd(
                self.model, self.accelerator, t.powersgd_rank, t.powersgd_start_step
            )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.resblock_scaler = None
        if t.resblock_grad_scaling:
            if self.sharded:
                raise ValueError(
                    f"train.resblock_grad_scaling runs unsharded (single process or DDP); "
                    f"{self.strategy} splits the gradients it rescales across processes"
                )
            self.resblock_scaler = ResblockGradScaler(self.unwrapped)
        if (
            t.ema
            and self.strategy == "deepspeed"
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            raise ValueError(
                "train.ema with DeepSpeed ZeRO-3 is not supported (each process holds empty "
                "placeholders of the weights to copy); use FSDP (the EMA is sharded with the "
                "weights) or ZeRO-2, or set train.ema=false"
            )
        if t.ema:
            # the shadow copies are made from the parameters where they live after prepare (the
            # GPU), so EMA.step never mixes devices; they are fp32 whatever the parameters' dtype
            self.ema = dist_utils.shadow_in_fp32(
                EMAModel(
                    self.trainable, decay=t.ema_decay, use_ema_warmup=t.ema_warmup, power=3 / 4
                )
            )
        if self.resume:
            self.load_checkpoint(self.resume)
        return self.model

    def make_optimizer(
        self,
        model: torch.nn.Module,
        no_weight_decay: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    ) -> torch.optim.Optimizer:
        """``train.optimizer`` over the trainable parameters in two groups: weight decay, and none
        for those ``no_weight_decay(name, param)`` names (default: fewer than 2 dimensions)."""
        t = self.cfg.train
        exempt = no_weight_decay or (lambda name, p: p.ndim < 2)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if not exempt(n, p)], "weight_decay": t.weight_decay},
            {"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0},
        ]
        if t.optimizer in PRECONDITIONED and self.sharded:
            raise ValueError(
                f"train.optimizer={t.optimizer} runs unsharded (single process or DDP): its "
                f"Kronecker factors cover whole parameters, which {self.strategy} splits across "
                "processes; use train.optimizer=adamw there"
            )
        return make_optimizer(
            t.optimizer,
            groups,
            lr=t.lr,
            betas=t.adam_betas,
            eps=t.adam_eps,
            precondition_frequency=t.precondition_frequency,
            shampoo_beta=t.shampoo_beta,
            max_precond_dim=t.max_precond_dim,
            precondition_1d=t.precondition_1d,
            compile=t.optimizer_compile,
        )

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def generators(self, count: int) -> list[torch.Generator]:
        """Per-sample generators for the next ``count`` samples of this rank (advances the data
        position)."""
        gens = sample_generators(self.cfg.train.seed, self.rank, self.state.samples, count)
        self.state.samples += count
        return gens

    # ------------------------------------------------------------------ the loop
    def run(self, task: Task, batches: Iterable[dict]) -> bool:
        """Train ``task`` on ``batches`` until ``train.max_steps`` (or ``max_steps_this_run`` more
        steps); a checkpoint is written at the end. Returns whether ``max_steps`` was reached."""
        t = self.cfg.train
        it = iter(batches)
        stop_at = t.max_steps
        if self.max_steps_this_run is not None:
            stop_at = min(t.max_steps, self.state.step + self.max_steps_this_run)
        first = None  # the run's first micro-batch: the sample grids show its captions/images
        with self._progress_bar(task.name) as bar:
            while self.state.step < stop_at:
                waited = time.perf_counter()
                micro = self.next_micro_batches(it)
                self._data_wait += time.perf_counter() - waited
                first = first or micro[0]
                loss = self.run_step(task, micro)
                self.state.step += 1
                bar.update(1)
                self.log_step(loss, bar, task)
                if t.sample_every and self.state.step % t.sample_every == 0:
                    self.save_samples(task, first)
                if t.checkpoint_every and self.state.step % t.checkpoint_every == 0:
                    self.checkpoint()
                self.stop_if_nonfinite()
        self.checkpoint()
        finished = self.state.step >= t.max_steps
        if not finished:
            logger.info(
                "stopped at step %d of %d; resume with --resume latest",
                self.state.step,
                t.max_steps,
            )
        return finished

    def next_micro_batches(self, it: Iterator[dict]) -> list[dict]:
        """The ``grad_accum_steps`` micro-batches of the next optimizer step (bad samples the data
        source skipped are counted)."""
        micro = [next(it) for _ in range(self.cfg.train.grad_accum_steps)]
        self.state.skipped_data += sum(int(b.get("skipped", 0)) for b in micro)
        return micro

    def run_step(self, task: Task, micro: list[dict]) -> float:
        """One optimizer step. Returns the mean finite micro-batch loss (NaN if none was finite)."""
        losses = self.forward_backward(task, micro)
        if self.optimize(all(math.isfinite(v) for v in losses)):
            if hasattr(task, "after_optimizer_step"):
                task.after_optimizer_step(self.model)
            self.update_ema()
        finite = [v for v in losses if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else float("nan")

    def forward_backward(self, task: Task, micro: list[dict]) -> list[float]:
        """Loss and backward of each micro-batch; Accelerate accumulates the gradients (and syncs
        them across processes at the last one). Returns the micro-batch losses."""
        losses = []
        for batch in micro:
            with self.accelerator.accumulate(self.model):
                loss = task.loss(self.model, batch, self.generators(batch_size_of(batch)))
                losses.append(float(loss.detach()))
                self.backward(loss)
        assert self.accelerator.sync_gradients, "the last micro-batch must sync gradients"
        return losses

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss through Accelerate (loss scaling, accumulation)."""
        self.accelerator.backward(loss)

    def optimize(self, finite_loss: bool) -> bool:
        """Clip the accumulated gradients and take the optimizer step unless a loss (on any process)
        or the gradient is non-finite; advance the LR schedule either way. Returns whether the step
        was taken."""
        if self.resblock_scaler is not None:  # before clipping: the norm is of the true gradients
            reduce = (
                (lambda x: self.accelerator.reduce(x, reduction="sum")) if self.world > 1 else None
            )
            self.resblock_scaler.unscale_(reduce)
        norm = self.accelerator.clip_grad_norm_(self.trainable, self.cfg.train.max_grad_norm)
        flag = torch.tensor([0.0 if finite_loss else 1.0], device=self.device)
        if self.world > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        if isinstance(norm, torch.Tensor):
            norm = dist_utils.gather_full(norm)  # FSDP2: a replicated DTensor
        bad = bool(flag.item() > 0) or (
            norm is not None and not torch.isfinite(torch.as_tensor(norm))
        )
        if self.accelerator.scaler is not None:
            # fp16: the scaler skips steps with inf gradients and adapts its scale
            self.optimizer.step()
            bad = bad or self.optimizer.step_was_skipped
        elif not bad:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_schedule.step()
        if self.resblock_scaler is not None:
            self.resblock_scaler.update()
        if bad:
            self.state.nonfinite += 1
            self.state.consecutive_nonfinite += 1
        else:
            self.state.consecutive_nonfinite = 0
        return not bad

    def update_ema(self) -> None:
        if self.ema is not None:
            self.ema.step(self.trainable)

    def log_step(self, loss: float, bar, task: Optional[Task] = None) -> None:
        """Every ``log_every`` steps and at ``max_steps``: loss, LR, throughput, skip counts and
        the task's ``log_metrics()`` if it has them."""
        t = self.cfg.train
        if not (self.state.step % t.log_every == 0 or self.state.step == t.max_steps):
            return
        now = time.perf_counter()
        elapsed = max(now - self._last_t, 1e-9)
        rate = (self.state.samples - self._last_samples) * self.world / elapsed
        wait_share = min(1.0, self._data_wait / elapsed)
        self._last_t, self._last_samples, self._data_wait = now, self.state.samples, 0.0
        self.log(
            {
                "loss": loss,
                "lr": self.lr_schedule.get_last_lr()[0],
                "samples_per_s": rate,
                # the share of the wall time this process waited for its next batches: near 0
                # when the data keeps up; raise data.num_workers when it does not
                "data_wait_share": wait_share,
                "skipped_data": self.state.skipped_data,
                "nonfinite_steps": self.state.nonfinite,
                **(task.log_metrics() if hasattr(task, "log_metrics") else {}),
            }
        )
        bar.set_postfix(loss=f"{loss:.4f}", sps=f"{rate:.1f}")

    def stop_if_nonfinite(self) -> None:
        """Stop (after a checkpoint) when too many optimizer steps in a row were skipped."""
        n = self.state.consecutive_nonfinite
        if n < self.cfg.train.max_consecutive_nonfinite:
            return
        self.checkpoint()
        raise NonFiniteError(
            f"{n} consecutive optimizer steps had a non-finite loss or gradient (step "
            f"{self.state.step}); lower train.lr, use mixed_precision=bf16/no, or check the data. "
            f"The state at the stop (skipped steps left the weights untouched) is in "
            f"{self.latest_checkpoint()}"
        )

    @contextlib.contextmanager
    def _progress_bar(self, name: str):
        t = self.cfg.train
        bar = tqdm(
            total=t.max_steps,
            initial=self.state.step,
            desc=f"train {name}",
            disable=not (t.progress and self.accelerator.is_local_main_process),
            dynamic_ncols=True,
        )
        self._last_t, self._last_samples = time.perf_counter(), self.state.samples
        self._data_wait = 0.0
        try:
            yield bar
        finally:
            bar.close()

    def log(self, values: dict) -> None:
        values = {k: float(v) for k, v in values.items()}
        self.accelerator.log(values, step=self.state.step)
        if self.accelerator.is_main_process:
            path = self.out / "metrics.jsonl"
            with ckpt.disk_full_is_an_error(path), open(path, "a") as f:
                f.write(json.dumps({"step": self.state.step, **values}) + "\n")

    def trim_metrics(self) -> None:
        """On resume: drop the records ``metrics.jsonl`` holds for steps after the checkpoint (the
        interrupted run logged them; this run logs them again) and a line cut short by a kill."""
        path = self.out / "metrics.jsonl"
        if not (self.accelerator.is_main_process and path.is_file()):
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= self.state.step:
                    keep.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
        tmp = path.with_name(path.name + ".tmp")
        with ckpt.disk_full_is_an_error(path):
            tmp.write_text("".join(keep))
            os.replace(tmp, path)

    # ------------------------------------------------------------------ EMA weights, samples
    @contextlib.contextmanager
    def ema_weights(self):
        """Within the block the model holds the EMA weights (if EMA is on); restored after."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.trainable)
        self.ema.copy_to(self.trainable)
        try:
            yield
        finally:
            self.ema.restore(self.trainable)

    def save_samples(self, task: Task, batch: dict) -> Optional[Path]:
        """``samples/step_XXXXXXXX.png``: the task's sample grid from the EMA weights (main process;
        tasks without a sample grid write nothing)."""
        main = self.accelerator.is_main_process
        # sharded weights: every process runs the model (its forward gathers the shards)
        if not hasattr(task, "sample_grid") or not (main or self.sharded):
            return None
        path = self.out / "samples" / f"step_{self.state.step:08d}.png"
        model = self.unwrapped
        with self.ema_weights(), torch.no_grad(), dist_utils.root_unsharded(model):
            model.eval()
            try:
                # a training head around the network (repa) hides the autocast that Accelerate
                # wraps around the outer forward; the grid samples in the training precision
                with self.accelerator.autocast():
                    grid = task.sample_grid(model, batch)
            finally:
                model.train()
        if not main:
            return None
        with ckpt.disk_full_is_an_error(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            grid.save(path)
        return path

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def latest_checkpoint(self) -> Optional[Path]:
        """The newest completed checkpoint folder (not checked; see :meth:`load_checkpoint`)."""
        done = ckpt.completed_checkpoints(self.ckpt_dir)
        return done[-1] if done else None

    def checkpoint(self) -> None:
        """Save a checkpoint unless the one on disk already holds this step's state."""
        if self._saved_step != self.state.step:
            self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_XXXXXXXX``: every file to ``step_XXXXXXXX.tmp``, the manifest
        last, then rename; then remove all but the newest ``keep_last`` older checkpoints (newer
        ones, left by an earlier run this one resumed before, stay until replaced). A full disk is
        a :class:`DiskFullError`; the partial folder is removed and older checkpoints are kept."""
        acc = self.accelerator
        final = self.ckpt_dir / f"step_{self.state.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        with ckpt.writing(tmp, final):
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            self.write_state(tmp)
            acc.wait_for_everyone()
            if acc.is_main_process:
                save_config(self.cfg, tmp / "config.yaml")
                ckpt.write_manifest(tmp, self.state.step)
                ckpt.replace_folder(tmp, final)
        if acc.is_main_process:
            older = [p for p in ckpt.completed_checkpoints(self.ckpt_dir) if p.name < final.name]
            for old in older[: max(0, len(older) - (self.cfg.train.keep_last - 1))]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        self._saved_step = self.state.step
        return final

    def write_state(self, folder: Path) -> None:
        """The training state as safetensors and JSON (:func:`unclip.train.state_files.write_state`:
        whole tensors under every strategy; every process takes part)."""
        state_files.write_state(self, folder)

    def read_state(self, folder: Path) -> None:
        """Load what :meth:`write_state` wrote (the folder was checked against its manifest)."""
        state_files.read_state(self, folder)

    def checkpoint_to_resume(self, which: str) -> Optional[Path]:
        """The checkpoint ``which`` (``"latest"`` or a folder) names, checked against its manifest.
        ``latest``: the newest intact one (each newer, damaged one is skipped with a warning
        saying why), ``None`` when there is none yet. A damaged checkpoint named explicitly, or
        only damaged ones, is a :class:`CheckpointError`."""
        if which == "latest":
            path, skipped = ckpt.newest_intact(self.ckpt_dir)
            for bad, why in skipped:
                logger.warning("skipping damaged checkpoint %s: %s", bad, why)
            if path is None and skipped:
                bad, why = skipped[0]
                raise CheckpointError(
                    f"no intact checkpoint in {self.ckpt_dir}: all {len(skipped)} are damaged "
                    f"(newest, {bad.name}: {why}); start afresh with --overwrite"
                )
            return path
        path = Path(which)
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint not found: {path}; use --resume latest or a checkpoints/step_* folder"
            )
        if (path / "checkpoints").is_dir():
            raise CheckpointError(
                f"{path} is a run folder, not a checkpoint; use --resume latest or one of its "
                "checkpoints/step_* folders"
            )
        try:
            ckpt.verify(path)
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {exc}; resume another one (--resume latest takes "
                "the newest intact one)"
            ) from None
        return path

    def load_checkpoint(self, which: str) -> None:
        path = self.checkpoint_to_resume(which)
        if path is None:
            logger.info("no checkpoint in %s: starting from scratch", self.ckpt_dir)
            self.trim_metrics()
            return
        try:
            self.read_state(path)
        except (SafetensorError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            # the files are as written (the manifest matched): another config's, or hand-made
            reason = f"{type(exc).__name__}: " + " ".join(str(exc).split())
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded into this run ({reason[:300]}); resume a "
                "checkpoint of this config, or start afresh with --overwrite"
            ) from None
        self._saved_step = self.state.step
        self.trim_metrics()
        logger.info(
            "resumed from %s at step %d (%d samples on this rank)",
            path,
            self.state.step,
            self.state.samples,
        )

    # ------------------------------------------------------------------ export
    def write_folder(self, target: Path, write_fn) -> Path:
        """Main process: ``write_fn(folder)`` writes a temporary folder, which then replaces
        ``target`` (never half-written; a full disk is a :class:`DiskFullError`)."""
        target = Path(target)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with ckpt.writing(tmp, target):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            write_fn(tmp)
            ckpt.replace_folder(tmp, target)
        return target

    def export(self, name: str, save_fn, meta: Optional[dict] = None) -> Path:
        """Write the component folder ``<output_dir>/final/<name>`` with the EMA weights (if any):
        ``save_fn(unwrapped_model, folder)`` writes it, then ``meta`` (if given) goes to
        ``unclip_stage.json`` beside it; written to a temporary folder and renamed."""
        acc = self.accelerator
        acc.wait_for_everyone()
        target = self.out / "final" / name

        def write(folder: Path, model: torch.nn.Module) -> None:
            save_fn(model, folder)
            if meta is not None:
                (folder / STAGE_META_FILE).write_text(json.dumps(meta, indent=2))

        if self.sharded:  # every process gathers; the main one writes a plain copy
            with self.ema_weights():
                state = state_files.full_state_dict(self)
            if acc.is_main_process:
                full = dist_utils.full_copy(exported_model(self.unwrapped), exported_state(state))
                self.write_folder(target, lambda folder: write(folder, full))
        elif acc.is_main_process:
            with self.ema_weights():
                self.write_folder(target, lambda folder: write(folder, self.unwrapped))
        acc.wait_for_everyone()
        return target

    def export_stage(self, name: str, clip) -> Path:
        """Export a diffusion stage: ``final/<name>`` (EMA weights, with the stage's diffusion and
        sampling settings) and its conditioning CLIP as ``final/clip``."""
        cfg = self.cfg
        if getattr(cfg.train, "lora", None) is not None:  # the adapter only: final/<name>_lora
            from unclip.train.lora import export_adapter

            return export_adapter(self, name, clip)
        diffusion = diffusion_to_save(cfg.diffusion)
        meta = stage_meta(cfg.stage, name, diffusion, sampling_to_save(cfg.sampling), clip)
        out = self.export(name, lambda m, p: m.save_pretrained(p, safe_serialization=True), meta)
        if self.accelerator.is_main_process:
            self.write_folder(out.parent / "clip", clip.save_pretrained)
            print(f"exported {name} to {out}")
        return out

    def parameter_checksums(self) -> list[float]:
        """A checksum of the trainable weights from every rank (all equal when DDP is in sync)."""
        whole = [dist_utils.gather_full(p.detach()).double() for p in self.trainable]
        local = torch.stack([p.sum() + p.abs().sum() for p in whole]).sum()
        return [float(x) for x in self.accelerator.gather(local.float().reshape(1).to(self.device))]

    def finish(self) -> None:
        """Check that every rank holds the same weights, log the run's totals, close trackers."""
        sums = self.parameter_checksums()
        if self.accelerator.is_main_process:
            path = self.out / "rank_checksums.json"
            with ckpt.disk_full_is_an_error(path):
                path.write_text(json.dumps(sums))
        if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
            raise RuntimeError(
                f"ranks hold different weights at the end of training: checksums {sums}"
            )
        self.log(
            {"skipped_data_total": self.state.skipped_data, "nonfinite_total": self.state.nonfinite}
        )
        if self.state.skipped_data:
            logger.warning("skipped %d bad samples on rank %d", self.state.skipped_data, self.rank)
        self.accelerator.end_training()


def _flat(cfg) -> dict:
    """The config as ``{"section.key": scalar}`` for the trackers."""
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, (int, float, str, bool)):
            out[prefix] = node
        elif node is not None:
            out[prefix] = str(node)

    walk("", to_dict(cfg))
    return out
