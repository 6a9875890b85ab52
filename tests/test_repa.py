"""Representation alignment of the base decoder to the CLIP image tower (``repa:``)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, gens
from safetensors.torch import load_file

from unclip.cli import train_decoder
from unclip.nets.clip import CLIP, ClipConfig
from unclip.train.config import load_stage_config
from unclip.train.repa import RepaDecoder, alignment_loss, clip_features, exported_state
from unclip.utils.config import ConfigError

TINY = CONFIGS / "tiny" / "decoder.yaml"
WEIGHTS = "diffusion_pytorch_model.safetensors"
RUN = ["train.progress=false", "train.warmup_steps=0", "train.log_every=1", "train.lr=1e-3"]


def resnet_clip() -> CLIP:
    # the shapes CLIP's architecture (open_clip ModifiedResNet), random weights
    torch.manual_seed(0)
    return CLIP.from_config(
        ClipConfig(
            model_name="shapes-clip",
            model_cfg={
                "embed_dim": 64,
                "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16},
                "text_cfg": {"context_length": 24, "width": 64, "heads": 2, "layers": 1},
            },
        )
    )


def test_clip_features_are_the_towers_own_layer_outputs(tiny_clip):
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    clip = resnet_clip()
    visual = clip.model.visual
    pixels = clip.preprocess_tensor(images)
    with torch.no_grad():
        want = visual.layer2(visual.layer1(visual.stem(pixels)))
    got = clip_features(clip, images, "layer2")
    assert got.shape == (2, 128, 4, 4)
    torch.testing.assert_close(got, want)

    # a ViT block: the patch tokens (class token dropped) on the 4x4 patch grid
    visual = tiny_clip.model.visual
    pixels = tiny_clip.preprocess_tensor(images)
    with torch.no_grad():
        tokens = visual.transformer.resblocks[0](visual._embeds(pixels))
    got = clip_features(tiny_clip, images, "transformer.resblocks.0")
    assert got.shape == (2, tokens.shape[-1], 4, 4)
    torch.testing.assert_close(got[:, :, 1, 2], tokens[:, 1 + 1 * 4 + 2])


def test_clip_layers_that_are_no_feature_map_are_named():
    clip = resnet_clip()
    with pytest.raises(ValueError, match="'attnpool' outputs \\(1, 64\\), not a feature map"):
        clip_features(clip, torch.zeros(1, 3, 32, 32), "attnpool")
    with pytest.raises(ValueError, match="'layer9' names no module; the top-level ones are"):
        clip_features(clip, torch.zeros(1, 3, 32, 32), "layer9")


def test_alignment_loss_is_one_minus_cosine_per_position():
    target = torch.randn(3, 8, 4, 4)
    assert torch.allclose(alignment_loss(2.5 * target, target), torch.zeros(3), atol=1e-6)
    assert torch.allclose(alignment_loss(-target, target), torch.full((3,), 2.0), atol=1e-6)
    # a larger decoder map is average-pooled to the CLIP map's size
    big = target.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    assert torch.allclose(alignment_loss(big, target), torch.zeros(3), atol=1e-6)
    # per position: half the positions orthogonal gives 0.5
    ortho = target.clone()
    ortho[:, :, :2] = 0
    ortho[:, 0, :2] = 1
    half = target.clone()
    half[:, :, :2] = 0
    half[:, 1, :2] = 1
    assert torch.allclose(alignment_loss(ortho, half), torch.full((3,), 0.5), atol=1e-6)
    with pytest.raises(ValueError, match="smaller than the CLIP layer's"):
        alignment_loss(torch.randn(3, 8, 2, 2), target)


def test_the_decoder_loss_adds_the_weighted_alignment_term(tiny_clip):
    from unclip.diffusion.loop import training_scheduler
    from unclip.nets.decoder import encode_captions
    from unclip.train.decoder import build_image_model, decoder_loss

    cfg = load_stage_config(TINY, ["repa.weight=0.3", "repa.clip_layer=transformer.resblocks.0"])
    torch.manual_seed(0)
    model = build_image_model(cfg, tiny_clip)
    assert isinstance(model, RepaDecoder)
    # the target comes from the original at CLIP's size (data.clip_view: full) when given
    batch = {
        "image": torch.rand(2, 3, 16, 16) * 2 - 1,
        "clip_image": torch.rand(2, 3, 32, 32) * 2 - 1,
        "caption": ["a red circle", "two"],
    }
    heads = []
    model.head.register_forward_hook(lambda _m, _a, out: heads.append(out))
    null = encode_captions(cfg.decoder, tiny_clip, [""])
    sched = training_scheduler(cfg.diffusion)
    parts = {}
    total = decoder_loss(model, batch, tiny_clip, null, gens(1, 2), cfg, sched, "cpu", parts)
    plain_cfg = load_stage_config(TINY)
    plain = decoder_loss(model.decoder, batch, tiny_clip, null, gens(1, 2), plain_cfg, sched, "cpu")
    with pytest.raises(TypeError, match="disagree about alignment"):
        decoder_loss(model.decoder, batch, tiny_clip, null, gens(1, 2), cfg, sched, "cpu")
    with pytest.raises(TypeError, match="disagree about alignment"):
        decoder_loss(
            model, batch, tiny_clip, null, gens(1, 2), load_stage_config(TINY), sched, "cpu"
        )
    (align,) = parts["repa"]
    target = clip_features(tiny_clip, batch["clip_image"], "transformer.resblocks.0")
    projected = heads[0].detach()
    assert align == pytest.approx(float(alignment_loss(projected, target).mean()), rel=1e-6)
    assert (
        abs(
            align
            - float(
                alignment_loss(
                    projected, clip_features(tiny_clip, batch["image"], "transformer.resblocks.0")
                ).mean()
            )
        )
        > 1e-4
    )
    torch.testing.assert_close(total, plain + 0.3 * align, rtol=1e-5, atol=1e-6)
    # the term trains the head and the UNet up to the aligned block, not the blocks after it
    model.zero_grad()
    (total - plain).backward()
    assert model.head[0].weight.grad.abs().sum() > 0
    assert model.decoder.unet.down_blocks[0].resnets[0].conv1.weight.grad.abs().sum() > 0
    assert not model.decoder.unet.conv_out.weight.grad.any()


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def repa_run(tmp_path_factory):
    """A tiny decoder trained 12 steps with alignment to the ViT CLIP's first block."""
    out = tmp_path_factory.mktemp("repa") / "run"
    args = [
        str(TINY),
        f"train.output_dir={out}",
        *RUN,
        "train.max_steps=12",
        "train.checkpoint_every=6",
        "train.keep_last=2",
        "repa.weight=1.0",
        "repa.clip_layer=transformer.resblocks.0",
    ]
    assert train_decoder.main(args) == 0
    return out


