"""Training: loss falls per stage, exact resume, accumulation equivalence, DDP on gloo, bad data,
export."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, ROOT, TORCHRUN
from safetensors.torch import load_file

from unclip import UnCLIPPipeline
from unclip.cli import train_decoder, train_prior
from unclip.nets.decoder import degrade, gaussian_blur
from unclip.train.loop import NonFiniteError
from unclip.train.optimizers import warmup_cosine

CFG = {
    "prior": CONFIGS / "tiny" / "prior.yaml",
    "decoder": CONFIGS / "tiny" / "decoder.yaml",
    "sr32": CONFIGS / "tiny" / "sr32.yaml",
    "sr64": CONFIGS / "tiny" / "sr64.yaml",
}
QUIET = ["train.progress=false"]
# one optimizer step that barely moves the weights: the exported weights are the initial ones
STILL_STEP = [
    "train.max_steps=1",
    "train.lr=1e-9",
    "train.min_lr=1e-9",
    "train.warmup_steps=0",
    "train.ema=false",
    "train.log_every=1",
]


def train(stage, out, *overrides, args=()):
    main = train_prior.main if stage == "prior" else train_decoder.main
    return main([str(CFG[stage]), f"train.output_dir={out}", *QUIET, *overrides, *args])


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(out):
    return [m["loss"] for m in metrics(out) if "loss" in m]


def weights(folder):
    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return load_file(str(files[0]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each tiny stage trained for 40 steps on the shapes world (shared by the tests below)."""
    root = tmp_path_factory.mktemp("runs")
    for stage in CFG:
        assert (
            train(
                stage,
                root / stage,
                "train.max_steps=40",
                "train.log_every=1",
                "train.lr=2e-3",
                "train.warmup_steps=2",
                "train.checkpoint_every=20",
            )
            == 0
        )
    return root


@pytest.mark.parametrize("stage", list(CFG))
def test_loss_falls_on_shapes(trained, stage):
    ls = losses(trained / stage)
    assert len(ls) == 40 and all(map(torch.isfinite, torch.tensor(ls)))
    first, last = sum(ls[:8]) / 8, sum(ls[-8:]) / 8
    assert last < 0.75 * first, (stage, first, last)


def test_exported_stage_settings_leave_out_training_only_defaults(trained):
    # older versions refuse unknown diffusion keys: the ones only training reads are left out
    # at their defaults, the sampling ones are all there
    meta = json.loads((trained / "decoder" / "final" / "decoder" / "unclip_stage.json").read_text())
    assert "timestep_shift" not in meta["diffusion"] and "vlb_weight" not in meta["diffusion"]
    assert {"prediction_type", "beta_schedule", "num_train_timesteps"} <= set(meta["diffusion"])


def test_exported_components_generate(trained, tmp_path):
    from unclip.cli.assemble import main as assemble

    final = {s: trained / s / "final" for s in CFG}
    assert (final["decoder"] / "decoder" / "unclip_stage.json").is_file()
    assert (
        assemble(
            [
                "--clip",
                str(final["prior"] / "clip"),
                "--prior",
                str(final["prior"] / "prior"),
                "--decoder",
                str(final["decoder"] / "decoder"),
                "--upsampler",
                str(final["sr32"] / "sr32"),
                "--upsampler",
                str(final["sr64"] / "sr64"),
                "--out",
                str(tmp_path / "pipe"),
            ]
        )
        == 0
    )
    pipe = UnCLIPPipeline.from_pretrained(tmp_path / "pipe")
    assert pipe.stage_names == ["prior", "decoder", "sr32", "sr64"]
    out = pipe(
        "a small red circle on the left",
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        progress=False,
        sampling={"prior": {"steps": 3}, "decoder": {"steps": 3}, "upsampler": {"steps": 2}},
    )
    assert out.images.shape == (1, 3, 64, 64) and torch.isfinite(out.images).all()
    # the exported decoder holds the EMA weights, not the raw ones
    ckpt = sorted((trained / "decoder" / "checkpoints").glob("step_*"))[-1]
    raw = load_file(str(ckpt / "model.safetensors"))
    ema = weights(final["decoder"] / "decoder")
    key = next(k for k in ema if k.startswith("unet.conv_in.weight"))
    assert not torch.equal(raw[key], ema[key])


