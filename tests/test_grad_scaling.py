"""DALL-E's per-resblock gradient scaling (``train.resblock_grad_scaling``,
``unclip.train.grad_scaling``): the update is unchanged, an overflowing block backs off alone, the
scales are training state."""

import json

import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file

from unclip.cli import train_decoder
from unclip.pipeline.tiny import tiny_pipeline
from unclip.train.config import load_stage_config
from unclip.train.grad_scaling import GROWTH, MAX_SCALE, ResblockGradScaler
from unclip.utils.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=0)


def decoder_grads(pipe, scales=None, checkpointing=False):
    """Parameter gradients of the tiny decoder for a fixed batch; ``scales``: per-block gradient
    scales to train with (removed afterwards)."""
    dec = pipe.decoder.train()
    dec.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    x, emb = torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 32, generator=g)
    text = pipe.clip.encode_text(["a red square", "two blue circles"])
    if checkpointing:
        dec.enable_gradient_checkpointing()
    scaler = None
    if scales is not None:
        scaler = ResblockGradScaler(dec)
        scaler.scales.copy_(scales(len(scaler.blocks)))
    try:
        dec(x, torch.tensor([10, 500]), emb, text).pow(2).mean().backward()
        if scaler is not None:
            scaler.unscale_()
            assert not scaler.overflow.any()
    finally:
        if scaler is not None:
            scaler.remove()
        if checkpointing:
            dec.disable_gradient_checkpointing()
    return {n: p.grad.clone() for n, p in dec.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp32_gradients_are_unchanged(pipe, checkpointing):
    """Scales from 2^10 down to 2^-17, one per block (10 blocks): every gradient equals the
    unscaled run's to float rounding, also under activation checkpointing. Without the division at
    the parameters or at the block inputs, gradients would be off by those factors."""
    ref = decoder_grads(pipe)
    got = decoder_grads(
        pipe,
        lambda n: torch.tensor([2.0 ** (10 - 3 * i) for i in range(n)]),
        checkpointing=checkpointing,
    )
    assert got.keys() == ref.keys()
    for k in ref:
        scale = ref[k].abs().max().clamp(min=1e-20)
        assert (got[k] - ref[k]).abs().max() / scale < 1e-5, k


def test_fp16_overflowing_block_backs_off_alone_and_training_goes_on(pipe):
    """Under CPU fp16 autocast, a block whose scale makes its gradients overflow fp16 is the only
    one marked (the filter stops its infinities at its input, so the blocks before it stay
    finite); the step is skipped and its scale halves until its gradients fit, while the other
    blocks' scales grow; then steps are taken and the weights stay finite."""
    up = pipe.upsamplers[0].train()
    before = [p.detach().clone() for p in up.parameters()]
    scaler = ResblockGradScaler(up)
    hot = 3
    scaler.scales[hot] = MAX_SCALE
    opt = torch.optim.SGD(up.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, low = torch.randn(2, 3, 32, 32, generator=g), torch.randn(2, 3, 32, 32, generator=g)
    marked, taken = [], []
    try:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                out = up(x, torch.tensor([10, 500]), low)
            (out.float().pow(2).mean() * 256).backward()
            scaler.unscale_()
            marked.append(scaler.overflow.nonzero().flatten().tolist())
            norm = torch.nn.utils.clip_grad_norm_(up.parameters(), float("inf"))
            taken.append(bool(torch.isfinite(norm)))
            if taken[-1]:
                opt.step()
            opt.zero_grad(set_to_none=True)
            scaler.update()
    finally:
        scaler.remove()
    assert marked[0] == [hot] and not taken[0]
    assert marked[-1] == [] and taken[-1]
    n_over = sum(1 for m in marked if m)
    assert scaler.scales[hot] == pytest.approx(MAX_SCALE * 0.5**n_over * GROWTH ** (4 - n_over))
    others = [s for i, s in enumerate(scaler.scales.tolist()) if i != hot]
    assert others == pytest.approx([GROWTH**4] * len(others))
    assert all(torch.isfinite(p).all() for p in up.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, up.parameters()))


def test_training_with_scaling_resumes_exactly(tmp_path):
    """A decoder run with the option keeps the scales in its checkpoints (fp32: no overflow, so
    each grows by 2^(1/1000) per step) and a resumed run repeats an uninterrupted one exactly: the
    scales are not powers of two, so restoring them wrongly would move the last bits."""
    common = [
        str(CONFIGS / "tiny" / "decoder.yaml"),
        "train.progress=false",
        "train.resblock_grad_scaling=true",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.warmup_steps=1",
    ]
    full, split = tmp_path / "full", tmp_path / "split"
    assert train_decoder.main([*common, f"train.output_dir={full}"]) == 0
    args = [*common, f"train.output_dir={split}"]
    assert train_decoder.main([*args, "--max-steps-this-run", "2"]) == 0
    state = json.loads((split / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    scales = state["resblock_grad_scales"]["scales"]
    assert len(scales) == 10 and scales == pytest.approx([GROWTH**2] * 10)
    assert train_decoder.main([*args, "--resume", "latest"]) == 0
    a = load_file(str(full / "final" / "decoder" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(split / "final" / "decoder" / "diffusion_pytorch_model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_option_applies_to_unet_stages_only():
    with pytest.raises(ConfigError, match="resblock_grad_scaling applies to the decoder and up"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["train.resblock_grad_scaling=true"])
    cfg = load_stage_config(CONFIGS / "tiny" / "sr32.yaml", ["train.resblock_grad_scaling=true"])
    assert cfg.train.resblock_grad_scaling is True
    with pytest.raises(ValueError, match="no residual blocks"):
        ResblockGradScaler(torch.nn.Linear(2, 2))
