"""The decoder's attention as plain matrix products (unclip.nets.attention): the same outputs and
gradients as diffusers' SDPA processor, processors put back after the block, and the decoder's
training loss using it on a CPU in bf16 only."""

import pytest
import torch
from conftest import CONFIGS, gens
from diffusers.models.attention_processor import Attention, AttnAddedKVProcessor2_0

from unclip.nets.attention import ExplicitAddedKVProcessor, explicit_attention
from unclip.nets.text_encoding import TextEncoding
from unclip.pipeline.tiny import TINY_TEXT_ENCODER
from unclip.train.config import load_stage_config

TINY = CONFIGS / "tiny" / "decoder.yaml"


def _processors(model):
    return [type(m.processor) for m in model.modules() if isinstance(m, Attention)]


def _forward(pipe, x, cond):
    out = pipe.decoder(x, torch.tensor([10, 500]), cond=cond)
    out.square().mean().backward()
    return out.detach(), x.grad.clone()


def test_explicit_attention_equals_sdpa_with_a_text_mask(tiny_pipe):
    dec = tiny_pipe.decoder
    assert AttnAddedKVProcessor2_0 in _processors(dec)
    text = tiny_pipe.encode_text(["a red circle", "two blue squares and a long caption"])
    both = TextEncoding.cat([tiny_pipe.null_text(1), text[:1]])
    assert not both.text_mask.all()  # padding masked out: the mask path is exercised
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # one conditioning for both passes, outside their graphs
        cond = dec.condition(torch.randn(2, tiny_pipe.clip.embed_dim, generator=g), both)
    size = dec.config.sample_size
    x0 = torch.randn(2, 3, size, size, generator=g)
    ref, ref_grad = _forward(tiny_pipe, x0.clone().requires_grad_(), cond)
    with explicit_attention(dec) as swapped:
        assert swapped > 0 and AttnAddedKVProcessor2_0 not in _processors(dec)
        out, grad = _forward(tiny_pipe, x0.clone().requires_grad_(), cond)
    assert AttnAddedKVProcessor2_0 in _processors(dec)  # put back
    assert ExplicitAddedKVProcessor not in _processors(dec)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4)
    # under bf16 autocast: within bf16 rounding of the fused kernel's bf16 result
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        fused = dec(x0, torch.tensor([10, 500]), cond=cond).float()
        with explicit_attention(dec):
            plain = dec(x0, torch.tensor([10, 500]), cond=cond).float()
    assert ((plain - fused).norm() / fused.norm()).item() < 0.03


@pytest.mark.parametrize("precision, expected", [("bf16", True), ("no", False)])
def test_decoder_training_loss_uses_it_on_a_cpu_in_bf16_only(tiny_clip, precision, expected):
    from unclip.train.decoder import DecoderTask, build_image_model

    cfg = load_stage_config(TINY, [f"train.mixed_precision={precision}"])
    torch.manual_seed(0)
    model = build_image_model(cfg, tiny_clip)
    task = DecoderTask(cfg, tiny_clip, "cpu")
    seen = []
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    attn.register_forward_pre_hook(lambda m, a: seen.append(type(m.processor)))
    batch = {"image": torch.rand(2, 3, 16, 16) * 2 - 1, "caption": ["a red circle", "two"]}
    task.loss(model, batch, gens(1, 2))
    assert seen and all((p is ExplicitAddedKVProcessor) == expected for p in seen)
    assert type(attn.processor) is AttnAddedKVProcessor2_0  # put back after the loss


def test_the_launch_precision_decides_it_under_auto(tiny_clip, tmp_path, monkeypatch):
    """``accelerate launch --mixed_precision bf16`` with ``train.mixed_precision: auto`` trains in
    bf16 even on a CPU where ``auto`` alone picks fp32: the tasks use the plain attention then."""
    from unclip.train.decoder import DecoderTask, build_image_model
    from unclip.train.loop import TrainLoop
    from unclip.train.prior import PriorTask
    from unclip.utils import precision

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)  # auto alone: fp32
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    cfg = load_stage_config(TINY, ["train.mixed_precision=auto", f"train.output_dir={tmp_path}"])
    loop = TrainLoop(cfg)  # as train_decoder builds its task: from the loop's precision
    try:
        assert loop.mixed_precision == loop.accelerator.mixed_precision == "bf16"
        torch.manual_seed(0)
        model = build_image_model(cfg, tiny_clip)
        task = DecoderTask(cfg, tiny_clip, loop.device, loop.mixed_precision)
        seen = []
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        attn.register_forward_pre_hook(lambda m, a: seen.append(type(m.processor)))
        batch = {"image": torch.rand(2, 3, 16, 16) * 2 - 1, "caption": ["a red circle", "two"]}
        task.loss(model, batch, gens(1, 2))
        assert seen and all(p is ExplicitAddedKVProcessor for p in seen)
    finally:
        loop.accelerator.end_training()
        loop.release_output_dir()
    # built without the loop, the tasks resolve the launch's precision the same way
    assert DecoderTask(cfg, tiny_clip, "cpu").explicit_attention
    prior_cfg = load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["train.mixed_precision=auto"])
    assert PriorTask(prior_cfg, tiny_clip, "cpu").plain_attention
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert not DecoderTask(cfg, tiny_clip, "cpu").explicit_attention  # auto alone: fp32


def _bf16_gradients(path, overrides, clip, checkpointing: bool) -> dict:
    """The gradients of one bf16 training loss of a config's network (built by the training code,
    with or without gradient checkpointing) on a CPU, where the tasks choose their attention
    around the loss only."""
    from unclip.train.plan_build import _build, _synthetic_batch

    switch = f"train.gradient_checkpointing={str(checkpointing).lower()}"
    cfg = load_stage_config(path, ["train.mixed_precision=bf16", *overrides, switch])
    torch.manual_seed(0)
    model, task = _build(cfg, clip, "cpu", "bf16")
    model.train()
    batch = _synthetic_batch(cfg, clip, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = task.loss(model, batch, gens(1, 2))
    loss.backward()  # after the loss: the recompute runs here, its attention chosen again
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "stage, overrides",
    [
        ("decoder", []),
        # the prior checkpoints its own caption transformer, whose SDPA runs the math kernel
        ("prior", [f"prior.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()]),
    ],
)
def test_bf16_checkpointing_recomputes_with_the_attention_the_forward_ran(
    tiny_clip, stage, overrides
):
    """Under bf16 with gradient checkpointing the backward's recompute runs the attention the
    loss chose (PyTorch refuses a recompute that saves other tensors): the gradients are those of
    the same step without checkpointing."""
    if stage == "prior":
        overrides = ["prior.text_encoder=transformer", *overrides]
    path = CONFIGS / "tiny" / f"{stage}.yaml"
    plain = _bf16_gradients(path, overrides, tiny_clip, False)
    checkpointed = _bf16_gradients(path, overrides, tiny_clip, True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_the_bf16_checkpointed_decoder_trains_through_the_command(tmp_path):
    from unclip.cli.train_decoder import main

    assert main(
        [str(TINY), "train.mixed_precision=bf16", "train.gradient_checkpointing=true",
         "train.max_steps=2", "train.progress=false", f"train.output_dir={tmp_path}"]
    ) == 0  # fmt: skip
    assert (tmp_path / "final" / "decoder").is_dir()
