"""The diffusion prior's own caption transformer (``prior.text_encoder: transformer``, the paper's
256-token text encoder): config, training, saving and loading, sampling, export, the dry run."""

import json

import pytest
import torch
from conftest import CONFIGS, EXACT

from unclip import UnCLIPPipeline
from unclip.cli import train_prior
from unclip.nets.prior import PrefixCache, UnCLIPPrior
from unclip.pipeline.tiny import TINY_TEXT_ENCODER, tiny_pipeline
from unclip.train.config import load_stage_config
from unclip.train.prior import PriorTask, build_prior_model
from unclip.utils.config import ConfigError

OWN = [f"prior.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()]
CAPTIONS = ["a red circle", "a big blue square", "two green stars"]


@pytest.fixture(autouse=True)
def _accelerate(one_thread, reset_accelerate):
    yield


def test_full_scale_prior_has_its_own_caption_transformer_and_small_ones_read_clip():
    full = load_stage_config(CONFIGS / "prior_vit_l14.yaml").prior
    assert full.text_encoder == "transformer" and full.text_context_length == 256
    assert (full.text_encoder_width, full.text_encoder_layers, full.text_encoder_heads) == (
        2048,
        24,
        32,
    )
    for name in ("prior", "prior_ar"):
        assert load_stage_config(CONFIGS / "tiny" / f"{name}.yaml").prior.text_encoder == "clip"
    with pytest.raises(ConfigError, match="autoregressive prior reads CLIP token states"):
        load_stage_config(CONFIGS / "tiny" / "prior_ar.yaml", ["prior.text_encoder=transformer"])
    with pytest.raises(ConfigError, match="divisible by prior.text_encoder_heads"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", [*OWN, "prior.text_encoder_heads=3"])


def test_training_feeds_caption_ids_to_the_caption_transformer(tiny_clip):
    """The prior's loss reads its own tokenizer's ids (the empty caption's where dropped), its
    caption transformer's weights get gradients, and the caption cache keeps no CLIP token
    states for it."""
    cfg = load_stage_config(CONFIGS / "tiny" / "prior.yaml", OWN)
    torch.manual_seed(0)
    prior = build_prior_model(cfg, tiny_clip)
    task = PriorTask(cfg, tiny_clip, "cpu")
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = prior

        def forward(self, x_t, t, text):
            seen.append(text)
            return self.module(x_t, t, text)

    batch = {"image_embed": torch.randn(3, tiny_clip.embed_dim), "caption": CAPTIONS}
    losses = []
    for prob in (0.0, 1.0):
        cfg.train.text_drop_prob = prob
        prior.zero_grad()
        loss = task.loss(Spy(), batch, [torch.Generator().manual_seed(i) for i in range(3)])
        loss.backward()
        losses.append(loss)
        if prob == 0.0:
            grad = prior.text_transformer.blocks[0].qkv.weight.grad
            assert grad is not None and grad.abs().sum() > 0
    assert all(torch.isfinite(x) for x in losses)
    assert torch.equal(seen[0].caption_ids, prior.tokenize(CAPTIONS))
    assert torch.equal(seen[1].caption_ids, prior.tokenize([""]).expand(3, -1))
    assert seen[0].text_tokens.shape[1] == 0  # no CLIP token states reach this prior
    rows = list(task.text.rows.values())
    assert len(rows) == 3 and all(r[1].shape[0] == 0 and r[2].shape[0] == 0 for r in rows)


def test_trains_two_steps_and_exports_the_caption_transformer(tmp_path):
    run = tmp_path / "run"
    args = [str(CONFIGS / "tiny" / "prior.yaml"), *OWN, f"train.output_dir={run}"]
    args += ["train.max_steps=2", "train.checkpoint_every=2", "train.log_every=1"]
    assert train_prior.main([*args, "train.progress=false", "train.trackers=[]"]) == 0
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logs if "loss" in m]
    assert len(losses) == 2 and all(abs(x) < float("inf") for x in losses)
    prior = UnCLIPPrior.from_pretrained(run / "final" / "prior")
    assert prior.has_text_encoder and prior.config.text_context_length == 16
    assert not any(f.suffix in (".bin", ".pt") for f in (run / "final" / "prior").iterdir())


def test_samples_saves_loads_identically_and_export_is_refused(tmp_path):
    from unclip.interop.diffusers_export import export_diffusers

    pipe = tiny_pipeline(prior_kwargs=TINY_TEXT_ENCODER)
    pipe.prior.eval()

    def sample(p, captions=("a red circle", "a blue square")):
        g = torch.Generator().manual_seed(0)
        settings = {"prior": {"steps": 3, "guidance_scale": 3.0, "best_of": 2}}
        return p.sample_image_embeds(list(captions), 1, g, settings, progress=False)

    a = sample(pipe)
    # the text positions' cache (the caption transformer run once) gives the plain forward's
    text = pipe.encode_text(CAPTIONS)
    x, t = torch.randn(3, pipe.clip.embed_dim), torch.tensor([5, 300, 900])
    with torch.no_grad():
        step = pipe.prior.conditioned(text)
        assert isinstance(step, PrefixCache)
        torch.testing.assert_close(step(x, t), pipe.prior(x, t, text), atol=1e-5, rtol=1e-5)
    assert not torch.equal(sample(pipe, ("a green star", "a blue square"))[0], a[0])
    # a negative prompt reaches the prior as its own ids, in the empty caption's place
    g = torch.Generator().manual_seed(0)
    settings = {"prior": {"steps": 3, "guidance_scale": 3.0, "best_of": 2}}
    away = pipe.sample_image_embeds(
        ["a red circle", "a blue square"], 1, g, settings, progress=False, negative_prompt="red"
    )
    assert torch.isfinite(away).all() and not torch.equal(away, a)
    pipe.save_pretrained(tmp_path / "pipe")
    saved = json.loads((tmp_path / "pipe" / "prior" / "config.json").read_text())
    assert saved["text_encoder"] == "transformer" and saved["text_context_length"] == 16
    after = UnCLIPPipeline.from_pretrained(tmp_path / "pipe", **EXACT)
    assert torch.equal(sample(after), a)
    with pytest.raises(ValueError, match="text_encoder: transformer"):
        after.sample_image_embeds(after.clip.encode_text(["a"]), progress=False)
    with pytest.raises(ValueError, match="prior: text_encoder=transformer"):
        export_diffusers(pipe, tmp_path / "out")


def test_fake_cuda_dry_run_trains_the_caption_transformer():
    """``unclip plan``'s fake-CUDA step of a tiny prior with its own caption transformer: it
    passes (the dry run refuses a trained parameter without a gradient) and counts the caption
    transformer among the trained parameters."""
    from unclip.train.plan import measure_step

    cfg = load_stage_config(
        CONFIGS / "tiny" / "prior.yaml",
        ["train.mixed_precision=auto", "train.grad_accum_steps=2", *OWN],
    )
    own = measure_step(cfg)
    built = build_prior_model(cfg, tiny_pipeline().clip)
    caption = sum(p.numel() for p in built.text_transformer.parameters())
    assert own.mixed_precision == "fp16"
    assert own.params_trainable == sum(p.numel() for p in built.parameters() if p.requires_grad)
    assert own.params_trainable > caption > 0


def test_gradient_checkpointing_reaches_the_caption_transformer(tiny_clip):
    """``train.gradient_checkpointing`` checkpoints the prior's caption transformer blocks (its
    forward keeps less for the backward) and leaves the gradients as they were."""
    from unclip.train.plan import MemoryTracker

    grads, saved = [], []
    ids = None
    for on in (False, True):
        cfg = load_stage_config(
            CONFIGS / "tiny" / "prior.yaml", [*OWN, f"train.gradient_checkpointing={on}"]
        )
        torch.manual_seed(0)
        prior = build_prior_model(cfg, tiny_clip).train()
        assert prior.text_transformer.gradient_checkpointing is on
        ids = prior.tokenize(CAPTIONS) if ids is None else ids
        mem = MemoryTracker("cpu")
        with mem:
            before = mem.current
            states = prior.text_transformer(ids)
            saved.append(mem.current - before)
        del states
        text = tiny_clip.encode_text(CAPTIONS).with_caption_ids(ids)
        x = torch.randn(3, tiny_clip.embed_dim, generator=torch.Generator().manual_seed(1))
        prior(x, torch.tensor([3, 30, 300]), text).square().mean().backward()
        grads.append(prior.text_transformer.blocks[0].qkv.weight.grad.clone())
    assert saved[1] < 0.7 * saved[0], saved
    torch.testing.assert_close(grads[0], grads[1])
