"""Shared Accelerate plumbing for every stage's training loop.

:class:`TrainingRun` owns what is the same for the prior, the decoder and the upsamplers:

* the ``Accelerator`` (mixed precision: ``auto`` = fp16 with loss scaling on GPU, bf16 on a CPU with native bf16, else fp32;
  gradient accumulation; DDP with an optional PowerSGD communication hook; TensorBoard tracker);
* AdamW and a LambdaLR schedule: linear warmup to ``lr`` then cosine decay to the ``min_lr`` floor;
* optional initial weights (``init_weights``: fine-tune an exported component);
* gradient clipping at ``max_grad_norm``, EMA weights (``diffusers.training_utils.EMAModel``);
* non-finite losses/gradients: the optimizer step is skipped and counted; after
  ``max_consecutive_nonfinite`` in a row training stops with a clear message (after a checkpoint);
* checkpoints every ``checkpoint_every`` steps and at the end, written to a temporary folder and renamed
  (never half-written), keeping the last ``keep_last``; exact resume (model, optimizer, LR schedule,
  EMA, grad scaler, RNG and data position) with ``--resume latest`` or a checkpoint path;
* per-sample randomness: every sample's noise, timestep and condition dropout come from a
  ``torch.Generator`` seeded by ``(seed, rank, sample number)``, so results do not depend on how samples
  are grouped into micro-batches and resume is exact;
* logging: tqdm (loss, samples/s), ``metrics.jsonl`` and Accelerate trackers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from diffusers.training_utils import EMAModel
from tqdm.auto import tqdm

from unclip.config import StageConfig, load_config, save_config
from unclip.config import to_dict as _to_dict
from unclip.io import STAGE_META_FILE

__all__ = [
    "TrainingRun",
    "warmup_cosine",
    "sample_generators",
    "stage_argparser",
    "load_stage_config",
    "NonFiniteError",
    "STAGE_META_FILE",
    "load_initial_weights",
]

logger = logging.getLogger("unclip.train")


def load_initial_weights(model: torch.nn.Module, path) -> Path:
    """Load a component's weights (a component folder, or a ``.safetensors`` file) into ``model``.

    Every tensor of the model must be present with the same shape (the configs must match); dtypes are
    converted (e.g. fp16 shipped weights into an fp32 model). Returns ``path``."""
    from safetensors.torch import load_file

    from unclip.io import load_weights

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"init_weights: {path} does not exist; give a component folder or a .safetensors file"
        )
    state = load_weights(path, "init_weights") if path.is_dir() else load_file(str(path))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [
        f"{k}: {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in the model"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        parts = [
            f"{len(missing)} missing (e.g. {missing[:3]})" if missing else "",
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})" if unexpected else "",
            f"{len(wrong)} of another shape (e.g. {wrong[:2]})" if wrong else "",
        ]
        raise ValueError(
            f"init_weights {path} do not fit this model: "
            + "; ".join(p for p in parts if p)
            + ". The stage config must describe the same architecture (and CLIP) as the weights."
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return path


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite losses or gradients."""


def warmup_cosine(step: int, *, warmup: int, total: int, base_lr: float, min_lr: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from ``base_lr`` to ``min_lr``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    lr = min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))
    return lr / base_lr


def native_cpu_bf16() -> bool:
    """True iff oneDNN runs bf16 natively on this CPU (AVX-512 with bf16 support or AMX). Without it,
    bf16 autocast is emulated and much slower than fp32 (a shapes CLIP step on an AVX2-only CPU: 9.8 s against 1.0 s)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def auto_mixed_precision(requested: str, gpu: bool | None = None) -> str:
    """Resolve ``mixed_precision: auto``: fp16 (with loss scaling) on a GPU, bf16 on a CPU that runs it
    natively (:func:`native_cpu_bf16`), else ``no`` (fp32). ``gpu``: whether the training runs on a GPU
    (default: whether one is available). Other values are returned unchanged."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() if gpu is None else gpu:
        return "fp16"
    return "bf16" if native_cpu_bf16() else "no"