def test_init_weights_starts_from_an_exported_component(trained, tmp_path):
    """``train.init_weights`` fine-tunes: the run starts from the given weights (a component folder,
    or a fp16 ``.safetensors`` file as shipped), so its first loss is that of the trained model;
    weights that do not fit the config, or a wrong path, are refused with a clear error."""
    src = trained / "decoder" / "final" / "decoder"
    tiny = STILL_STEP
    assert train("decoder", tmp_path / "scratch", *tiny) == 0
    assert train("decoder", tmp_path / "ft", *tiny, f"train.init_weights={src}") == 0
    init, ft, scratch = (
        weights(src),
        weights(tmp_path / "ft" / "final" / "decoder"),
        weights(tmp_path / "scratch" / "final" / "decoder"),
    )
    assert max(float((init[k] - ft[k]).abs().max()) for k in init) < 1e-5
    assert max(float((init[k] - scratch[k]).abs().max()) for k in init) > 1e-2
    assert losses(tmp_path / "ft")[0] < 0.75 * losses(tmp_path / "scratch")[0]
    from safetensors.torch import save_file

    half = tmp_path / "half.safetensors"
    save_file({k: v.half() for k, v in init.items()}, str(half))
    assert train("decoder", tmp_path / "ft16", *tiny, f"train.init_weights={half}") == 0
    ft16 = weights(tmp_path / "ft16" / "final" / "decoder")
    assert all(ft16[k].dtype == torch.float32 for k in ft16)
    assert max(float((init[k] - ft16[k]).abs().max()) for k in init) < 1e-2
    with pytest.raises(ValueError, match="do not fit this model"):
        train(
            "decoder",
            tmp_path / "bad",
            *tiny,
            f"train.init_weights={trained / 'sr32' / 'final' / 'sr32'}",
        )
    with pytest.raises(FileNotFoundError, match="init_weights"):
        train("decoder", tmp_path / "bad2", *tiny, f"train.init_weights={tmp_path / 'nowhere'}")


def test_partial_init_weights_give_the_decoder_its_own_caption_transformer(
    trained, tmp_path, caplog
):
    """``train.init_weights_partial`` fine-tunes a changed architecture: a decoder given its own
    caption transformer starts from a CLIP-token decoder's weights — every tensor that fits by name
    and shape is loaded, the caption transformer keeps its fresh initialisation. Without the flag
    the mismatch is refused, naming the flag; weights of which nothing fits are an error."""
    src = trained / "decoder" / "final" / "decoder"
    tiny = STILL_STEP
    own = [  # width 32 = the tiny CLIP's text width, so the caption projections fit too
        "decoder.text_encoder=transformer",
        "decoder.text_encoder_width=32",
        "decoder.text_encoder_layers=1",
        "decoder.text_encoder_heads=2",
        "decoder.text_context_length=16",
    ]
    with pytest.raises(ValueError, match="init_weights_partial"):
        train("decoder", tmp_path / "strict", *tiny, *own, f"train.init_weights={src}")
    partial = [f"train.init_weights={src}", "train.init_weights_partial=true"]
    with caplog.at_level("WARNING", logger="unclip.train"):
        assert train("decoder", tmp_path / "ft", *tiny, *own, *partial) == 0
    assert "loaded partially" in caplog.text and "text_transformer." in caplog.text
    assert train("decoder", tmp_path / "scratch", *tiny, *own) == 0
    init = weights(src)
    ft = weights(tmp_path / "ft" / "final" / "decoder")
    scratch = weights(tmp_path / "scratch" / "final" / "decoder")
    loaded = [k for k in ft if k in init]
    fresh = [k for k in ft if k not in init]
    assert len(loaded) == len(init) and fresh
    assert all(k.startswith("text_transformer.") for k in fresh), fresh[:3]
    assert max(float((init[k] - ft[k]).abs().max()) for k in loaded) < 1e-5
    # the new part is the same fresh initialisation as a run from scratch (same seed)
    assert max(float((scratch[k] - ft[k]).abs().max()) for k in fresh) < 1e-5
    # a caption width unlike the CLIP's: its projections have another shape and stay fresh too
    caplog.clear()
    wide = [*own[:1], "decoder.text_encoder_width=48", *own[2:]]
    assert train("decoder", tmp_path / "wide", *tiny, *wide, *partial) == 0
    assert "loaded partially" in caplog.text and "of another shape" in caplog.text
    ft48 = weights(tmp_path / "wide" / "final" / "decoder")
    reshaped = [k for k in init if ft48[k].shape != init[k].shape]
    assert reshaped and all(k.startswith(("text_to_time.", "text_tokens_proj.")) for k in reshaped)
    same = [k for k in init if k not in reshaped]
    assert max(float((init[k] - ft48[k]).abs().max()) for k in same) < 1e-5
    from safetensors.torch import save_file

    alien = tmp_path / "alien.safetensors"
    save_file({"something.else": torch.zeros(3)}, str(alien))
    with pytest.raises(ValueError, match="no tensor fits"):
        train(
            "decoder",
            tmp_path / "alien",
            *tiny,
            *own,
            f"train.init_weights={alien}",
            "train.init_weights_partial=true",
        )


