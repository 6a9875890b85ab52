"""LoRA fine-tuning of a stage (``train.lora``): the training side of :mod:`unclip.nets.lora`.

    unclip train-decoder configs/shapes/decoder.yaml train.lora.rank=8 \\
        train.init_weights=unclip/bundled/shapes/decoder data.source=folder data.path=my_images \\
        clip.pretrained=unclip/bundled/shapes/clip --output-dir runs/my_lora

With ``train.lora`` set, :meth:`~unclip.train.loop.TrainLoop.prepare` loads ``train.init_weights``
into the network as usual and then :func:`add_training_adapter` injects the adapter: the base
weights are frozen, so the optimizer, gradient clipping and the EMA see the adapter's parameters
only. Checkpoints hold the whole model (base and adapter) with the optimizer and EMA state as for
any run, so ``--resume`` is exact. At the end :func:`export_adapter` writes
``<output_dir>/final/<stage>_lora`` (the EMA adapter weights, peft's files and ``unclip_lora.json``)
instead of the whole component; ``pipe.load_lora(folder)`` applies it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from unclip.nets.lora import HALF_FINGERPRINTS, add_adapter, check_target_modules, save_adapter
from unclip.pipeline.folders import CLIP_STAGES
from unclip.utils.config import to_dict

__all__ = ["ADAPTER_NAME", "add_training_adapter", "export_adapter", "adapter_folder_name"]

logger = logging.getLogger("unclip.train")

#: the name of the adapter a run trains (peft's default); the exported files do not record it
ADAPTER_NAME = "default"


def adapter_folder_name(stage: str) -> str:
    """``<stage>_lora``: the folder under ``final/`` an adapter of ``stage`` is exported to."""
    return f"{stage}_lora"


def add_training_adapter(model: torch.nn.Module, train_cfg) -> torch.nn.Module:
    """Inject the adapter ``train_cfg.lora`` (:class:`~unclip.train.config.LoraTrainConfig`)
    describes into ``model`` (in place): only its parameters require grad. Targets that name no
    layer of the network are a ``ValueError`` listing the layers there are."""
    lora = train_cfg.lora
    targets = check_target_modules(model, lora.target_modules, key="train.lora.target_modules")
    add_adapter(
        model,
        ADAPTER_NAME,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=targets,
        trainable=True,
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA rank %d on %s: %d of %d parameters train (%.2f%%)",
        lora.rank,
        ", ".join(targets),
        trained,
        total,
        100.0 * trained / max(total, 1),
    )
    return model


def export_adapter(loop, stage: str, clip) -> Path:
    """Write ``<output_dir>/final/<stage>_lora`` from the EMA weights (if any): the adapter's
    weights and configs only. ``unclip_lora.json`` records the stage, the base weights'
    ``init_weights`` path and fingerprint, the conditioning CLIP's fingerprint (stages that read
    captions), the steps trained and the run's LoRA settings."""
    cfg = loop.cfg
    reads_captions = cfg.stage in CLIP_STAGES
    meta = {
        "stage": stage,
        "init_weights": str(cfg.train.init_weights),
        "clip_fingerprint": clip.fingerprint() if reads_captions else None,
        "clip_fingerprints": {
            name: clip.fingerprint(dtype) for name, dtype in HALF_FINGERPRINTS.items()
        }
        if reads_captions
        else None,
        "steps": loop.state.step,
        "train_lora": to_dict(cfg.train.lora),
    }
    out = loop.export(
        adapter_folder_name(stage),
        lambda model, folder: save_adapter(model, folder, ADAPTER_NAME, meta),
    )
    if loop.accelerator.is_main_process:
        print(f"exported the {stage} LoRA adapter to {out}")
    return out