def test_training_learns_the_alignment_and_exports_the_decoder_alone(repa_run):
    logged = [m["repa_loss"] for m in metrics(repa_run) if "repa_loss" in m]
    assert len(logged) == 12
    assert sum(logged[-3:]) / 3 < sum(logged[:3]) / 3 - 0.05, logged
    exported = load_file(
        str(repa_run / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
    )
    cfg = load_stage_config(TINY)
    torch.manual_seed(0)
    with torch.device("meta"):
        plain = cfg.decoder.build(CLIP.from_config(cfg.clip))
    assert exported.keys() == plain.state_dict().keys()
    ckpt = load_file(str(repa_run / "checkpoints" / "step_00000012" / "model.safetensors"))
    assert any(k.startswith("head.") for k in ckpt)
    assert {k.removeprefix("decoder.") for k in ckpt if k.startswith("decoder.")} == set(exported)
    # the checkpoint's weights read as the decoder's (shapes-eval --decoder-weights,
    # train.init_weights); any other state dict passes through
    as_decoder = exported_state(ckpt)
    assert as_decoder.keys() == exported.keys()
    assert torch.equal(as_decoder["unet.conv_in.weight"], ckpt["decoder.unet.conv_in.weight"])
    assert exported_state(exported) is exported


def test_a_run_with_alignment_resumes_exactly(repa_run, tmp_path):
    out = tmp_path / "split"
    args = [
        str(TINY),
        f"train.output_dir={out}",
        *RUN,
        "train.max_steps=12",
        "train.checkpoint_every=6",
        "repa.weight=1.0",
        "repa.clip_layer=transformer.resblocks.0",
    ]
    assert train_decoder.main([*args, "--max-steps-this-run", "6"]) == 0
    assert train_decoder.main([*args, "--resume", "latest"]) == 0
    whole = load_file(str(repa_run / "checkpoints" / "step_00000012" / "model.safetensors"))
    split = load_file(str(out / "checkpoints" / "step_00000012" / "model.safetensors"))
    assert whole.keys() == split.keys()
    for k in whole:
        assert torch.equal(whole[k], split[k]), k


@pytest.mark.parametrize("source", ["export", "checkpoint"])
def test_initial_weights_load_into_the_decoder_inside(repa_run, tmp_path, source):
    # an exported decoder folder, or a repa checkpoint's model.safetensors (decoder and head)
    src = repa_run / "final" / "decoder"
    if source == "checkpoint":
        src = repa_run / "checkpoints" / "step_00000012" / "model.safetensors"
    out = tmp_path / "ft"
    args = [
        str(TINY),
        f"train.output_dir={out}",
        *RUN,
        "train.max_steps=1",
        "train.lr=1e-12",
        "train.min_lr=0",
        "train.ema=false",
        f"train.init_weights={src}",
        "repa.clip_layer=transformer.resblocks.0",
    ]
    assert train_decoder.main(args) == 0
    before = exported_state(load_file(str(src if src.is_file() else src / WEIGHTS)))
    after = load_file(str(out / "final" / "decoder" / "diffusion_pytorch_model.safetensors"))
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-6)