def test_partial_init_loads_the_ar_prior_fit_whole_or_not_at_all(tmp_path):
    """The AR prior's quantiser fit (PCA, bucket edges, the "fitted" flag) is one unit: a partial
    load that cannot place all of it leaves the prior unfitted, so training refits it instead of
    using a half-loaded fit; options that cannot work together are refused."""
    from safetensors.torch import save_file

    from unclip.nets.ar_prior import UnCLIPARPrior
    from unclip.train.config import LoraTrainConfig, TrainConfig
    from unclip.train.init_weights import load_initial_weights
    from unclip.utils.config import ConfigError

    def prior(pca_dims):
        torch.manual_seed(0)
        kw = dict(embed_dim=8, text_width=8, context_length=4, num_layers=1)
        return UnCLIPARPrior(**kw, num_attention_heads=2, attention_head_dim=4, pca_dims=pca_dims)

    src = prior(4)
    src.fitted.fill_(1.0)
    src.pca_mean.normal_()
    save_file(src.state_dict(), str(tmp_path / "p.safetensors"))
    same = prior(4)
    load_initial_weights(same, tmp_path / "p.safetensors", partial=True)
    assert same.is_fitted and torch.equal(same.pca_mean, src.pca_mean)
    other = prior(6)  # pca_components / bucket_edges of another shape: the fit cannot load whole
    load_initial_weights(other, tmp_path / "p.safetensors", partial=True)
    assert not other.is_fitted and not other.pca_mean.any()
    with pytest.raises(ConfigError, match="init_weights_partial"):
        TrainConfig(init_weights_partial=True).validate()
    lora = LoraTrainConfig(rank=4)
    with pytest.raises(ConfigError, match="would never train"):
        TrainConfig(init_weights="w", init_weights_partial=True, lora=lora).validate()


def test_checkpoints_keep_last_and_sample_grid(tmp_path):
    assert (
        train(
            "decoder",
            tmp_path / "r",
            "train.max_steps=6",
            "train.checkpoint_every=2",
            "train.keep_last=2",
            "train.sample_every=3",
            "train.trackers=[tensorboard]",
        )
        == 0
    )
    events = list((tmp_path / "r" / "logs").rglob("events.out.tfevents*"))
    assert events  # TensorBoard tracker wrote events
    # the sample grids go to the tracker too, with their captions
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("samples")] == [3, 6]
    captions = acc.Tensors("samples/captions/text_summary")
    assert [e.step for e in captions] == [3, 6]
    assert b"|" in captions[0].tensor_proto.string_val[0] or captions[0].tensor_proto.string_val
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006"]
    assert sorted(p.name for p in (tmp_path / "r" / "samples").iterdir()) == [
        "step_00000003.png",
        "step_00000006.png",
    ]
    assert (tmp_path / "r" / "config.yaml").is_file() and (
        tmp_path / "r" / "checkpoints" / "step_00000006" / "config.yaml"
    ).is_file()