def sample_seed(seed: int, rank: int, index: int) -> int:
    """A 63-bit seed for sample number ``index`` of ``rank`` in a run seeded ``seed``."""
    h = hashlib.blake2b(f"{seed}:{rank}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample_generators(seed: int, rank: int, start: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample ``start … start+count-1`` of this rank."""
    return [
        torch.Generator().manual_seed(sample_seed(seed, rank, i))
        for i in range(start, start + count)
    ]


def stage_argparser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("config", help="stage config YAML (see configs/)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.batch_size=16"
    )
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint folder to resume from")
    p.add_argument("--output-dir", default=None, help="overrides train.output_dir")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--max-steps-this-run",
        type=int,
        default=None,
        help="stop (with a checkpoint, without exporting) after this many optimizer steps in this "
        "invocation, e.g. to fit a scheduler's time slot; resume later with --resume latest",
    )
    return p


def load_stage_config(args, stage: tuple[str, ...]) -> StageConfig:
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = load_config(args.config, overrides)
    if cfg.stage not in stage:
        raise ValueError(
            f"{args.config}: stage is {cfg.stage!r} but this command trains {' or '.join(stage)}"
        )
    return cfg


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
        vars(self).update(state)


class TrainingRun:
    """Accelerator, optimizer, schedule, EMA, checkpoints and logging for one stage (see module doc)."""

    def __init__(
        self,
        cfg: StageConfig,
        resume: Optional[str] = None,
        max_steps_this_run: Optional[int] = None,
    ):
        self.cfg = cfg
        if max_steps_this_run is not None and max_steps_this_run < 1:
            raise ValueError("--max-steps-this-run must be >= 1")
        self.max_steps_this_run = max_steps_this_run
        self.finished = False
        t = cfg.train
        self.out = Path(t.output_dir)
        mp = auto_mixed_precision(t.mixed_precision)
        handlers = []
        if t.powersgd_rank > 0:
            handlers.append(
                DistributedDataParallelKwargs(
                    comm_hook=DDPCommunicationHookType.POWER_SGD,
                    comm_state_option={
                        "matrix_approximation_rank": t.powersgd_rank,
                        "start_powerSGD_iter": max(2, t.powersgd_start_step),
                    },
                )
            )
        trackers = [x for x in t.trackers if x]
        # a second run in the same process (tests, notebooks) may use another precision: Accelerate keeps
        # its settings in a process-wide singleton, so start it afresh (the process group is kept)
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
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.state = _RunState()
        self.resume = resume
        self.ema: Optional[EMAModel] = None
        if self.accelerator.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out / "config.yaml")
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
            logging.getLogger("unclip").setLevel(logging.INFO)
        if trackers:
            self.accelerator.init_trackers("unclip", config=_flat(cfg))

    # ------------------------------------------------------------------ setup
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Initial weights if given, optimizer, schedule, EMA, checkpoint registration, then resume if asked.
        Returns the wrapped model."""
        t = self.cfg.train
        if t.init_weights:
            src = load_initial_weights(model, t.init_weights)
            logger.info("initial weights from %s", src)
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": t.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=t.lr,
            betas=tuple(t.adam_betas),
            eps=t.adam_eps,
        )
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_cosine(
                s, warmup=t.warmup_steps, total=t.max_steps, base_lr=t.lr, min_lr=t.min_lr
            ),
        )
        if t.ema:
            self.ema = EMAModel(params, decay=t.ema_decay, use_ema_warmup=t.ema_warmup, power=3 / 4)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.accelerator.register_for_checkpointing(self.lr_schedule, self.state)
        if self.ema is not None:
            self.accelerator.register_for_checkpointing(self.ema)
        if self.resume:
            self.load_checkpoint(self.resume)
        return self.model

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def generators(self, count: int) -> list[torch.Generator]:
        """Per-sample generators for the next ``count`` samples of this rank (advances the data position)."""
        gens = sample_generators(self.cfg.train.seed, self.rank, self.state.samples, count)
        self.state.samples += count
        return gens

    # ------------------------------------------------------------------ the loop
    def steps(self, batches: Iterable[dict]) -> Iterator[list[dict]]:
        """Yield the micro-batches of each optimizer step until ``max_steps``; handles logging/checkpoints.

        Usage::

            for micro_batches in run.steps(batches):
                for batch in micro_batches:
                    with run.accumulate():
                        run.backward(loss_fn(batch))
        """
        t = self.cfg.train
        it = iter(batches)
        bar = tqdm(
            total=t.max_steps,
            initial=self.state.step,
            desc=f"train {self.cfg.stage}",
            disable=not (t.progress and self.accelerator.is_local_main_process),
            dynamic_ncols=True,
        )
        last_t, last_samples = time.perf_counter(), self.state.samples
        stop_at = (
            t.max_steps
            if self.max_steps_this_run is None
            else min(t.max_steps, self.state.step + self.max_steps_this_run)
        )
        try:
            while self.state.step < stop_at:
                micro = []
                for _ in range(t.grad_accum_steps):
                    batch = next(it)
                    self.state.skipped_data += int(batch.get("skipped", 0))
                    micro.append(batch)
                self._losses = []
                self._nonfinite_local = False
                yield micro
                self.state.step += 1
                bar.update(1)
                if self.state.step % t.log_every == 0 or self.state.step == t.max_steps:
                    now = time.perf_counter()
                    rate = (
                        (self.state.samples - last_samples) * self.world / max(now - last_t, 1e-9)
                    )
                    last_t, last_samples = now, self.state.samples
                    self.log(
                        {
                            "loss": self.last_loss,
                            "lr": self.lr_schedule.get_last_lr()[0],
                            "samples_per_s": rate,
                            "skipped_data": self.state.skipped_data,
                            "nonfinite_steps": self.state.nonfinite,
                        }
                    )
                    bar.set_postfix(loss=f"{self.last_loss:.4f}", sps=f"{rate:.1f}")
                if t.checkpoint_every and self.state.step % t.checkpoint_every == 0:
                    self.save_checkpoint()
                if self.state.consecutive_nonfinite >= t.max_consecutive_nonfinite:
                    self.save_checkpoint()
                    raise NonFiniteError(
                        f"{self.state.consecutive_nonfinite} consecutive optimizer steps had a non-finite loss or "
                        f"gradient (step {self.state.step}); lower train.lr, use mixed_precision=bf16/no, or check "
                        f"the data. The state at the stop (skipped steps left the weights untouched) is in {self.latest_checkpoint()}"
                    )
        finally:
            bar.close()
        if not (t.checkpoint_every and self.state.step % t.checkpoint_every == 0):
            self.save_checkpoint()
        self.finished = self.state.step >= t.max_steps
        if not self.finished:
            logger.info(
                "stopped at step %d of %d; resume with --resume latest",
                self.state.step,
                t.max_steps,
            )

    def accumulate(self):
        return self.accelerator.accumulate(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch loss; at the last micro-batch clip, check finiteness and step."""
        if not torch.isfinite(loss.detach()):
            self._nonfinite_local = True
        self._losses.append(float(loss.detach()))
        self.accelerator.backward(loss)
        if not self.accelerator.sync_gradients:
            return
        t = self.cfg.train
        norm = self.accelerator.clip_grad_norm_(self.trainable, t.max_grad_norm)
        flag = torch.tensor([1.0 if self._nonfinite_local else 0.0], device=self.device)
        flag = self.accelerator.reduce(flag, reduction="sum") if self.world > 1 else flag
        bad = bool(flag.item() > 0) or (
            norm is not None and not torch.isfinite(torch.as_tensor(norm))
        )
        if (
            self.accelerator.scaler is not None
        ):  # fp16: the scaler skips inf steps and adapts its scale
            self.optimizer.step()
            bad = bad or self.optimizer.step_was_skipped
        elif not bad:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_schedule.step()
        if bad:
            self.state.nonfinite += 1
            self.state.consecutive_nonfinite += 1
        else:
            self.state.consecutive_nonfinite = 0
            if self.ema is not None:
                self.ema.step(self.trainable)

    @property
    def last_loss(self) -> float:
        vals = [v for v in getattr(self, "_losses", []) if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    def log(self, values: dict) -> None:
        values = {k: float(v) for k, v in values.items()}
        self.accelerator.log(values, step=self.state.step)
        if self.accelerator.is_main_process:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": self.state.step, **values}) + "\n")

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def latest_checkpoint(self) -> Optional[Path]:
        if not self.ckpt_dir.is_dir():
            return None
        done = sorted(
            p for p in self.ckpt_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
        )
        return done[-1] if done else None

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_XXXXXXXX`` atomically (tmp folder, then rename); keep the last K."""
        acc = self.accelerator
        final = self.ckpt_dir / f"step_{self.state.step:08d}"
        tmp = self.ckpt_dir / f"step_{self.state.step:08d}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            save_config(self.cfg, tmp / "config.yaml")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            done = sorted(
                p
                for p in self.ckpt_dir.glob("step_*")
                if p.is_dir() and not p.name.endswith(".tmp")
            )
            for old in done[: -max(1, self.cfg.train.keep_last)]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def load_checkpoint(self, which: str) -> None:
        path = self.latest_checkpoint() if which == "latest" else Path(which)
        if path is None:
            logger.info("no checkpoint in %s: starting from scratch", self.ckpt_dir)
            return
        if not path.is_dir():
            raise FileNotFoundError(
                f"checkpoint not found: {path}; use --resume latest or a checkpoints/step_* folder"
            )
        self.accelerator.load_state(str(path))
        logger.info(
            "resumed from %s at step %d (%d samples on this rank)",
            path,
            self.state.step,
            self.state.samples,
        )

    # ------------------------------------------------------------------ export
    def export(self, name: str, save_fn, meta: dict) -> Path:
        """Write the final component folder ``<output_dir>/final/<name>`` with EMA weights (if any)."""
        acc = self.accelerator
        acc.wait_for_everyone()
        target = self.out / "final" / name
        if acc.is_main_process:
            model = self.unwrapped
            if self.ema is not None:
                self.ema.store(self.trainable)
                self.ema.copy_to(self.trainable)
            try:
                tmp = target.with_name(target.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                save_fn(model, tmp)
                (tmp / STAGE_META_FILE).write_text(json.dumps(meta, indent=2))
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
            finally:
                if self.ema is not None:
                    self.ema.restore(self.trainable)
        acc.wait_for_everyone()
        return target

    def complete(self, name: str, clip) -> int:
        """End the run: if ``max_steps`` was reached, export ``final/<name>`` (EMA weights, with the stage's
        diffusion and sampling settings) and ``final/clip``; then close trackers. Returns the exit code."""
        if self.finished:
            cfg = self.cfg
            meta = {
                "stage": cfg.stage,
                "name": name,
                "diffusion": _to_dict(cfg.diffusion),
                "sampling": _to_dict(cfg.sampling),
            }
            out = self.export(
                name, lambda m, p: m.save_pretrained(p, safe_serialization=True), meta
            )
            if self.accelerator.is_main_process:
                clip.save_pretrained(out.parent / "clip")
                print(f"exported {name} to {out}")
        self.finish()
        return 0

    def parameter_checksums(self) -> list[float]:
        """A checksum of the trainable weights from every rank (all equal when DDP is in sync)."""
        local = torch.stack(
            [p.detach().double().sum() + p.detach().double().abs().sum() for p in self.trainable]
        ).sum()
        return [float(x) for x in self.accelerator.gather(local.float().reshape(1).to(self.device))]

    def finish(self) -> None:
        sums = self.parameter_checksums()
        if self.accelerator.is_main_process:
            (self.out / "rank_checksums.json").write_text(json.dumps(sums))
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


def _flat(cfg: StageConfig) -> dict:
    from unclip.config import to_dict

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
