"""A :class:`~unclip.train.loop.TrainLoop`'s state in a checkpoint folder, under every strategy.

The files (:mod:`unclip.train.checkpoint` lists them) hold whole tensors whatever the strategy:
under FSDP2 the weights, AdamW moments and EMA shadow are gathered from their shards one tensor at
a time on every process and written by the main one, and on resume each process reads the files
and keeps its own slice. A checkpoint therefore resumes under another strategy or process count
(a random state is missing then, with a warning). Under DeepSpeed the weights are gathered with
``Accelerator.get_state_dict`` and the ZeRO optimizer partitions are not saved: a resume restarts
the AdamW moments.
"""

from __future__ import annotations

import logging
from pathlib import Path

from unclip.train import checkpoint as ckpt
from unclip.train import distributed as dist_utils
from unclip.train.checkpoint import CheckpointError
from unclip.train.optimizers import checkpoint_state

__all__ = ["write_state", "read_state", "full_state_dict", "load_full_state_dict", "data_cursors"]

logger = logging.getLogger("unclip.train")


def full_state_dict(loop) -> dict:
    """The model's whole weights, on CPU, on the main process (``{}`` elsewhere under
    sharding). Every process calls it: gathering shards is collective."""
    if loop.strategy == "deepspeed":
        state = loop.accelerator.get_state_dict(loop.model)
        return state if loop.accelerator.is_main_process else {}
    return dist_utils.gather_state(loop.unwrapped.state_dict(), loop.accelerator.is_main_process)