@pytest.mark.parametrize("stage", ["decoder", "prior"])
def test_resume_is_exact(tmp_path, stage):
    common = ["train.max_steps=6", "train.checkpoint_every=3", "train.warmup_steps=2"]
    assert train(stage, tmp_path / "full", *common) == 0
    # first half: stop after 3 steps as a preempted job would (checkpoint, no export)
    assert train(stage, tmp_path / "split", *common, args=["--max-steps-this-run", "3"]) == 0
    assert not (tmp_path / "split" / "final").exists()
    # a half-written checkpoint left by a killed job is ignored
    (tmp_path / "split" / "checkpoints" / "step_00000005.tmp").mkdir()
    assert train(stage, tmp_path / "split", *common, args=["--resume", "latest"]) == 0
    name = "prior" if stage == "prior" else "decoder"
    a, b = weights(tmp_path / "full" / "final" / name), weights(tmp_path / "split" / "final" / name)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    init = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert any(not torch.equal(init[k], a[k]) for k in init if k in a)


def test_finished_run_continues_to_more_steps(tmp_path):
    """``--resume latest`` with a larger ``train.max_steps`` trains a finished run further: it goes
    on from its last step, the schedule restarts at the cosine point of the new total, and
    ``final/`` is replaced by the longer run's weights."""
    out = tmp_path / "r"
    common = [
        "train.checkpoint_every=4",
        "train.warmup_steps=0",
        "train.log_every=1",
        "train.lr=1e-3",
    ]
    assert train("decoder", out, "train.max_steps=4", *common) == 0
    first = weights(out / "final" / "decoder")
    before = [m for m in metrics(out) if "lr" in m]
    assert [m["step"] for m in before] == [1, 2, 3, 4] and before[-1][
        "lr"
    ] < 1e-4  # decayed at the end
    assert train("decoder", out, "train.max_steps=8", *common, args=["--resume", "latest"]) == 0
    after = [m for m in metrics(out) if "lr" in m][4:]
    assert [m["step"] for m in after] == [5, 6, 7, 8]
    assert (
        after[0]["lr"] > 100 * before[-1]["lr"] and after[-1]["lr"] < after[0]["lr"]
    )  # restart, decay again
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00000008"
    longer = weights(out / "final" / "decoder")
    assert any(not torch.equal(first[k], longer[k]) for k in first)


def initial_decoder_weights() -> dict:
    """The weights a tiny decoder run starts from: built as ``train_decoder`` builds them (seeded
    with ``train.seed``, the CLIP first)."""
    from unclip.nets.clip import CLIP
    from unclip.train.config import load_stage_config

    cfg = load_stage_config(CFG["decoder"])
    torch.manual_seed(cfg.train.seed)
    model = cfg.decoder.build(CLIP.from_config(cfg.clip))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulation_matches_big_batch(tmp_path):
    common = ["train.max_steps=2", "train.ema=false", "train.warmup_steps=0"]
    assert (
        train("decoder", tmp_path / "acc", *common, "data.batch_size=1", "train.grad_accum_steps=8")
        == 0
    )
    assert (
        train("decoder", tmp_path / "big", *common, "data.batch_size=8", "train.grad_accum_steps=1")
        == 0
    )
    w = {n: weights(tmp_path / n / "final" / "decoder") for n in ("acc", "big")}
    w["init"] = initial_decoder_weights()
    # compare the whole update (final - init), not single weights: AdamW's second step divides by
    # sqrt(v), and where two steps' gradients nearly cancel it magnifies float summation-order noise
    # (batch 1 vs batch 8 convolutions) in a few elements to ~3 % of lr. A wrong accumulation (other
    # data, stepping every micro-batch) changes the update by tens of percent.
    update = {
        n: torch.cat([(w[n][k] - w["init"][k]).flatten() for k in w["init"]])
        for n in ("acc", "big")
    }
    assert float((update["acc"] - update["big"]).norm() / update["big"].norm()) < 1e-3
    init_changed = metrics(tmp_path / "acc")[-2]["loss"]
    assert init_changed == pytest.approx(metrics(tmp_path / "big")[-2]["loss"], rel=1e-4)


@pytest.mark.parametrize("powersgd", [0, 1])
def test_two_process_torchrun_gloo(tmp_path, powersgd):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        *TORCHRUN,
        str(ROOT / "train_decoder.py"),
        str(CFG["decoder"]),
        f"train.output_dir={out}",
        "train.max_steps=3",
        "train.progress=false",
        f"train.powersgd_rank={powersgd}",
        "train.powersgd_start_step=2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = json.loads((out / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
    # the two ranks trained on different samples: a single-process run with the same config differs
    assert train("decoder", tmp_path / "single", "train.max_steps=3") == 0
    single = weights(tmp_path / "single" / "final" / "decoder")
    ddp = weights(out / "final" / "decoder")
    assert any(not torch.allclose(single[k], ddp[k]) for k in single)


