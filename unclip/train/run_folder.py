"""A run's ``output_dir``: claiming and locking it, checkpoints (save, prune, resume) and export.

:class:`RunFolder` is the part of :class:`~unclip.train.loop.TrainLoop` that deals with files:

* a run's ``output_dir`` is its own: a folder holding files is refused unless the run resumes
  (``--resume``) or starts afresh (``overwrite``: the old run's files are removed first), and
  while a run uses the folder it holds ``run.lock`` (:class:`RunLock`): a second run started in
  the same folder, a ``--resume latest`` among them, is refused with the first one's process id
  and host; the lock of a run that was killed is taken over with a warning naming it. A folder
  that holds only what a launch writes before its first step (:func:`nothing_to_lose`: no
  logged step, sample, checkpoint, export or file of the user's) is a launch that crashed
  early: the same command starts it afresh. A run that fails lets go of its folder at once
  (:func:`releases_folder`);
* checkpoints every ``checkpoint_every`` steps and at the end, keeping the last ``keep_last``:
  safetensors and JSON only, written to a temporary folder with a manifest (sizes, SHA-256) last
  and renamed (:mod:`unclip.train.checkpoint`); exact resume (model, optimizer, LR schedule, EMA,
  grad scaler, RNG and data position) with ``--resume latest`` (the newest intact checkpoint;
  damaged ones are skipped with a warning) or a checkpoint path (checked; a damaged one is an
  error);
* a full disk while writing a checkpoint or the export stops the run with a one-line
  :class:`~unclip.train.checkpoint.DiskFullError`; the last intact checkpoint is kept;
* export: ``<output_dir>/final/<component>`` with the EMA weights, each folder written to a
  temporary folder and renamed.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import gc
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from unclip.diffusion.config import diffusion_to_save
from unclip.pipeline.folders import STAGE_META_FILE, stage_meta
from unclip.sampling.settings import sampling_to_save
from unclip.train import checkpoint as ckpt
from unclip.train import distributed as dist_utils
from unclip.train import state_files
from unclip.train.checkpoint import CheckpointError
from unclip.train.repa import exported_model, exported_state
from unclip.train.task import Task
from unclip.utils.config import save_config

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "LOCK_FILE",
    "RUN_FILES",
    "RunFolder",
    "RunLock",
    "RunState",
    "describe_holder",
    "nothing_to_lose",
    "releases_folder",
    "RELAUNCHABLE",
]

logger = logging.getLogger("unclip.train")

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


#: held by the process that runs in ``output_dir`` (kept, emptied, when the run ends)
LOCK_FILE = "run.lock"

# the locks this process holds, by folder: a run in this process that ended by an exception
# without releasing its folder (a notebook, a test) is taken over by the next one
_HELD: dict[str, RunLock] = {}

_F = TypeVar("_F", bound=Callable[..., Any])


def releases_folder(train: _F) -> _F:
    """Decorate a training entry point (``train_prior(cfg, ...)`` and the like): when it raises,
    the run locks it took are released before the exception propagates. A live Python session
    (a notebook keeps the failed call's frames, and with them the loop, in its last traceback)
    would otherwise hold the folder until it exits, and every other process would be told the
    folder is in use by a run that is long over."""

    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        before = set(map(id, _HELD.values()))
        try:
            return train(*args, **kwargs)
        except BaseException:
            for lock in [lock for lock in _HELD.values() if id(lock) not in before]:
                lock.release()
            raise

    return wrapper  # type: ignore[return-value]


#: what a launch writes in ``output_dir`` before its first step: such a folder is relaunched
RELAUNCHABLE = ("config.yaml", "logs", "checkpoints", "metrics.jsonl")


def nothing_to_lose(folder: Path, held: list[str]) -> bool:
    """Whether ``folder``, holding the entries ``held`` (names, ``run.lock`` left out), holds
    only what a launch writes before its first step, so that starting afresh there loses
    nothing: ``config.yaml``, ``logs`` (the trackers' start), ``checkpoints`` with at most
    partial ``*.tmp`` folders in it, an empty ``metrics.jsonl``. That is what a launch that
    crashed early leaves (a bad data path, a CUDA or launcher error, a kill at start-up), and
    the same command relaunches it. A logged step, a sample grid, a checkpoint (a ``.old`` one
    mid-rename among them), ``final`` or a file of the user's is a run's work: ``--resume`` or
    ``--overwrite`` says what to do with it."""
    if not held or any(name not in RELAUNCHABLE for name in held):
        return False
    metrics = folder / "metrics.jsonl"
    if metrics.is_symlink() or (metrics.exists() and metrics.stat().st_size > 0):
        return False
    ckpts = folder / "checkpoints"
    if ckpts.is_symlink() or (ckpts.exists() and not ckpts.is_dir()):
        return False
    return not ckpts.is_dir() or all(p.name.endswith(".tmp") for p in ckpts.iterdir())


def describe_holder(record: dict) -> str:
    """``process 1234 on host h (since 2024-01-01 12:00:00)`` from a lock's record."""
    since = record.get("started")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    return f"process {record.get('pid', '?')} on host {record.get('host', '?')}{when}"


class RunLock:
    """``<folder>/run.lock``: an exclusive ``flock`` that the kernel drops when its process ends,
    with the holder's process id, host and start time written in it for the messages.

    The file is never removed (removing it would let a run that opened it a moment earlier lock a
    name nobody else sees); a record left in it with the lock free means the holder ended without
    :meth:`release`: it was killed, and the next run takes over.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[dict]:
        """Take the lock. Returns the record of a stale lock taken over (its process is gone),
        else ``None``; a lock held by a running process is a ``ValueError`` naming it."""
        key = str(self.folder.resolve() / LOCK_FILE)  # the folder's, not a planted link's target
        earlier = _HELD.pop(key, None)
        if earlier is not None:  # this process's own, from a run that did not finish
            earlier.release()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            who = describe_holder(holder)
            raise ValueError(
                f"train.output_dir {self.folder} is in use by another run ({who}): wait for it "
                "to end or stop it, or choose another train.output_dir"
            ) from None
        stale = _read_record(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD[key] = self
        atexit.register(self.release)
        return stale or None

    def _open(self) -> int:
        """The lock file, opened for reading and writing, and certainly the run's own: a symbolic
        link is never followed (``O_NOFOLLOW``) and anything but a plain file of this user with
        no other name (a hard link, a FIFO, another user's file) is refused before a byte of it
        is read or written. The record is rewritten in place, so a lock file planted in a shared
        folder as a link to another file would otherwise have that file emptied."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        how = "remove it and start the run again"
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP or self.path.is_symlink():
                raise ValueError(
                    f"{self.path} is a symbolic link (to {os.readlink(self.path)}); a run never "
                    f"follows its lock file anywhere else: {how}"
                ) from None
            raise
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a plain file"
        elif info.st_nlink != 1:
            problem = f"has {info.st_nlink} names (a hard link to another file)"
        elif info.st_uid != os.geteuid():
            problem = f"belongs to another user (uid {info.st_uid})"
        if problem:
            os.close(fd)
            raise ValueError(f"{self.path} {problem}, so it is not this run's lock file: {how}")
        return fd

    def release(self) -> None:
        """Empty the record and drop the lock (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        atexit.unregister(self.release)
        for key, lock in list(_HELD.items()):
            if lock is self:
                del _HELD[key]
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # a full or read-only disk: the next run sees a stale record and takes over
        finally:
            os.close(fd)


def _read_record(fd: int) -> dict:
    """The JSON record of a lock file (``{}`` when empty or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"pid": "?"}  # a record cut short: a holder that died while writing it
    return record if isinstance(record, dict) else {"pid": "?"}


class RunState:
    """Counters saved in every checkpoint (the data position among them)."""

    def __init__(self) -> None:
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


class RunFolder:
    """The file side of :class:`~unclip.train.loop.TrainLoop` (a mixin: it uses the loop's
    ``accelerator``, ``cfg``, ``out``, ``state``, ``resume`` and model)."""

    # set by TrainLoop.__init__
    cfg: Any  # any config with a ``train`` section
    out: Path
    accelerator: Accelerator
    state: RunState
    resume: Optional[str]
    sharded: bool
    rank: int
    trainable: list[torch.nn.Parameter]
    _saved_step: Optional[int]  # the step of the checkpoint on disk, if current
    world: int  # processes
    clock: Callable[[], float]
    lr_schedule: torch.optim.lr_scheduler.LambdaLR
    # the throughput and data-wait figures since the last log (_progress_bar starts them)
    _last_t: float
    _last_samples: int
    _data_wait: float

    if TYPE_CHECKING:
        # TrainLoop's
        @property
        def device(self) -> torch.device: ...

        @property
        def unwrapped(self) -> torch.nn.Module: ...

        def ema_weights(self) -> contextlib.AbstractContextManager: ...

    # ------------------------------------------------------------------ the run folder
    def claim_output_dir(self, overwrite: bool) -> None:
        """Refuse an ``output_dir`` that already holds files unless this run resumes or the files
        are only those of a launch that never checkpointed (:func:`nothing_to_lose`); take the
        folder's lock (:class:`RunLock`: a run still using it is refused); with ``overwrite``, or
        for such a relaunch, remove the earlier run's files (:data:`RUN_FILES`) first. Every
        process looks before any writes; the main process holds the lock."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise ValueError(f"train.output_dir {out} is a file; choose a folder")
        held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
        relaunch = bool(held) and not self.resume and not overwrite and nothing_to_lose(out, held)
        if held and not self.resume and not overwrite and not relaunch:
            raise ValueError(
                f"train.output_dir {out} already holds files ({', '.join(held[:4])}"
                f"{', ...' if len(held) > 4 else ''}): continue that run with --resume latest, "
                "or replace it with --overwrite"
            )
        if self.accelerator.is_main_process:
            self.lock = RunLock(out)
            stale = self.lock.acquire()
            if stale:
                logger.warning(
                    "train.output_dir %s: taking over the lock of %s, which ended without "
                    "releasing it (killed?)",
                    out,
                    describe_holder(stale),
                )
        self.accelerator.wait_for_everyone()
        if (overwrite or relaunch) and held and self.accelerator.is_main_process:
            for name in RUN_FILES:
                path = out / name
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    path.unlink()  # a link itself, never what it points to
                elif path.is_dir():
                    shutil.rmtree(path)
            if relaunch:
                logger.info(
                    "train.output_dir %s held only what a launch that failed before its first "
                    "step leaves (%s): removed it, starting afresh",
                    out,
                    ", ".join(held),
                )
            else:
                logger.info("--overwrite: removed the earlier run's files from %s", out)
        self.accelerator.wait_for_everyone()

    def release_output_dir(self) -> None:
        """Let go of ``output_dir`` (at the end of the run; a process that ends without it, e.g.
        killed, leaves a stale lock that the next run takes over)."""
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()

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
            self.prune_checkpoints(final)
        acc.wait_for_everyone()
        self._saved_step = self.state.step
        return final

    def prune_checkpoints(self, newest: Path) -> None:
        """Remove all but the newest ``keep_last`` checkpoints older than ``newest`` (newer ones,
        left by an earlier run this one resumed before, stay until replaced)."""
        older = [p for p in ckpt.completed_checkpoints(self.ckpt_dir) if p.name < newest.name]
        for old in older[: max(0, len(older) - (self.cfg.train.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)

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

    # ------------------------------------------------------------------ logs, samples, the end
    def log(self, values: dict) -> None:
        values = {k: float(v) for k, v in values.items()}
        self.accelerator.log(values, step=self.state.step)
        if self.accelerator.is_main_process:
            path = self.out / "metrics.jsonl"
            with ckpt.disk_full_is_an_error(path), open(path, "a") as f:
                f.write(json.dumps({"step": self.state.step, **values}) + "\n")

    def save_samples(self, task, batch: dict) -> Optional[Path]:
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
        # the grid's columns are its first micro-batch's first samples, one caption each
        captions = [str(c) for c in batch.get("caption", [])]
        self.send_samples(grid, captions[: getattr(task, "grid_size", len(captions))])
        return path

    def send_samples(self, grid, captions: list[str]) -> None:
        """The sample grid to the run's trackers (TensorBoard: an image and its captions as text;
        W&B: an image captioned with the prompts), at the current step."""
        step = self.state.step
        text = " | ".join(captions)
        for tracker in getattr(self.accelerator, "trackers", []):
            if tracker.name == "tensorboard":
                import numpy as np

                writer = tracker.writer
                writer.add_image("samples", np.asarray(grid), step, dataformats="HWC")
                writer.add_text("samples/captions", text, step)
                writer.flush()
            elif tracker.name == "wandb":
                import wandb

                tracker.log({"samples": wandb.Image(grid, caption=text)}, step=step)

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
        # every rank past its last collective, and the finished step's communication handles
        # freed, before any rank tears the process group down: a gloo peer that closes its
        # sockets while the other still holds pending work can abort that process at exit
        self.accelerator.wait_for_everyone()
        gc.collect()
        self.accelerator.end_training()
        self.release_output_dir()

    def log_step(self, loss: float, bar, task: Optional[Task] = None) -> None:
        """Every ``log_every`` steps and at ``max_steps``: loss, LR, throughput, skip counts and
        the task's ``log_metrics()`` if it has them."""
        t = self.cfg.train
        if not (self.state.step % t.log_every == 0 or self.state.step == t.max_steps):
            return
        now = self.clock()
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
                **(task.log_metrics() if task is not None and hasattr(task, "log_metrics") else {}),
            }
        )
        bar.set_postfix(loss=f"{loss:.4f}", sps=f"{rate:.1f}")

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
        self._last_t, self._last_samples = self.clock(), self.state.samples
        self._data_wait = 0.0
        try:
            yield bar
        finally:
            bar.close()