def test_repa_config_errors():
    with pytest.raises(ConfigError, match="'repa:' aligns the base decoder"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["repa.weight=0.5"])
    with pytest.raises(ConfigError, match="repa.weight"):
        load_stage_config(TINY, ["repa.weight=0"])
    with pytest.raises(ConfigError, match="not supported together"):
        load_stage_config(TINY, ["repa.weight=0.5", "train.init_weights=x", "train.lora.rank=4"])
    cfg = load_stage_config(
        TINY, ["repa.decoder_layer=middle", "repa.clip_layer=transformer.resblocks.0"]
    )
    from unclip.train.decoder import build_image_model

    clip = CLIP.from_config(cfg.clip)
    with pytest.raises(ValueError, match="'middle' names no module; the top-level ones are"):
        build_image_model(cfg, clip)
    # refused when the model is built, not at the first step: a 4 px decoder's 2x2 middle
    # cannot be pooled to the ViT's 4x4 patch grid
    small = load_stage_config(
        TINY,
        ["decoder.sample_size=4", "data.resolution=4", "repa.clip_layer=transformer.resblocks.0"],
    )
    with pytest.raises(ValueError, match=r"features are \(2, 2\), smaller than the CLIP layer's"):
        build_image_model(small, clip)
    vit = load_stage_config(TINY, ["repa.weight=0.5"])
    with pytest.raises(ValueError, match="a ViT image tower: name a block"):
        build_image_model(vit, clip)
    clip.has_vision = False  # as a CLIP converted from a text-to-image folder loads
    good = load_stage_config(TINY, ["repa.clip_layer=transformer.resblocks.0"])
    with pytest.raises(ValueError, match="has no image-tower weights"):
        build_image_model(good, clip)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_training_keeps_the_head_in_sync(tmp_path, strategy):
    """Two gloo processes: the head runs inside the wrapped model's forward, so under DDP its
    gradients are all-reduced with the decoder's and both ranks end with the same weights; under
    FSDP the gathered export is the decoder alone (no head, no prefix)."""
    import os
    import subprocess

    from conftest import ROOT, TORCHRUN

    out = tmp_path / strategy
    cmd = [
        *TORCHRUN,
        str(ROOT / "train_decoder.py"),
        str(TINY),
        f"train.output_dir={out}",
        "train.max_steps=2",
        "train.progress=false",
        "repa.weight=1.0",
        "repa.clip_layer=transformer.resblocks.0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if strategy == "fsdp":
        from test_sharding import launch_env

        env.update(launch_env(ROOT / "configs" / "accelerate" / "fsdp_8gpu.yaml"))
        env["ACCELERATE_MIXED_PRECISION"] = "no"
        assert env["ACCELERATE_USE_FSDP"] == "true"  # the loop shards the model on CPU too
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = json.loads((out / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
    ckpt = load_file(str(out / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert any(k.startswith("head.") for k in ckpt)
    exported = load_file(str(out / "final" / "decoder" / WEIGHTS))
    assert exported.keys() == exported_state(ckpt).keys()


def test_the_logged_alignment_is_the_mean_since_the_last_log(tiny_clip):
    from unclip.train.decoder import DecoderTask, build_image_model

    cfg = load_stage_config(TINY, ["repa.clip_layer=transformer.resblocks.0"])
    torch.manual_seed(0)
    model = build_image_model(cfg, tiny_clip)
    task = DecoderTask(cfg, tiny_clip, "cpu")
    batch = {"image": torch.rand(2, 3, 16, 16) * 2 - 1, "caption": ["a red circle", "two"]}
    task.loss(model, batch, gens(1, 2))
    task.loss(model, batch, gens(3, 4))
    first, second = task.parts["repa"]
    assert first != second
    assert task.log_metrics() == {"repa_loss": pytest.approx((first + second) / 2)}
    assert task.log_metrics() == {}