def _corrupt_shard(path: Path, good_dir: Path):
    """A tar whose first members are bad (garbage jpg, missing caption), then good shapes
    samples."""
    import io

    with tarfile.open(path, "w") as tar:

        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("bad0.jpg", b"\xff\xd8\xff garbage")
        add("bad0.txt", b"a red circle")
        add("bad1.png", (good_dir / sorted(p.name for p in good_dir.glob("*.png"))[0]).read_bytes())
        for i, png in enumerate(sorted(good_dir.glob("*.png"))):
            add(f"good{i:03d}.png", png.read_bytes())
            add(f"good{i:03d}.txt", png.with_suffix(".txt").read_bytes())


def test_corrupt_samples_are_skipped_and_counted(tmp_path):
    from unclip.shapes.export import write_shapes

    write_shapes(tmp_path / "imgs", 8, resolution=16, format="folder", progress=False)
    shard = tmp_path / "shard-00000.tar"
    _corrupt_shard(shard, tmp_path / "imgs")
    assert (
        train(
            "decoder",
            tmp_path / "r",
            "data.source=webdataset",
            f"data.path={shard}",
            "data.batch_size=4",
            "data.shuffle_buffer=1",
            "train.max_steps=2",
        )
        == 0
    )
    last = metrics(tmp_path / "r")[-1]
    assert last["skipped_data_total"] == 2