def load_full_state_dict(loop, state: dict) -> None:
    """Load whole weights (as :func:`full_state_dict` gives them) into the prepared model, each
    process taking its shard."""
    live = loop.unwrapped.state_dict()
    if sorted(live) != sorted(state):
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        raise KeyError(
            f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    dist_utils.load_full_state(live, state)


def full_optimizer_state(loop) -> dict:
    """The optimizer's state dict with whole moment tensors on the main process (every process
    calls it). DeepSpeed's ZeRO state is not gathered: an empty state is saved."""
    main = loop.accelerator.is_main_process
    if loop.strategy == "deepspeed":
        return {"state": {}, "param_groups": []}
    if loop.strategy == "fsdp":
        return dist_utils.optimizer_state_full(loop.optimizer, main)
    return checkpoint_state(loop.optimizer) if main else {}


def write_state(loop, folder: Path) -> None:
    """The training state as safetensors and JSON (see :mod:`unclip.train.checkpoint`): this
    process's random state; on the main process everything else. Sharded weights, moments and
    EMA are gathered to whole tensors first (every process takes part), so the files are the
    same under every strategy."""
    tensors, meta = ckpt.rng_files()
    ckpt.save_tensors(tensors, folder / f"rng_{loop.rank}.safetensors")
    ckpt.write_json(folder / f"rng_{loop.rank}.json", meta)
    main = loop.accelerator.is_main_process
    model = full_state_dict(loop) if loop.sharded else None
    optimizer = full_optimizer_state(loop)
    shadow = {}
    if loop.ema is not None:
        shadow = dist_utils.gather_state(dict(enumerate(loop.ema.shadow_params)), main)
    # per process: its data position, and its own PowerSGD error feedback
    ckpt.write_json(folder / f"data_{loop.rank}.json", loop.data_cursors)
    if loop.powersgd is not None:
        tensors, meta = dist_utils.powersgd_files(loop.powersgd)
        ckpt.save_tensors(tensors, folder / f"powersgd_{loop.rank}.safetensors")
        ckpt.write_json(folder / f"powersgd_{loop.rank}.json", meta)
    if not main:
        return
    from safetensors.torch import save_file, save_model

    if model is None:
        save_model(loop.unwrapped, str(folder / "model.safetensors"))
    else:
        save_file(model, str(folder / "model.safetensors"))
    tensors, meta = ckpt.optimizer_files(optimizer)
    ckpt.save_tensors(tensors, folder / "optimizer.safetensors")
    ckpt.write_json(folder / "optimizer.json", meta)
    if loop.ema is not None:
        ema = loop.ema.state_dict()
        ema.pop("shadow_params")
        ckpt.save_tensors({f"shadow.{i}": t for i, t in shadow.items()}, folder / "ema.safetensors")
        ckpt.write_json(folder / "ema.json", ema)
    scaler = loop.accelerator.scaler
    ckpt.write_json(
        folder / "trainer_state.json",
        {
            "run": loop.state.state_dict(),
            "lr_schedule": loop.lr_schedule.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "resblock_grad_scales": (
                loop.resblock_scaler.state_dict() if loop.resblock_scaler is not None else None
            ),
            "world_size": loop.world,
        },
    )


def read_state(loop, folder: Path) -> None:
    """Load what :func:`write_state` wrote (the folder was checked against its manifest)."""
    from safetensors.torch import load_model

    listed = set(ckpt.read_json(folder / ckpt.MANIFEST)["files"])  # nothing else is opened
    if loop.sharded:
        load_full_state_dict(loop, ckpt.load_tensors(folder / "model.safetensors"))
    else:
        load_model(loop.unwrapped, str(folder / "model.safetensors"), strict=True)
    if loop.strategy == "deepspeed":
        logger.warning(
            "DeepSpeed: the checkpoint holds no ZeRO optimizer state; the AdamW moments "
            "restart (the weights, EMA, schedule and data position are restored)"
        )
    else:
        state = ckpt.optimizer_state(
            ckpt.load_tensors(folder / "optimizer.safetensors"),
            ckpt.read_json(folder / "optimizer.json"),
            loop.optimizer.state_dict(),
        )
        loop.optimizer.load_state_dict(dist_utils.optimizer_state_sharded(loop.optimizer, state))
    if loop.ema is not None:
        if not {"ema.json", "ema.safetensors"} <= listed:
            raise CheckpointError("it has no EMA weights but train.ema is on")
        ema = ckpt.read_json(folder / "ema.json")
        shadow = ckpt.load_tensors(folder / "ema.safetensors")
        if len(shadow) != len(loop.ema.shadow_params):
            raise CheckpointError(
                f"its EMA holds {len(shadow)} tensors, this model {len(loop.ema.shadow_params)}"
            )
        loop.ema.load_state_dict(ema)  # counters (ema.json holds no shadow_params)
        dist_utils.load_full_state(  # into the shadow tensors in place (shards under FSDP)
            dict(enumerate(loop.ema.shadow_params)),
            {i: shadow[f"shadow.{i}"] for i in range(len(loop.ema.shadow_params))},
        )
    trainer = ckpt.read_json(folder / "trainer_state.json")
    loop.state.load_state_dict(trainer["run"])
    loop.lr_schedule.load_state_dict(trainer["lr_schedule"])
    scaler = loop.accelerator.scaler
    if scaler is not None and trainer.get("grad_scaler"):
        scaler.load_state_dict(trainer["grad_scaler"])
    if loop.resblock_scaler is not None:
        if trainer.get("resblock_grad_scales"):
            loop.resblock_scaler.load_state_dict(trainer["resblock_grad_scales"])
        else:
            logger.warning(
                "%s was saved without train.resblock_grad_scaling: the per-resblock gradient "
                "scales start afresh",
                folder,
            )
    loop.data_cursors = {}
    if f"data_{loop.rank}.json" in listed:  # older checkpoints: resume by sample count
        loop.data_cursors = data_cursors(ckpt.read_json(folder / f"data_{loop.rank}.json"))
    read_powersgd(loop, folder, listed)
    rng = f"rng_{loop.rank}"
    if {f"{rng}.safetensors", f"{rng}.json"} <= listed:
        # set when the run starts iterating its batches (TrainLoop.run)
        loop.pending_rng = (
            ckpt.load_tensors(folder / f"{rng}.safetensors"),
            ckpt.read_json(folder / f"{rng}.json"),
        )
    else:
        logger.warning(
            "%s has no random state for rank %d (saved by %s processes): resuming with a "
            "fresh one, so the run will not repeat an uninterrupted one exactly",
            folder,
            loop.rank,
            trainer.get("world_size"),
        )


def data_cursors(saved: dict) -> dict:
    """A process's data position as ``data_<rank>.json`` holds it (``{}``: none) in the form
    :func:`~unclip.train.data.loader.make_batches` takes back: each worker's raw position and, from
    checkpoints that have them, the shard counts with which the streams pass consumed shards
    unopened (without them, the streams list those shards), the shard list's id and the shard
    each worker was reading, which a resume checks the data against."""
    if not saved:
        return {}
    positions = {int(k): int(v) for k, v in saved["positions"].items()}
    out = {"num_workers": int(saved["num_workers"]), "positions": positions}
    if saved.get("shards"):
        out["shards"] = {str(k): [int(x) for x in v] for k, v in saved["shards"].items()}
    if saved.get("shard_list"):
        out["shard_list"] = str(saved["shard_list"])
    if saved.get("heads"):
        out["heads"] = {
            int(k): [str(v[0]), *(int(x) for x in v[1:])] for k, v in saved["heads"].items()
        }
    return out


def read_powersgd(loop, folder: Path, listed: set) -> None:
    """Restore the PowerSGD hook's state (each process its own error feedback and factors): a
    resume without it restarts the error feedback and the factors' warm start, and the run departs
    from an uninterrupted one."""
    if loop.powersgd is None:
        return
    name = f"powersgd_{loop.rank}"
    if not {f"{name}.safetensors", f"{name}.json"} <= listed:
        logger.warning(
            "%s holds no PowerSGD state for rank %d: its error feedback starts afresh, so the run "
            "will not repeat an uninterrupted one exactly",
            folder,
            loop.rank,
        )
        return
    tensors = ckpt.load_tensors(folder / f"{name}.safetensors")
    meta = ckpt.read_json(folder / f"{name}.json")
    dist_utils.load_powersgd(loop.powersgd, tensors, meta, loop.device)
