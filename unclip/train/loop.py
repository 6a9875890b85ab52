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
* the run folder (:class:`~unclip.train.run_folder.RunFolder`): ``output_dir`` claimed and
  locked, checkpoints every ``checkpoint_every`` steps and at the end (and at a Ctrl-C, after the
  step in progress), exact resume, export of the EMA weights;
* per-sample randomness: every sample's noise, timestep and condition dropout come from a
  ``torch.Generator`` seeded by ``(seed, rank, sample number)``
  (:func:`unclip.sampling.utils.sample_seed`), so results do not depend on how samples are grouped
  into micro-batches and resume is exact;
* logging: tqdm (loss, samples/s), ``metrics.jsonl`` and Accelerate trackers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from diffusers.training_utils import EMAModel

from unclip._compat import package_getattr
from unclip.sampling.utils import sample_seed
from unclip.train import checkpoint as ckpt
from unclip.train import distributed as dist_utils
from unclip.train.data.batching import cursors_of
from unclip.train.data.loader import make_batches
from unclip.train.fsdp_launch import check_launch, forget_fsdp_on_cpu, parallelism_deferred
from unclip.train.grad_scaling import ResblockGradScaler
from unclip.train.init_weights import load_initial_weights
from unclip.train.launch import launch_shortfall
from unclip.train.optimizers import (
    PRECONDITIONED,
    make_optimizer,
    run_mixed_precision,
    warmup_cosine,
)
from unclip.train.repa import exported_model
from unclip.train.run_folder import RunFolder, RunState
from unclip.train.task import Task, batch_size_of
from unclip.utils.config import save_config, to_dict
from unclip.utils.limits import check_fits

__all__ = [
    "TrainLoop",
    "sample_generators",
    "NonFiniteError",
    "TrainingInterrupted",
]

logger = logging.getLogger("unclip.train")


class NonFiniteError(ValueError):
    """Too many consecutive non-finite losses or gradients: a user error (a learning rate, a
    precision or data to change), reported on one line by the command line."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after its step in progress and a checkpoint; ``resume_hint``: the
    command line says how to resume (:func:`unclip.cli.errors.run_main`)."""

    resume_hint = True