def test_gradient_checkpointing_gives_the_same_training(tmp_path):
    common = ["train.max_steps=2", "train.ema=false", "train.warmup_steps=0"]
    assert train("decoder", tmp_path / "a", *common) == 0
    assert train("decoder", tmp_path / "b", *common, "train.gradient_checkpointing=true") == 0
    a, b = (
        weights(tmp_path / "a" / "final" / "decoder"),
        weights(tmp_path / "b" / "final" / "decoder"),
    )
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_nonfinite_steps_are_skipped_then_stop(tmp_path):
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer steps had a non-finite"):
        train(
            "decoder",
            tmp_path / "r",
            "train.lr=1e30",
            "train.warmup_steps=0",
            "train.max_steps=50",
            "train.max_consecutive_nonfinite=3",
            "train.checkpoint_every=100",
        )
    ckpts = list((tmp_path / "r" / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1  # the state at the stop is kept


def test_bf16_mixed_precision_on_cpu(tmp_path):
    assert (
        train(
            "decoder",
            tmp_path / "r",
            "train.mixed_precision=bf16",
            "train.max_steps=2",
            "train.log_every=1",
        )
        == 0
    )
    assert all(map(lambda x: x == x, losses(tmp_path / "r")))


def test_auto_mixed_precision_uses_bf16_only_where_the_cpu_runs_it(monkeypatch):
    from unclip.train import optimizers as training
    from unclip.utils import precision

    assert (
        training.auto_mixed_precision("no") == "no"
        and training.auto_mixed_precision("bf16") == "bf16"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    expected = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    assert precision.native_cpu_bf16() == (expected == "bf16")
    assert training.auto_mixed_precision("auto") == expected
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: not (expected == "bf16"))
    assert training.auto_mixed_precision("auto") == ("no" if expected == "bf16" else "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training.auto_mixed_precision("auto") == "fp16"
    # a loop that trains on the CPU of a GPU machine (train-clip) gets the CPU's choice
    assert training.auto_mixed_precision("auto", gpu=False) == (
        "no" if expected == "bf16" else "bf16"
    )
    # a launch file's precision wins, but fp16 only where there is a GPU to run it
    assert training.auto_mixed_precision("auto", gpu=True, launched="fp16") == "fp16"
    assert training.auto_mixed_precision("auto", gpu=False, launched="bf16") == "bf16"
    assert training.auto_mixed_precision("auto", gpu=False, launched="fp16") == (
        "no" if expected == "bf16" else "bf16"
    )


def test_prior_trains_with_plain_attention_in_bf16_on_a_cpu(monkeypatch):
    """In bf16 on a CPU the prior's attention runs as matmul + softmax, not the fused kernel
    (slower there over few positions); in fp32 the fused kernel stays."""
    from torch.profiler import ProfilerActivity, profile

    from unclip.nets.clip import CLIP
    from unclip.train.config import load_stage_config
    from unclip.train.data.loader import make_batches
    from unclip.train.loop import sample_generators
    from unclip.train.prior import PriorTask, build_prior_model
    from unclip.utils import precision

    def step_ops(precision):
        cfg = load_stage_config(
            CONFIGS / "tiny" / "prior.yaml", [f"train.mixed_precision={precision}"]
        )
        torch.manual_seed(0)
        clip = CLIP.from_config(cfg.clip)
        task, model = PriorTask(cfg, clip, "cpu"), build_prior_model(cfg, clip)
        batch = next(
            iter(make_batches(cfg.data, resolution=clip.image_size, seed=0, rank=0, world_size=1))
        )
        gens = sample_generators(0, 0, 0, len(batch["caption"]))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.autocast("cpu", torch.bfloat16, enabled=precision != "no"):
                loss = task.loss(model, batch, gens)  # as Accelerate runs it
            loss.backward()
        return task, {e.key for e in prof.key_averages()}, float(loss.detach())

    fused = "aten::_scaled_dot_product_flash_attention_for_cpu"
    task, ops, loss32 = step_ops("no")
    assert not task.plain_attention and fused in ops
    task, ops, loss16 = step_ops("bf16")
    assert task.plain_attention and fused not in ops and "aten::_softmax" in ops
    assert loss16 == pytest.approx(loss32, rel=0.05)  # the same loss, to bf16's rounding
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)
    assert step_ops("auto")[0].plain_attention  # what auto picks where bf16 is native


def test_warmup_cosine_schedule():
    kw = dict(warmup=10, total=110, base_lr=1e-3, min_lr=1e-6)
    assert warmup_cosine(0, **kw) == pytest.approx(0.1)
    assert warmup_cosine(9, **kw) == pytest.approx(1.0)
    assert warmup_cosine(60, **kw) * 1e-3 == pytest.approx((1e-3 + 1e-6) / 2, rel=1e-6)
    assert warmup_cosine(110, **kw) * 1e-3 == pytest.approx(1e-6)
    assert warmup_cosine(500, **kw) * 1e-3 == pytest.approx(1e-6)


def test_low_res_corruptions():
    g = [torch.Generator().manual_seed(i) for i in range(2)]
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    sharp = torch.nn.functional.interpolate(x, size=(16, 16), mode="bicubic", antialias=True)
    blur = degrade(x, 16, "blur", g, (0.4, 0.6))
    assert blur.shape == (2, 3, 16, 16)

    def hf(t):
        return (t[..., 1:, :] - t[..., :-1, :]).abs().mean()

    assert hf(blur) < hf(sharp)
    bsr = degrade(x, 16, "bsr", [torch.Generator().manual_seed(i) for i in range(2)])
    assert bsr.shape == (2, 3, 16, 16) and bsr.abs().max() <= 1
    assert not torch.allclose(
        bsr[0], degrade(x, 16, "bsr", [torch.Generator().manual_seed(5)] * 2)[0]
    )
    assert torch.allclose(gaussian_blur(x, torch.zeros(2)), x, atol=1e-6)
    with pytest.raises(ValueError, match="unknown low-res corruption"):
        degrade(x, 16, "jpeg", g)


def test_wrong_stage_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="this command trains decoder or upsampler"):
        train_decoder.main([str(CFG["prior"]), f"train.output_dir={tmp_path}"])


def test_upsampler_sample_grid_runs_the_pipeline_upsample_step(tmp_path):
    """The upsampler's grid comes from :func:`unclip.sampling.sample_upsampler` (the step
    ``UnCLIPPipeline.upsample`` runs): low-res inputs (top row, enlarged) and their upsampled
    samples (bottom row); with a sampling noise level the low-res input is noised first, which
    changes the samples."""
    from PIL import Image

    grids = {}
    for level in (0, 200):
        out = tmp_path / f"level{level}"
        assert (
            train(
                "sr32",
                out,
                "train.max_steps=2",
                "train.sample_every=2",
                f"upsampler.noise_level={level}",
            )
            == 0
        )
        grids[level] = Image.open(out / "samples" / "step_00000002.png").convert("RGB")
        assert grids[level].size == (8 * 32, 2 * 32)
    top = (0, 0, 8 * 32, 32)
    bottom = (0, 32, 8 * 32, 64)
    assert grids[0].crop(top).tobytes() == grids[200].crop(top).tobytes()
    assert grids[0].crop(bottom).tobytes() != grids[200].crop(bottom).tobytes()


def test_train_loop_trains_any_task(tmp_path):
    """The loop is stage-agnostic: a task supplies its loss (and optional hooks); the loop feeds it
    ``grad_accum_steps`` micro-batches per step, calls ``after_optimizer_step`` after each step, and
    writes no sample grid for a task without one."""
    from dataclasses import dataclass

    from unclip.train.config import TrainConfig
    from unclip.train.loop import TrainLoop

    @dataclass
    class Config:
        train: TrainConfig

    train_cfg = TrainConfig(
        output_dir=str(tmp_path),
        max_steps=5,
        grad_accum_steps=2,
        warmup_steps=0,
        lr=0.05,
        mixed_precision="no",
        ema=False,
        trackers=[],
        progress=False,
        log_every=1,
        sample_every=1,
    )

    class FitLine:
        name = "line"
        steps_taken = 0

        def loss(self, model, batch, generators):
            assert len(generators) == len(batch["x"])
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

        def after_optimizer_step(self, model):
            self.steps_taken += 1

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(4, 1, generator=g)
            yield {"x": x, "y": 3 * x, "caption": [""] * 4}

    loop = TrainLoop(Config(train_cfg))
    torch.manual_seed(0)
    loop.prepare(torch.nn.Linear(1, 1))
    task = FitLine()
    assert loop.run(task, data()) is True
    loop.finish()
    assert task.steps_taken == 5 and loop.state.step == 5 and loop.state.samples == 5 * 2 * 4
    ls = losses(tmp_path)
    assert len(ls) == 5 and ls[-1] < ls[0]
    assert not (tmp_path / "samples").exists()
    assert (tmp_path / "checkpoints" / "step_00000005").is_dir()


def test_the_share_of_time_spent_waiting_for_data_is_logged(tmp_path):
    """``data_wait_share`` in metrics.jsonl: the share of the time between two logs spent waiting
    for batches, on a fake clock that the data source and the step advance."""
    from dataclasses import dataclass

    from unclip.train.config import TrainConfig
    from unclip.train.loop import TrainLoop

    @dataclass
    class Config:
        train: TrainConfig

    now = [0.0]

    class OneSecondStep:  # each step's loss takes one second of the fake clock
        name = "line"

        def loss(self, model, batch, generators):
            now[0] += 1.0
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def run(name, wait):
        cfg = TrainConfig(
            output_dir=str(tmp_path / name),
            max_steps=3,
            warmup_steps=0,
            mixed_precision="no",
            ema=False,
            trackers=[],
            progress=False,
            log_every=1,
            checkpoint_every=0,
        )

        def source():
            while True:
                now[0] += wait
                yield {"x": torch.ones(2, 1), "y": torch.ones(2, 1), "caption": [""] * 2}

        loop = TrainLoop(Config(cfg))
        loop.clock = lambda: now[0]
        loop.prepare(torch.nn.Linear(1, 1))
        loop.run(OneSecondStep(), source())
        loop.finish()
        return [m["data_wait_share"] for m in metrics(tmp_path / name) if "loss" in m]

    # 3 s waiting for every 1 s step: three quarters of the time
    assert run("slow", 3.0) == pytest.approx([0.75] * 3)
    assert run("ready", 0.0) == [0.0] * 3


def test_the_prior_logs_how_close_its_predicted_embeddings_are(tmp_path):
    """Besides its loss the prior logs ``embed_cosine``: the mean cosine between the image
    embeddings it predicts at the trained timesteps and the true ones, a quality signal."""
    out = tmp_path / "p"
    assert train("prior", out, "train.max_steps=3", "train.log_every=1") == 0
    rows = [m for m in metrics(out) if "loss" in m]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(-1.0 <= m["embed_cosine"] <= 1.0 for m in rows)
    assert len({m["embed_cosine"] for m in rows}) > 1  # measured each time, not a constant
