"""``unclip plan``: a dry run of one training step of a stage on fake CUDA tensors and a per-GPU
memory plan (see :mod:`unclip.train.plan`). Needs no GPU and downloads nothing.

    unclip plan configs/decoder_64.yaml --gpus 8 --gpu-memory 80GiB
    unclip plan configs/decoder_64.yaml --accelerate-config configs/accelerate/fsdp_8gpu.yaml
    unclip plan configs/prior_vit_l14.yaml --micro-batch 128 --json plan.json
    unclip plan --sample configs/prior_vit_l14.yaml configs/decoder_64.yaml configs/sr256.yaml \
        configs/sr1024.yaml          # the full-scale cascade sampling at fp16 on one GPU
    unclip plan --sample PIPELINE_FOLDER --batch 16
    unclip plan --sample ... --offload   # with per-stage model offload (enable_model_cpu_offload)
    unclip plan --sample ... --attention-slicing max   # attention one head at a time
"""

from __future__ import annotations

import argparse
from typing import Optional

from unclip.cli.generate import add_autocast_arg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unclip plan",
        description="run one training step of a stage config on fake CUDA tensors (shapes, dtypes "
        "and devices, no storage) through the real training code, and print a per-GPU memory plan",
    )
    p.add_argument(
        "config", nargs="?", help="a stage config (prior, decoder or upsampler YAML) to train"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.batch_size=16")
    p.add_argument(
        "--accelerate-config",
        help="plan for the strategy and GPU count of this Accelerate config file only",
    )
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs (default 8)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU (default 80GiB)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="micro-batch per GPU (default data.batch_size)",
    )
    p.add_argument("--json", default=None, help="also write the measurement and plan as JSON here")
    p.add_argument(
        "--sample",
        nargs="+",
        metavar="PIPELINE_OR_CONFIG",
        help="plan sampling instead (fp16 weights; see --dtype, --autocast): a pipeline folder, "
        "or stage configs forming a cascade",
    )
    p.add_argument("--batch", type=int, default=1, help="--sample: images per prompt (default 1)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="--sample: with per-stage model offload (each component on the GPU while it runs)",
    )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="--sample: the weights' dtype (default float16)",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="read the command as the plan would (the configs with their overrides, the "
        "Accelerate file, the micro-batch's fit) and stop before the dry run",
    )
    add_autocast_arg(p, default=None)  # None: not given (auto), so that it needs --sample
    p.add_argument(
        "--attention-slicing",
        default=None,
        metavar="auto|max|N",
        help="--sample: with attention computed N heads at a time (pipe.enable_attention_slicing)",
    )
    return p


def _load_any_config(path, overrides):
    """A stage config, or a token family's (``tokenizer:`` / ``transformer:`` at the top)."""
    import yaml

    from unclip.train.config import load_stage_config

    try:
        with open(path) as f:
            top = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        top = {}  # the stage loader reports the file's problem
    if isinstance(top, dict) and "transformer" in top:
        from unclip.train.token_config import load_token_model_train_config

        return load_token_model_train_config(path, overrides)
    if isinstance(top, dict) and "tokenizer" in top:
        from unclip.train.token_config import load_tokenizer_train_config

        return load_tokenizer_train_config(path, overrides)
    if isinstance(top, dict) and "kandinsky" in top:
        from unclip.train.kandinsky import load_kandinsky_config

        return load_kandinsky_config(path, overrides)
    return load_stage_config(path, overrides)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    # overrides may follow an option (``CONFIG --accelerate-config F train.x=1``), as in training
    args = parser.parse_intermixed_args(argv)
    if (args.config is None) == (args.sample is None):
        parser.error("give a stage CONFIG to plan training, or --sample to plan sampling")
    if (args.offload or args.attention_slicing or args.dtype or args.autocast) and not args.sample:
        parser.error(
            "--offload, --attention-slicing, --dtype and --autocast plan sampling: use them with "
            "--sample"
        )
    import dataclasses
    import json

    import torch

    from unclip.train.plan import measure_step
    from unclip.train.strategies import (
        format_plan,
        memory_plan,
        parse_memory,
        read_accelerate_config,
    )
    from unclip.utils.limits import check_fits

    memory = parse_memory(args.gpu_memory)
    if args.sample and args.check_only:
        from pathlib import Path

        for path in args.sample:  # a pipeline folder is read by the dry run itself
            if not Path(path).is_dir():
                _load_any_config(path, [])
        print(f"read {len(args.sample)} stage(s) to sample; dry run skipped (--check-only)")
        return 0
    if args.sample:
        from unclip.train.plan_sampling import format_sampling, measure_sampling

        slicing = args.attention_slicing
        sampled = measure_sampling(
            args.sample,
            batch=args.batch,
            offload=args.offload,
            attention_slicing=int(slicing) if slicing and slicing.isdigit() else slicing,
            dtype=getattr(torch, args.dtype or "float16"),
            autocast_dtype=args.autocast or "auto",
        )
        print(format_sampling(sampled, memory))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dataclasses.asdict(sampled), f, indent=2)
        return 0
    strategy, shard_gpus, gpus = None, 8, 8
    if args.accelerate_config:
        launch = read_accelerate_config(args.accelerate_config)
        strategy, shard_gpus, gpus = launch.strategy, launch.shard_gpus, launch.gpus
    if args.gpus is not None:
        if args.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
        # hybrid sharding keeps its shard group (a node); the GPUs beyond it replicate
        hybrid = args.accelerate_config and shard_gpus < gpus
        shard_gpus = min(shard_gpus, args.gpus) if hybrid else args.gpus
        gpus = args.gpus
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    cfg = _load_any_config(args.config, args.overrides)
    # the tensors are fake, but the micro-batch's captions and their token ids are real: a batch
    # whose images alone could not fit on one GPU is refused before any of it is built
    res = cfg.data.resolution
    check_fits(
        "--micro-batch" if args.micro_batch is not None else "data.batch_size",
        args.micro_batch or cfg.data.batch_size,
        3 * res * res * 2,
        f"its fp16 {res}px images",
        limit=memory,
        limit_name=f"one GPU's memory (--gpu-memory {args.gpu_memory})",
    )
    if args.check_only:
        print(f"read {args.config} with {len(args.overrides)} override(s); dry run skipped")
        return 0
    measure = measure_step(cfg, micro_batch=args.micro_batch)
    rows, choice = memory_plan(measure, shard_gpus, memory, strategy, cfg.train.grad_accum_steps)
    print(format_plan(measure, rows, choice, shard_gpus, memory, cfg.train.max_steps, gpus))
    if args.json:
        report = {
            "config": str(args.config),
            "measure": dataclasses.asdict(measure),
            "gpus": gpus,
            "shard_gpus": shard_gpus,
            "gpu_memory": memory,
            "rows": [
                {
                    "strategy": r.strategy.name,
                    "launch": r.strategy.launch,
                    "micro_batch": r.micro_batch,
                    "grad_accum_steps": r.grad_accum_steps,
                    "parts": {k: int(v) for k, v in r.parts.items()},
                    "peak": r.peak,
                    "budget": r.budget,
                    "fits": r.fits,
                }
                for r in rows
            ],
            "choice": None if choice is None else choice.strategy.name,
            "choice_micro_batch": None if choice is None else choice.micro_batch,
            "choice_peak": None if choice is None else choice.peak,
            "train_flops_per_sample": measure.train_flops_per_sample,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if choice is not None else 1