def sample_generators(seed: int, rank: int, start: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample ``start … start+count-1`` of ``rank`` in a run seeded
    ``seed``."""
    return [
        torch.Generator().manual_seed(sample_seed(seed, rank, i))
        for i in range(start, start + count)
    ]


class TrainLoop(RunFolder):
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
            res = cfg.data.resolution  # a batch is assembled in this process's memory first
            check_fits("data.batch_size", cfg.data.batch_size, 12 * res * res, f"{res}px images")
        self.out = Path(t.output_dir)
        # auto follows an Accelerate config's fp16/bf16; an explicit train.mixed_precision wins
        mp = run_mixed_precision(t.mixed_precision)
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
        forget_fsdp_on_cpu()
        # a multi-process launch without GPUs (torchrun/accelerate on CPU) trains with DDP over gloo
        multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        check_launch()
        fsdp_on_cpu = multi_cpu and dist_utils.env_flag("ACCELERATE_USE_FSDP")
        with parallelism_deferred(fsdp_on_cpu):
            self.accelerator = Accelerator(
                cpu=multi_cpu,
                mixed_precision=mp,
                kwargs_handlers=handlers,
                log_with=trackers or None,
                # under FSDP every micro-batch's gradients are reduce-scattered into the fp32
                # shards: skipping the sync would keep whole, unsharded gradients through the
                # accumulation (the size of the weights in the compute dtype) and then sum them
                # across GPUs in half precision (dist_utils.reduce_in_fp32)
                gradient_accumulation_plugin=GradientAccumulationPlugin(
                    num_steps=t.grad_accum_steps,
                    sync_with_dataloader=False,
                    sync_each_batch=dist_utils.env_flag("ACCELERATE_USE_FSDP"),
                ),
                project_config=ProjectConfiguration(
                    project_dir=str(self.out), logging_dir=str(self.out / "logs")
                ),
            )
        if fsdp_on_cpu:
            dist_utils.use_fsdp_on_cpu(self.accelerator, mp)
        dist_utils.check_strategy(self.accelerator)
        dist_utils.reduce_in_fp32(self.accelerator)
        shortfall = launch_shortfall(self.accelerator.num_processes)
        if shortfall:
            logger.warning(shortfall)
        self.strategy = dist_utils.strategy_of(self.accelerator)
        self.sharded = dist_utils.is_sharded(self.accelerator)
        self.mixed_precision = mp
        logger.info("strategy: %s on %d processes", self.strategy, self.accelerator.num_processes)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.state = RunState()
        self.resume = resume
        # the clock of the throughput and data-wait figures (a fake one in tests)
        self.clock: Callable[[], float] = time.perf_counter
        self.ema: Optional[EMAModel] = None
        self._saved_step: Optional[int] = None  # the step of the checkpoint on disk, if current
        # where each data stream of this rank stands (saved in checkpoints): a resumed stream skips
        # to it without decoding what it already read (make_batches(cursors=...))
        self.data_cursors: dict = {}
        # a resumed random state, set when the run's batches are iterated (see run)
        self.pending_rng: Optional[tuple] = None
        self.claim_output_dir(overwrite)
        if self.accelerator.is_main_process:
            with ckpt.disk_full_is_an_error(self.out / "config.yaml"):
                self.out.mkdir(parents=True, exist_ok=True)
                save_config(cfg, self.out / "config.yaml")
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
            logging.getLogger("unclip").setLevel(logging.INFO)
        if trackers:
            self.accelerator.init_trackers("unclip", config=_flat(cfg))

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def batches(self, data, resolution: int, **options):
        """This process's batches of the data section ``data`` at ``resolution``, from where the
        run stands (the samples it consumed and its streams' cursors; :func:`make_batches`)."""
        return make_batches(
            data,
            resolution=resolution,
            seed=self.cfg.train.seed,
            rank=self.rank,
            world_size=self.world,
            start=self.state.samples,
            cursors=self.data_cursors,
            **options,
        )

    def prepare(
        self,
        model: torch.nn.Module,
        no_weight_decay: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    ) -> torch.nn.Module:
        """Initial weights if given, optimizer, schedule, EMA, checkpoint registration, then resume
        if asked. ``no_weight_decay(name, param)``: parameters exempt from weight decay (default:
        those with fewer than 2 dimensions: biases, norms). Returns the wrapped model. A run that
        cannot start (bad initial weights, no intact checkpoint) lets go of its folder."""
        try:
            return self._prepare(model, no_weight_decay)
        except BaseException:
            self.release_output_dir()
            raise

    def _prepare(self, model, no_weight_decay) -> torch.nn.Module:
        t = self.cfg.train
        if t.init_weights:  # into the exported network, not a training-only head around it
            src = load_initial_weights(
                exported_model(model), t.init_weights, partial=t.init_weights_partial
            )
            logger.info("initial weights from %s", src)
        if getattr(t, "lora", None) is not None:  # freezes the base: the optimizer sees the adapter
            from unclip.train.lora import add_training_adapter

            add_training_adapter(model, t)
        optimizer = self.make_optimizer(model, no_weight_decay)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: warmup_cosine(
                s, warmup=t.warmup_steps, total=t.max_steps, base_lr=t.lr, min_lr=t.min_lr
            ),
        )
        dist_utils.fit_fsdp_wrapping(self.accelerator, model)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if self.strategy == "fsdp":  # what FSDP2 really made of the model, not what was asked
            logger.info(dist_utils.describe_fsdp(self.model))
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
        # a resumed random state is set only now: building and starting the data loader draws
        # from the global generator (a DataLoader's base seed), which an uninterrupted run did
        # before its first step, not at the step a checkpoint was taken; dropout draws next
        self.restore_rng()
        stop_at = t.max_steps
        if self.max_steps_this_run is not None:
            stop_at = min(t.max_steps, self.state.step + self.max_steps_this_run)
        first = None  # the run's first micro-batch: the sample grids show its captions/images
        with self._progress_bar(task.name) as bar, self._ctrl_c_at_step_end() as asked:
            while self.state.step < stop_at:
                waited = self.clock()
                micro = self.next_micro_batches(it)
                self._data_wait += self.clock() - waited
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
                if asked():
                    self.checkpoint()
                    raise TrainingInterrupted(
                        f"stopped at step {self.state.step} of {t.max_steps}; its checkpoint is "
                        f"{self.latest_checkpoint()}"
                    )
        self.checkpoint()
        finished = self.state.step >= t.max_steps
        if not finished:
            logger.info(
                "stopped at step %d of %d; resume with --resume latest",
                self.state.step,
                t.max_steps,
            )
        return finished

    @contextlib.contextmanager
    def _ctrl_c_at_step_end(self):
        """Within the block, a first Ctrl-C lets the step in progress finish (a step cut in the
        middle has consumed samples without applying them), then the run checkpoints and stops;
        a second Ctrl-C stops at once. Yields ``asked()``. Single-process runs only: the
        processes of a launch would reach the checkpoint's collectives at different steps."""
        if self.world > 1 or threading.current_thread() is not threading.main_thread():
            yield lambda: False
            return
        asked = []

        def first_ctrl_c(signum, frame):
            asked.append(signum)
            signal.signal(signal.SIGINT, previous)

        # None: a handler set outside Python, which cannot be put back; the default one is
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:
            previous = signal.default_int_handler
        signal.signal(signal.SIGINT, first_ctrl_c)
        try:
            yield lambda: bool(asked)
        finally:
            signal.signal(signal.SIGINT, previous)

    def next_micro_batches(self, it: Iterator[dict]) -> list[dict]:
        """The ``grad_accum_steps`` micro-batches of the next optimizer step (bad samples the data
        source skipped are counted)."""
        micro = [next(it) for _ in range(self.cfg.train.grad_accum_steps)]
        self.state.skipped_data += sum(int(b.get("skipped", 0)) for b in micro)
        for b in micro:  # the data position, not an input of the task
            cursors_of(b, self.data_cursors)
            b.pop("data_cursor", None)
        return micro

    def restore_rng(self) -> None:
        """Set the random state read from the checkpoint resumed (once; a no-op otherwise)."""
        if self.pending_rng is not None:
            ckpt.set_rng_state(*self.pending_rng)
            self.pending_rng = None

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


# names that moved out of this module keep their old import path, with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
