"""``unclip plan``: one training step of every tiny stage on fake CUDA tensors through the real
training code, the memory accounting it reports, and the plan built from it."""

import json
from pathlib import Path

import pytest
import torch

from unclip.train.config import load_stage_config
from unclip.train.plan import measure_step
from unclip.train.strategies import (
    STRATEGIES,
    GiB,
    memory_plan,
    parse_memory,
    read_accelerate_config,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ["prior", "decoder", "sr32", "sr64"]
FP16 = ["train.mixed_precision=auto", "train.grad_accum_steps=2"]

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def tiny(name, *overrides):
    return load_stage_config(ROOT / "configs" / "tiny" / f"{name}.yaml", [*FP16, *overrides])


_MEASURED = {}


def measured(name, *overrides):
    """One dry run per configuration for the whole module (each takes seconds)."""
    key = (name, *overrides)
    if key not in _MEASURED:
        _MEASURED[key] = measure_step(tiny(name, *overrides))
    return _MEASURED[key]


@pytest.mark.parametrize("name", TINY)
def test_fake_cuda_step_of_every_tiny_stage(name):
    m = measured(name)
    # mixed_precision auto on a GPU is fp16 with loss scaling; the loss is computed in fp32
    assert m.mixed_precision == "fp16" and m.loss_dtype == "float32"
    assert m.param_dtypes == ["float32"]  # fp32 master weights
    trainable = 4 * m.params_trainable
    # each part measured from the tensors the step made on the fake GPU (512-byte rounding)
    assert trainable <= m.grads < trainable * 1.1
    assert trainable <= m.ema < trainable * 1.1  # the EMA shadows every trained weight, on the GPU
    # AdamW: two moments per weight (and a step counter per tensor)
    assert 2 * trainable <= m.optimizer < 2 * trainable * 1.25
    assert m.activations > 0
    # the frozen CLIP is on the GPU only where the stage runs it (an upsampler never does)
    assert (m.clip > 0) == (name in ("prior", "decoder"))
    # autocast's fp16 weight copies exist only if the forward really ran under fp16 autocast
    assert 0 < m.autocast_copies <= m.weights / 2 * 1.1
    assert m.peak >= m.static + m.activations


def test_fp32_run_makes_no_autocast_copies():
    m = measure_step(tiny("sr32", "train.mixed_precision=no"))
    assert m.mixed_precision == "no" and m.autocast_copies == 0


def test_dry_run_fails_when_the_ema_is_not_on_the_gpu(monkeypatch):
    from diffusers.training_utils import EMAModel

    import unclip.train.loop as loop_module

    class CpuEMA(EMAModel):  # the EMA shadow left in CPU memory while the model trains on cuda
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
            self.to("cpu")

    monkeypatch.setattr(loop_module, "EMAModel", CpuEMA)
    with pytest.raises(Exception, match="cpu"):
        measure_step(tiny("prior"))


def test_gradient_checkpointing_lowers_activations_and_measures_the_recompute():
    off = measured("sr32")
    on = measure_step(tiny("sr32", "train.gradient_checkpointing=true"))
    assert off.recompute == 0 and on.recompute > 0
    assert on.activations < off.activations
    assert on.weights == off.weights and on.optimizer == off.optimizer


def test_plan_estimate_bounds_a_real_cpu_step():
    """The method on fake CPU tensors against a real CPU step counted by the same tracker."""
    import tempfile

    from unclip.clip import CLIP
    from unclip.train.loop import TrainLoop
    from unclip.train.plan import MemoryTracker, _build, _synthetic_batch

    cfg = load_stage_config(
        ROOT / "configs/tiny/sr32.yaml", ["train.mixed_precision=no", "train.grad_accum_steps=2"]
    )
    est = measure_step(cfg, device_type="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg.train.output_dir = tmp
        loop = TrainLoop(cfg, overwrite=True)
        mem = MemoryTracker("cpu")
        with mem:
            clip = CLIP.from_config(cfg.clip)
            model, task = _build(cfg, clip, "cpu")
            model = loop.prepare(model)
            batch = _synthetic_batch(cfg, clip, cfg.data.batch_size)
            mem.reset_peak()
            loop.run_step(task, [batch, batch])
        loop.accelerator.end_training()
    assert mem.peak <= est.peak <= 1.3 * mem.peak


def test_strategies_divide_what_they_shard():
    m = measured("decoder")
    big = 80 * GiB
    rows, _ = memory_plan(m, 8, big)
    by = {r.strategy.name: r.parts for r in rows}
    ddp, z2, z3 = (by[STRATEGIES[k].name] for k in ("ddp", "zero2", "zero3"))
    assert ddp["optimizer"] == m.optimizer and z2["optimizer"] == m.optimizer / 8
    assert z2["gradients"] == m.grads / 8 and z2["weights"] == m.weights
    assert z3["weights"] == m.weights / 8 + 2 * m.block_weights
    offload = by[STRATEGIES["zero3_offload"].name]
    assert offload["optimizer"] == offload["gradients"] == offload["EMA"] == 0
    assert offload["weights"] == 2 * m.block_weights  # only the blocks being computed


def test_plan_halves_the_micro_batch_until_it_fits():
    m = measured("decoder")
    assert m.micro_batch == 8
    # a card just big enough for the static state and a quarter of the activations
    need = m.static + (m.activations + m.recompute + m.transient) / 4
    from unclip.train.strategies import CUDA_CONTEXT, FRAGMENTATION

    memory = int(need * (1 + FRAGMENTATION) + CUDA_CONTEXT) + 4096
    _, choice = memory_plan(m, 1, memory, "ddp", grad_accum_steps=2)
    assert choice is not None and choice.micro_batch == 2 and choice.grad_accum_steps == 8
    assert choice.peak <= choice.budget


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * GiB == parse_memory("80 GB")
    assert parse_memory("512MiB") == 2**29
    for bad in ("lots", "-1GiB", "0"):
        with pytest.raises(ValueError, match="memory"):
            parse_memory(bad)


def test_accelerate_configs_map_to_strategies(tmp_path):
    cases = {
        "distributed_type: MULTI_GPU\nnum_processes: 8\n": ("ddp", 8),
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_sharding_strategy: "
        "SHARD_GRAD_OP\n": ("zero2", 8),
        "distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  "
        "fsdp_sharding_strategy: HYBRID_SHARD\n": ("zero3", 8),
        "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 3\n  "
        "offload_param_device: cpu\n": ("zero3_offload", 8),
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n  "
        "fsdp_reshard_after_forward: false\n": ("zero2", 8),
    }
    for i, (text, want) in enumerate(cases.items()):
        path = tmp_path / f"{i}.yaml"
        path.write_text(text)
        assert read_accelerate_config(path) == want
    (tmp_path / "tpu.yaml").write_text("distributed_type: XLA\n")
    with pytest.raises(ValueError, match="XLA"):
        read_accelerate_config(tmp_path / "tpu.yaml")


def test_shipped_accelerate_configs_have_a_plan():
    got = {
        p.name: read_accelerate_config(p) for p in (ROOT / "configs" / "accelerate").glob("*.yaml")
    }
    assert got == {
        "ddp_8gpu.yaml": ("ddp", 8),
        "fsdp_grad_op_8gpu.yaml": ("zero2", 8),
        "fsdp_8gpu.yaml": ("zero3", 8),
        "fsdp_hybrid_16gpu.yaml": ("zero3", 8),  # sharded within each node of 8
        "fsdp_offload_8gpu.yaml": ("zero3_offload", 8),
        "deepspeed_zero2_8gpu.yaml": ("zero2", 8),
        "deepspeed_zero3_8gpu.yaml": ("zero3", 8),
    }
    # every strategy the plan can suggest is launched by a shipped file
    for strategy in STRATEGIES.values():
        assert (ROOT / strategy.launch).is_file(), strategy.launch


def test_cli_plan_prints_and_writes_json(tmp_path, capsys):
    from unclip.cli.plan import main

    out = tmp_path / "plan.json"
    code = main(
        [str(ROOT / "configs/tiny/prior.yaml"), "train.mixed_precision=auto", "--gpus", "2",
         "--gpu-memory", "4GiB", "--json", str(out)]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "fake-CUDA training step passed" in text and "fits: DDP" in text
    report = json.loads(out.read_text())
    assert report["choice"] == "DDP" and report["gpus"] == 2
    assert report["measure"]["mixed_precision"] == "fp16"


def test_a_real_cpu_run_after_a_dry_run_trains_on_the_cpu(tmp_path):
    """The dry run's fake GPU does not stay in Accelerate's process-wide state."""
    from unclip.train.loop import TrainLoop

    measured("prior")
    cfg = tiny("prior", f"train.output_dir={tmp_path}")
    loop = TrainLoop(cfg)
    assert loop.device.type == "cpu"
    assert torch.zeros(1, device=loop.device).device.type == "cpu"


def test_sampling_dry_run_of_a_tiny_cascade(capsys):
    from unclip.cli.plan import main
    from unclip.train.plan_sampling import measure_sampling

    tiny_cfgs = [str(ROOT / "configs" / "tiny" / f"{n}.yaml") for n in ("prior", "decoder", "sr32")]
    m = measure_sampling(tiny_cfgs, batch=2)
    assert m.stages == ["prior", "decoder", "sr32"] and m.dtype == "float16"
    assert m.output_shape == [2, 3, 32, 32]
    # fp16 weights on the GPU: two bytes per parameter (plus 512-byte rounding)
    assert 2 * sum(m.params.values()) <= m.weights < 2.2 * sum(m.params.values())
    assert set(m.stage_peaks) == set(m.stages) and m.peak == max(m.stage_peaks.values())
    assert all(p > m.weights for p in m.stage_peaks.values())  # each stage's activations
    assert main(["--sample", *tiny_cfgs, "--gpu-memory", "4GiB"]) == 0
    assert "fits on one GPU" in capsys.readouterr().out


def test_sampling_dry_run_of_a_pipeline_folder(tmp_path, tiny_pipe):
    from unclip.train.plan_sampling import measure_sampling

    tiny_pipe.save_pretrained(tmp_path / "pipe")
    m = measure_sampling([tmp_path / "pipe"], batch=1)
    assert m.stages == list(tiny_pipe.stage_names)
    assert m.params["decoder"] == sum(p.numel() for p in tiny_pipe.decoder.parameters())
    size = tiny_pipe.upsamplers[-1].config.sample_size if tiny_pipe.upsamplers else None
    assert size is None or m.output_shape[-1] == size


def test_plan_needs_a_config_or_sample():
    from unclip.cli.plan import main

    with pytest.raises(SystemExit):
        main([])


def test_dry_run_of_an_attention_free_upsampler():
    m = measured("sr32", "upsampler.add_attention=false")
    assert 0 < m.block_weights < m.weights
    assert m.params_total < measured("sr32").params_total  # no mid-block attention
