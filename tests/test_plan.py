"""``unclip plan``: one training step of every tiny stage on fake CUDA tensors through the real
training code, the memory accounting it reports, and the plan built from it."""

import json
from pathlib import Path

import pytest
import torch

from unclip.pipeline.tiny import TINY_TEXT_ENCODER
from unclip.train.config import load_stage_config
from unclip.train.plan import measure_step
from unclip.train.strategies import (
    STRATEGIES,
    GiB,
    memory_plan,
    parse_memory,
    plan_row,
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


def test_plan_of_a_partial_fine_tune_measures_the_fresh_architecture(tmp_path):
    """A dry run ignores init_weights (nothing is read); with init_weights_partial set too, it
    still plans the config's architecture instead of refusing the partial flag alone."""
    extra = [f"train.init_weights={tmp_path}", "train.init_weights_partial=true"]
    m = measure_step(tiny("decoder", "train.mixed_precision=no", *extra))
    plain = measured("decoder", "train.mixed_precision=no")
    assert m.params_trainable == plain.params_trainable > 0


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
    # backward runs the checkpointed blocks' forward once more, and only theirs
    trained = on.forward_flops - on.clip_flops
    assert off.recompute_flops == 0 and 0 < on.recompute_flops < trained
    extra = (on.train_flops_per_sample - off.train_flops_per_sample) * on.micro_batch
    assert extra == pytest.approx(on.recompute_flops)


def test_recompute_flops_of_a_prior_count_its_caption_transformer_only():
    """A prior checkpoints the blocks of its own caption transformer, not its denoiser."""
    own = [f"prior.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()]
    m = measure_step(tiny("prior", *own, "train.gradient_checkpointing=true"))
    off = measure_step(tiny("prior", *own))
    trained = m.forward_flops - m.clip_flops
    assert 0 < m.recompute_flops < trained / 2
    assert off.recompute_flops == 0 and off.forward_flops == m.forward_flops


def test_plan_estimate_bounds_a_real_cpu_step():
    """The method on fake CPU tensors against a real CPU step counted by the same tracker."""
    from unclip.train.plan_measure import real_cpu_step_peak

    cfg = load_stage_config(
        ROOT / "configs/tiny/sr32.yaml", ["train.mixed_precision=no", "train.grad_accum_steps=2"]
    )
    est = measure_step(cfg, device_type="cpu")
    real = real_cpu_step_peak(cfg)
    assert real <= est.peak <= 1.3 * real


def test_measured_backward_with_checkpointing_matches_a_real_cpu_step():
    """With checkpointed blocks the backward the dry run measures is a real step's: the recompute's
    tensors freed as the engine frees them, and no FLOP counter's decomposition temporaries (the
    counted micro-batch once peaked 23 % above the real step at this width)."""
    from unclip.train.plan_measure import real_cpu_step_peak

    cfg = load_stage_config(
        ROOT / "configs/tiny/decoder.yaml",
        ["train.mixed_precision=no", "train.gradient_checkpointing=true", "data.batch_size=16"],
    )
    est = measure_step(cfg, device_type="cpu")
    real = real_cpu_step_peak(cfg)
    assert est.recompute_flops > 0  # the blocks were checkpointed and their FLOPs counted
    assert est.backward_peak + est.optimizer == pytest.approx(real, rel=0.05)
    assert real <= est.peak <= 1.05 * real


def test_fsdp_units_and_root_group_of_the_decoder():
    """FULL_SHARD gathers one unit (a resnet or attention layer) at a time, not a UNet level."""
    m = measured("decoder")
    from unclip.nets.clip import CLIP

    cfg = tiny("decoder")
    dec = cfg.decoder.build(CLIP.from_config(cfg.clip))
    levels = [*dec.unet.down_blocks, *dec.unet.up_blocks]
    level = max(sum(p.numel() * 4 for p in block.parameters()) for block in levels)
    assert 0 < m.block_weights < level
    assert 0 < m.root_weights < m.weights


def test_strategies_divide_what_they_shard(tmp_path):
    m = measured("decoder")
    rows, _ = memory_plan(m, 8, 80 * GiB)
    by = {r.strategy.name: r.parts for r in rows}
    ddp, z2, z3, off = (by[STRATEGIES[k].name] for k in STRATEGIES)
    assert ddp["optimizer"] == m.optimizer and ddp["EMA"] == m.ema and ddp["DDP buckets"] == 0
    # FSDP2 keeps fp32 shards of weights, moments and EMA (the EMA follows the shard) and gathers
    # whole copies in the compute dtype (fp16 here: half the fp32 bytes): without resharding after
    # the forward every unit, with it the root group for the step and two units at a time
    for z in (z2, z3):
        assert z["weights"] == m.weights / 8 and z["optimizer"] == m.optimizer / 8
        assert z["EMA"] == m.ema / 8 and z["autocast copies"] == 0
    assert z2["gathered weights"] == m.weights / 2
    assert z3["gathered weights"] == (m.root_weights + 2 * m.block_weights) / 2
    # every micro-batch is reduce-scattered into the fp32 gradient shards: with one micro-batch
    # they fill in as the backward ends, with more they are held through the later backwards;
    # never the whole gradients
    assert z2["gradients"] == z3["gradients"] == 0
    accumulating = plan_row(m, STRATEGIES["zero3"], 8, 80 * GiB, grad_accum_steps=2)
    assert accumulating.parts["gradients"] == m.grads / 8
    assert off["optimizer"] == off["gradients"] == off["EMA"] == off["weights"] == 0
    assert off["gathered weights"] == z3["gathered weights"]
    for row in rows:
        assert row.peak == int(sum(row.parts.values()))
    # DeepSpeed ZeRO-2 keeps the EMA of the whole weights whole; ZeRO-3 refuses an EMA
    z2ds = read_accelerate_config(ROOT / "configs/accelerate/deepspeed_zero2_8gpu.yaml").strategy
    row = memory_plan(m, 8, 80 * GiB, z2ds)[0][0]
    assert row.parts["EMA"] == m.ema and row.parts["optimizer"] == m.optimizer / 8
    z3ds = read_accelerate_config(ROOT / "configs/accelerate/deepspeed_zero3_8gpu.yaml").strategy
    rows, choice = memory_plan(m, 8, 80 * GiB, z3ds)
    assert choice is None and "ema" in rows[0].note
    # autocast's weight copies do not shrink with the micro-batch, activations do
    half = plan_row(m, STRATEGIES["ddp"], 8, 80 * GiB, m.micro_batch // 2)
    assert half.parts["autocast copies"] == ddp["autocast copies"] == m.autocast_copies
    assert half.parts["activations"] == ddp["activations"] / 2


def test_plan_lowers_the_micro_batch_keeping_the_global_batch():
    import dataclasses

    from unclip.train.strategies import CUDA_CONTEXT, FRAGMENTATION, per_sample_bytes

    for b0 in (8, 6):
        m = dataclasses.replace(measured("decoder"), micro_batch=b0)
        # a card just big enough for the static state and a third of the micro-batch
        need = m.static + m.autocast_copies + per_sample_bytes(m) * (b0 // 3 + 0.5)
        memory = int(need * (1 + FRAGMENTATION) + CUDA_CONTEXT) + 4096
        _, choice = memory_plan(m, 1, memory, STRATEGIES["ddp"], grad_accum_steps=2)
        assert choice is not None and b0 % choice.micro_batch == 0
        assert choice.micro_batch * choice.grad_accum_steps == b0 * 2  # the same global batch
        assert choice.micro_batch <= b0 // 3 + 0.5 and choice.peak <= choice.budget
        # the next larger divisor would not have fitted
        larger = min(d for d in range(choice.micro_batch + 1, b0 + 1) if b0 % d == 0)
        assert not plan_row(m, STRATEGIES["ddp"], 1, memory, larger).fits


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * GiB == parse_memory("80 GB")
    assert parse_memory("512MiB") == 2**29
    for bad in ("lots", "-1GiB", "0"):
        with pytest.raises(ValueError, match="memory"):
            parse_memory(bad)


def test_accelerate_configs_map_to_strategies(tmp_path):
    cases = {
        "distributed_type: MULTI_GPU\nnum_processes: 8\n": ("DDP", 8, 8),
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_sharding_strategy: "
        "SHARD_GRAD_OP\n": ("FSDP SHARD_GRAD_OP", 8, 8),
        "distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  "
        "fsdp_sharding_strategy: HYBRID_SHARD\n": ("FSDP FULL_SHARD", 8, 16),
        "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 3\n  "
        "offload_param_device: cpu\n": ("DeepSpeed ZeRO-3", 8, 8),
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n  "
        "fsdp_reshard_after_forward: false\n": ("FSDP SHARD_GRAD_OP", 8, 8),
    }
    for i, (text, want) in enumerate(cases.items()):
        path = tmp_path / f"{i}.yaml"
        path.write_text(text)
        got = read_accelerate_config(path)
        assert (got.strategy.name, got.shard_gpus, got.gpus) == want
        assert got.strategy.launch == str(path)
    ds3 = read_accelerate_config(tmp_path / "3.yaml").strategy
    assert ds3.offload_weights and ds3.offload_optimizer and ds3.refuses_ema
    (tmp_path / "tpu.yaml").write_text("distributed_type: XLA\n")
    with pytest.raises(ValueError, match="XLA"):
        read_accelerate_config(tmp_path / "tpu.yaml")


def test_shipped_accelerate_configs_have_a_plan():
    got = {}
    for p in (ROOT / "configs" / "accelerate").glob("*.yaml"):
        launch = read_accelerate_config(p)
        got[p.name] = (launch.strategy.name, launch.shard_gpus, launch.gpus)
    assert got == {
        "ddp_8gpu.yaml": ("DDP", 8, 8),
        "fsdp_grad_op_8gpu.yaml": ("FSDP SHARD_GRAD_OP", 8, 8),
        "fsdp_8gpu.yaml": ("FSDP FULL_SHARD", 8, 8),
        "fsdp_hybrid_16gpu.yaml": ("FSDP FULL_SHARD", 8, 16),  # sharded within each node of 8
        "fsdp_offload_8gpu.yaml": ("FSDP FULL_SHARD + CPU offload", 8, 8),
        "deepspeed_zero2_8gpu.yaml": ("DeepSpeed ZeRO-2", 8, 8),
        "deepspeed_zero3_8gpu.yaml": ("DeepSpeed ZeRO-3", 8, 8),
        **{
            name.replace(".yaml", "_bf16.yaml"): want
            for name, want in got.items()
            if "_bf16" not in name
        },
    }
    for name in got:  # every bf16 twin is its fp16 file but for the precision
        if name.endswith("_bf16.yaml"):
            fp16 = (ROOT / "configs/accelerate" / name.replace("_bf16", "")).read_text()
            bf16 = (ROOT / "configs/accelerate" / name).read_text()
            settings = [line for line in fp16.splitlines() if not line.startswith("#")]
            assert [line for line in bf16.splitlines() if not line.startswith("#")] == [
                line.replace("mixed_precision: fp16", "mixed_precision: bf16") for line in settings
            ], name
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
    # the launch it names is the bf16 twin docs/full_scale.md recommends, and the fp16 file
    assert (
        "--config_file configs/accelerate/ddp_8gpu_bf16.yaml (fp16, for GPUs without bf16: "
        "configs/accelerate/ddp_8gpu.yaml)" in text
    )
    report = json.loads(out.read_text())
    assert report["choice"] == "DDP" and report["gpus"] == report["shard_gpus"] == 2
    assert report["measure"]["mixed_precision"] == "fp16"


def test_a_real_cpu_run_after_a_dry_run_trains_on_the_cpu(tmp_path):
    """The dry run's fake GPU does not stay in Accelerate's process-wide state or in torch."""
    from accelerate.state import PartialState

    from unclip.train.loop import TrainLoop

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    measure_step(tiny("prior"))
    assert torch.equal(torch.rand(3), expected)  # the caller's random stream is untouched
    assert not torch.cuda.is_available()
    assert PartialState().device.type == "cpu"
    loop = TrainLoop(tiny("prior", f"train.output_dir={tmp_path}"))
    assert loop.device.type == "cpu"


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


def test_sampling_dry_run_runs_the_networks_under_the_pipelines_autocast(capsys):
    """fp32 weights on a GPU with a loaded pipeline's default autocast ("auto": fp16), the
    combination `from_pretrained(...).to("cuda")` gives, runs every network under fp16 autocast
    without a dtype mismatch; autocast "none" runs them in the weights' dtype."""
    from unclip.cli.plan import main
    from unclip.train.plan_sampling import measure_sampling

    tiny_cfgs = [str(ROOT / "configs" / "tiny" / f"{n}.yaml") for n in ("prior", "decoder", "sr32")]
    m = measure_sampling(tiny_cfgs, dtype=torch.float32)
    assert m.dtype == "float32" and m.autocast == "float16"
    assert m.network_autocast == {"prior": "float16", "decoder": "float16", "sr32": "float16"}
    m = measure_sampling(tiny_cfgs, dtype=torch.float32, offload=True)
    assert m.autocast == "float16"  # the execution device's, not the CPU's where offload leaves it
    m = measure_sampling(tiny_cfgs, dtype=torch.float32, autocast_dtype=None)
    assert m.autocast is None and set(m.network_autocast.values()) == {None}
    ar = [str(ROOT / "configs" / "tiny" / n) for n in ("prior_ar.yaml", "decoder.yaml")]
    m = measure_sampling(ar, dtype=torch.float32)  # the autoregressive prior's start and step
    assert m.network_autocast == {"prior": "float16", "decoder": "float16"}
    assert main(["--sample", *tiny_cfgs, "--dtype", "float32", "--autocast", "none"]) == 0
    assert "autocast inside the networks: prior off, decoder off" in capsys.readouterr().out
    for option in (["--dtype", "float32"], ["--autocast", "bf16"]):
        with pytest.raises(SystemExit):
            main([tiny_cfgs[1], *option])  # a sampling option without --sample
        assert "use them with --sample" in capsys.readouterr().err


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


def test_dry_run_runs_every_micro_batch_and_writes_a_checkpoint(monkeypatch):
    """Backward through the real graph once per micro-batch of the config's accumulation, the
    optimizer on its foreach path, the checkpoint's files counted."""
    import unclip.train.plan as plan

    calls = []
    real = plan.fake_backward
    monkeypatch.setattr(plan, "fake_backward", lambda loss: calls.append(1) or real(loss))
    m = measure_step(tiny("sr32", "train.grad_accum_steps=3", "train.gradient_checkpointing=true"))
    assert len(calls) == m.grad_accum_steps == 3
    assert m.optimizer_path == "foreach (capturable)"
    files = m.checkpoint_files
    weights = 4 * m.params_total
    assert weights <= files["model.safetensors"] < weights * 1.01
    assert files["ema.safetensors"] == 4 * m.params_trainable
    assert 2 * weights <= files["optimizer.safetensors"] < 2 * weights * 1.01
    assert m.backward_peak > m.weights + m.grads  # backward's own tensors, measured
    assert m.peak >= m.backward_peak + m.optimizer


def test_dry_run_names_a_parameter_that_gets_no_gradient(monkeypatch):
    """A branch cut from the graph (its output detached) leaves its parameters without a
    gradient on fake CUDA: the dry run fails naming them."""
    import unclip.train.plan as plan

    real = plan._build

    def build_with_a_cut(*args, **kwargs):
        model, task = real(*args, **kwargs)
        model.unet.conv_in.register_forward_hook(lambda mod, args, out: out.detach())
        return model, task

    monkeypatch.setattr(plan, "_build", build_with_a_cut)
    with pytest.raises(RuntimeError, match=r"unet\.conv_in\.weight"):
        measure_step(tiny("sr32"))


def test_throughput_names_the_caption_context_a_real_batch_trims():
    """The dry run counts every caption at the whole context (no values to find the longest
    in); its throughput line says so where training trims: a diffusion prior, a decoder with its
    own caption transformer."""
    from unclip.train.strategies import throughput_line

    own = [f"decoder.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()]
    prior, decoder, own_decoder = measured("prior"), measured("decoder"), measured("decoder", *own)
    assert prior.trimmed_text_positions == 32  # the tiny CLIP's context
    assert decoder.trimmed_text_positions == 0
    assert own_decoder.trimmed_text_positions == TINY_TEXT_ENCODER["text_context_length"]
    line = throughput_line(prior, gpus=8, global_batch=64, max_steps=10)
    assert "every caption counted at its whole 32-token context" in line
    assert "caption" not in throughput_line(decoder, gpus=8, global_batch=64, max_steps=10)
