"""Sharding and precision: PowerSGD through a loss-scale overflow (2 gloo processes), FSDP2 on 2 CPU
processes (trains, resumes exactly, matches DDP, exports a decoder that generates), the shipped
Accelerate config files, the optimizer choice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, ROOT
from safetensors.torch import load_file

from unclip.config import ConfigError
from unclip.train import distributed as dist_utils
from unclip.train.config import TrainConfig

ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
TORCHRUN = [
    str(Path(sys.executable).with_name("torchrun")),
    "--standalone",
    "--nproc_per_node",
    "2",
]


def launch_env(config_file: Path) -> dict:
    """The environment ``accelerate launch --config_file config_file train_decoder.py …`` gives
    each process, from Accelerate's own parser, validation and launcher code (nothing started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", str(config_file), "train_decoder.py", "configs/decoder_64.yaml"]
    args, defaults, mp_from_config = _validate_launch_command(
        launch_command_parser().parse_args(argv)
    )
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


def test_accelerate_config_files_parse(monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    names = {p.name for p in ACCELERATE_CONFIGS}
    assert names == {
        "ddp_8gpu.yaml",
        "fsdp_8gpu.yaml",
        "fsdp_grad_op_8gpu.yaml",
        "fsdp_hybrid_16gpu.yaml",
        "fsdp_offload_8gpu.yaml",
        "deepspeed_zero2_8gpu.yaml",
        "deepspeed_zero3_8gpu.yaml",
    }
    for path in ACCELERATE_CONFIGS:
        cfg = load_config_from_file(str(path))
        assert cfg.mixed_precision == "fp16", path.name
        assert cfg.num_processes == (16 if "16gpu" in path.name else 8), path.name
        env = launch_env(path)
        if path.name.startswith("fsdp"):
            assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
            for key, value in env.items():
                if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_")):
                    monkeypatch.setenv(key, value)
            plugin = FullyShardedDataParallelPlugin()  # Accelerate's own reading of the values
            assert plugin.fsdp_version == 2
            assert plugin.reshard_after_forward is ("grad_op" not in path.name)
            assert plugin.transformer_cls_names_to_wrap is None  # filled per model by the loop
            assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == ("offload" in path.name)
            for key in env:
                if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_")):
                    monkeypatch.delenv(key)
        if path.name == "fsdp_hybrid_16gpu.yaml":
            assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
            assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "8"
            assert cfg.num_machines == 2
        if path.name.startswith("deepspeed"):
            assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
            assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == path.name.split("zero")[1][0]
        if path.name == "ddp_8gpu.yaml":
            assert cfg.distributed_type.value == "MULTI_GPU"


def test_fsdp_blocks_fit_every_stage():
    """The block classes FSDP shards exist in each stage's model (Accelerate refuses a named class
    the model lacks)."""
    from unclip.clip import CLIP
    from unclip.train.config import load_stage_config

    for name in ("prior", "decoder", "sr32"):
        cfg = load_stage_config(CONFIGS / "tiny" / f"{name}.yaml")
        model = cfg.model.build(CLIP.from_config(cfg.clip)) if name != "sr32" else cfg.model.build()
        blocks = dist_utils.fsdp_block_classes(model)
        present = {type(m).__name__ for m in model.modules()}
        assert blocks and set(blocks) <= present, name
        assert blocks == (["BasicTransformerBlock"] if name == "prior" else blocks)


def test_optimizer_setting():
    assert TrainConfig().optimizer == "adamw"
    with pytest.raises(ConfigError, match="train.optimizer must be adamw or adamw8bit"):
        TrainConfig(optimizer="sgd")
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    assert isinstance(
        dist_utils.make_optimizer("adamw", groups, lr=1e-3, betas=[0.9, 0.99], eps=1e-8),
        torch.optim.AdamW,
    )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install bitsandbytes .*CUDA"):
            dist_utils.make_optimizer("adamw8bit", groups, lr=1e-3, betas=[0.9, 0.99], eps=1e-8)


@pytest.mark.slow
def test_powersgd_survives_a_loss_scale_overflow(tmp_path):
    """2 gloo processes, PowerSGD from step 2, a real GradScaler; at step 4 rank 0's loss is
    infinite. The scaler skips that step and halves its scale; every later step is finite and the
    run finishes (torch's plain powerSGD_hook stops it: NaN error feedback on every step after)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = ROOT / "tests" / "powersgd_overflow_worker.py"
    proc = subprocess.run(
        [*TORCHRUN, str(worker), str(out), "scaler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["error"] is None
    assert result["nonfinite"] == 1 and result["rolled_back"] >= 1
    assert result["scale"] == 2.0**11  # backed off once from 2**12
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(steps) == list(range(1, 11))
    assert all(v == v and abs(v) < 1e6 for s, v in steps.items() if s != 5)  # step 5: the overflow
    sums = json.loads((out / "rank_checksums.json").read_text())
    assert sums[0] == sums[1]


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes(tmp_path):
    """FSDP2 (the shipped fsdp_8gpu.yaml, as ``accelerate launch`` passes it) on 2 gloo
    processes: the tiny decoder trains (with sample grids and checkpoints), a run stopped and
    resumed ends with exactly the weights of an uninterrupted one, the checkpoints have the files
    and tensors a DDP run writes, the weights match DDP's, and the export loads and generates."""
    env = {**os.environ, **launch_env(ROOT / "configs" / "accelerate" / "fsdp_8gpu.yaml")}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_MIXED_PRECISION="no")
    worker = ROOT / "tests" / "fsdp_worker.py"
    proc = subprocess.run(
        [*TORCHRUN, str(worker), str(CONFIGS / "tiny" / "decoder.yaml"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy: fsdp on 2 processes" in proc.stderr
    assert "strategy: ddp on 2 processes" in proc.stderr

    def final(run):
        return load_file(
            str(tmp_path / run / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
        )

    full, split, ddp = final("fsdp_full"), final("fsdp_split"), final("ddp")
    assert full.keys() == split.keys() == ddp.keys()
    for k in full:
        assert torch.equal(full[k], split[k]), k
        assert torch.allclose(full[k], ddp[k], atol=1e-4), k
    for run in ("fsdp_full", "ddp"):
        assert [p.name for p in (tmp_path / run / "samples").iterdir()] == ["step_00000004.png"]
    step = "checkpoints/step_00000004"
    for name in ("model", "optimizer", "ema"):
        a = load_file(str(tmp_path / "fsdp_full" / step / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "ddp" / step / f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a), name
        assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-4) for k in a), name
    sums = json.loads((tmp_path / "fsdp_full" / "rank_checksums.json").read_text())
    assert sums[0] == sums[1]

    from unclip import UnCLIPPipeline
    from unclip.clip import CLIP
    from unclip.decoder import UnCLIPDecoder

    folder = tmp_path / "fsdp_full" / "final"
    clip = CLIP.from_pretrained(folder / "clip")
    decoder = UnCLIPDecoder.from_pretrained(folder / "decoder")
    embed = torch.nn.functional.normalize(torch.randn(2, clip.embed_dim), dim=-1)
    images = UnCLIPPipeline(clip, None, decoder).decode(
        embed,
        ["a red circle", "a blue square"],
        [torch.Generator().manual_seed(i) for i in range(2)],
        sampling={"decoder": {"steps": 3}},
        progress=False,
    )
    assert images.shape == (2, 3, 16, 16) and torch.isfinite(images).all()
