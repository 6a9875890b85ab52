"""Paper-faithful switches of the full-scale configs: the decoder's own caption transformer,
dropout, attention-free upsamplers, the linear schedule of the 256→1024 upsampler, parameter
counts."""

import json

import pytest
import torch
from conftest import CONFIGS, EXACT, sample_tiny_prior
from diffusers.models.attention_processor import Attention

from unclip import UnCLIPPipeline
from unclip.cli import train_decoder
from unclip.diffusion.loop import make_scheduler, training_scheduler
from unclip.nets.config import DecoderConfig, UpsamplerConfig
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler, encode_captions
from unclip.pipeline.tiny import (
    TINY_TEXT_ENCODER,
    tiny_decoder_kwargs,
    tiny_pipeline,
    tiny_upsampler_kwargs,
)
from unclip.sampling.stages import sample_upsampler
from unclip.train.config import load_stage_config
from unclip.train.decoder import decoder_loss
from unclip.train.params import count_parameters
from unclip.utils.config import ConfigError, load_config

QUIET = ["train.progress=false", "train.trackers=[]"]
#: the stage configs at the paper's scale (the DALL-E token configs are counted elsewhere)
FULL_SCALE = {"prior_vit_l14", "decoder_64", "sr256", "sr1024", "prior_ar_vit_l14"}


@pytest.fixture(autouse=True)
def _accelerate(one_thread, reset_accelerate):
    yield


def train_tiny(config, out, *overrides):
    return train_decoder.main([str(config), f"train.output_dir={out}", *QUIET, *overrides])


def test_decoder_with_own_text_encoder_trains_saves_loads_and_generates(tmp_path):
    """``decoder.text_encoder=transformer`` trains through ``unclip train-decoder``, exports, goes
    into a pipeline folder (config naming the encoder and tokenizer) and generates with guidance
    exactly as before saving."""
    enc = [f"decoder.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()]
    run = tmp_path / "run"
    steps = ["train.max_steps=3", "train.checkpoint_every=3", "train.log_every=1"]
    steps.append("train.gradient_checkpointing=true")
    assert train_tiny(CONFIGS / "tiny" / "decoder.yaml", run, *enc, *steps) == 0
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in m for m in losses) == 3
    before = UnCLIPPipeline.from_components(
        run / "final" / "clip", run / "final" / "decoder", **EXACT
    )
    assert before.decoder.has_text_encoder

    def generate(pipe):
        embeds = torch.randn(2, pipe.clip.embed_dim, generator=torch.Generator().manual_seed(1))
        gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
        settings = {"decoder": {"steps": 3, "guidance_scale": 3.0}}
        return pipe.decode(
            embeds, ["a red circle", "a blue square"], gens, settings, progress=False
        )

    a = generate(before)
    before.save_pretrained(tmp_path / "pipe")
    saved = json.loads((tmp_path / "pipe" / "decoder" / "config.json").read_text())
    assert saved["text_encoder"] == "transformer" and saved["text_tokenizer"] == "open_clip_bpe"
    assert saved["text_context_length"] == 16
    after = UnCLIPPipeline.from_pretrained(tmp_path / "pipe", **EXACT)
    b = generate(after)
    assert a.shape == (2, 3, 16, 16) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    # the caption matters: another caption gives another image from the same noise
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    embeds = torch.randn(2, after.clip.embed_dim, generator=torch.Generator().manual_seed(1))
    other = after.decode(
        embeds, ["a green star", "a blue square"], gens, {"decoder": {"steps": 3}}, progress=False
    )
    assert not torch.equal(other[0], b[0])
    # this decoder reads its own tokens; CLIP token states are refused with the setting named
    with pytest.raises(ValueError, match="text_encoder: transformer"):
        after.decode(embeds, after.encode_text(["a", "b"]), progress=False)


def test_caption_transformer_learns_from_the_loss_and_dropout_reaches_the_empty_caption():
    """The decoder loss feeds the caption's token ids to the decoder's transformer (its weights
    get gradients) and ``text_drop_prob`` swaps them for the empty caption's ids."""
    pipe = tiny_pipeline(decoder_kwargs=TINY_TEXT_ENCODER)
    decoder, clip = pipe.decoder.train(), pipe.clip
    cfg = load_stage_config(
        CONFIGS / "tiny" / "decoder.yaml",
        [f"decoder.{k}={v}" for k, v in TINY_TEXT_ENCODER.items()],
    )
    captions = ["a red circle", "a big blue square", "two green stars"]
    batch = {"image": torch.rand(3, 3, 16, 16) * 2 - 1, "caption": captions}
    null = encode_captions(cfg.decoder, clip, [""])
    assert torch.equal(null, decoder.tokenize([""]))
    seen = []

    def model(x_t, t, image_embed, text, drop_image):
        seen.append(text)
        return decoder(x_t, t, image_embed, text, drop_image)

    sched = training_scheduler(cfg.diffusion)
    for prob in (0.0, 1.0):
        cfg.train.text_drop_prob = prob
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        loss = decoder_loss(model, batch, clip, null, gens, cfg, sched, "cpu")
    assert torch.equal(seen[0], decoder.tokenize(captions))
    assert torch.equal(seen[1], decoder.tokenize([""]).expand(3, -1))
    decoder.zero_grad()
    cfg.train.text_drop_prob = 0.0
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    decoder_loss(model, batch, clip, null, gens, cfg, sched, "cpu").backward()
    grad = decoder.text_transformer.blocks[0].qkv.weight.grad
    assert loss.isfinite() and grad is not None and grad.abs().sum() > 0


def test_gradient_checkpointing_covers_the_caption_transformer():
    """``enable_gradient_checkpointing`` on the decoder (what ``train.gradient_checkpointing``
    calls) checkpoints the caption transformer too: its forward keeps less memory for the
    backward, and the gradients are the same."""
    from unclip.train.plan import MemoryTracker

    pipe = tiny_pipeline(decoder_kwargs=TINY_TEXT_ENCODER)
    decoder = pipe.decoder.train()
    decoder.text_transformer.trim_padding = False  # the whole context, as the paper's captions
    ids = decoder.tokenize(["a red circle", "a blue square"])
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    embeds = torch.randn(2, pipe.clip.embed_dim, generator=torch.Generator().manual_seed(1))
    grads, saved = [], []
    for checkpointing in (False, True):
        if checkpointing:
            decoder.enable_gradient_checkpointing()
        mem = MemoryTracker("cpu")
        with mem:  # the caption transformer alone: what its forward leaves for the backward
            before = mem.current
            states = decoder.text_transformer(ids)
            saved.append(mem.current - before)
        del states
        decoder.zero_grad()
        decoder(x, torch.tensor([10, 500]), embeds, ids).square().mean().backward()
        grads.append(decoder.text_transformer.blocks[0].qkv.weight.grad.clone())
    assert saved[1] < 0.7 * saved[0], saved
    torch.testing.assert_close(grads[0], grads[1])


def test_clip_decoder_training_drops_to_the_clip_empty_caption():
    """The default decoder (``text_encoder: clip``) still drops to the CLIP encoding of ``""``."""
    pipe = tiny_pipeline()
    cfg = load_stage_config(CONFIGS / "tiny" / "decoder.yaml", ["train.text_drop_prob=1.0"])
    null = encode_captions(cfg.decoder, pipe.clip, [""])
    seen = []

    def model(x_t, t, image_embed, text, drop_image):
        seen.append(text)
        return pipe.decoder(x_t, t, image_embed, text, drop_image)

    batch = {"image": torch.rand(2, 3, 16, 16) * 2 - 1, "caption": ["a red circle", "x"]}
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    decoder_loss(model, batch, pipe.clip, null, gens, cfg, training_scheduler(cfg.diffusion), "cpu")
    want = pipe.clip.encode_text([""]).repeat_interleave(2)
    assert torch.equal(seen[0].text_tokens, want.text_tokens)
    assert torch.equal(seen[0].text_embed, want.text_embed)
    assert torch.equal(seen[0].text_mask, want.text_mask)


def test_export_to_diffusers_refuses_a_decoder_with_its_own_text_encoder(tmp_path):
    from unclip.interop.diffusers_export import export_diffusers

    pipe = tiny_pipeline(decoder_kwargs=TINY_TEXT_ENCODER)
    with pytest.raises(ValueError, match="decoder: text_encoder=transformer"):
        export_diffusers(pipe, tmp_path / "out")


def _twice(model, *args):
    with torch.no_grad():
        return model(*args), model(*args)


@pytest.mark.parametrize("stage", ["decoder", "upsampler"])
def test_dropout_changes_train_mode_outputs_only(stage):
    """``dropout > 0`` makes two train-mode passes differ and leaves eval mode deterministic;
    without it train mode is deterministic too."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if stage == "decoder":
        pipe = tiny_pipeline()
        text = pipe.clip.encode_text(["a red circle"])
        x = torch.randn(1, 3, 16, 16, generator=g)
        args = (x, torch.tensor([500]), torch.randn(1, pipe.clip.embed_dim, generator=g), text)

        def build(p):
            return UnCLIPDecoder.from_clip(pipe.clip, **tiny_decoder_kwargs(16), dropout=p)
    else:
        x = torch.randn(1, 3, 32, 32, generator=g)
        args = (x, torch.tensor([500]), torch.randn(1, 3, 32, 32, generator=g))

        def build(p):
            return UnCLIPUpsampler(**tiny_upsampler_kwargs(16, 32), dropout=p)

    with_dropout, without = build(0.5), build(0.0)
    a, b = _twice(with_dropout.train(), *args)
    assert not torch.equal(a, b)
    a, b = _twice(with_dropout.eval(), *args)
    assert torch.equal(a, b)
    a, b = _twice(without.train(), *args)
    assert torch.equal(a, b)


def test_dropout_and_text_encoder_settings_are_checked():
    with pytest.raises(ConfigError, match="decoder.dropout must be in"):
        load_config({"dropout": 1.0}, schema=DecoderConfig)
    with pytest.raises(ConfigError, match="upsampler.dropout must be in"):
        load_config({"dropout": -0.1}, schema=UpsamplerConfig)
    with pytest.raises(ConfigError, match="text_encoder' must be one of"):
        load_config({"text_encoder": "t5"}, schema=DecoderConfig)
    with pytest.raises(ConfigError, match="divisible by decoder.text_encoder_heads"):
        load_config(
            {"text_encoder": "transformer", "text_encoder_width": 30, "text_encoder_heads": 4},
            schema=DecoderConfig,
        )
    with pytest.raises(ConfigError, match="text_tokenizer' must be one of"):
        load_config({"text_tokenizer": "gpt2"}, schema=DecoderConfig)


def test_attention_free_upsampler_has_no_attention():
    kwargs = {k: v for k, v in tiny_upsampler_kwargs(16, 32).items()}
    free = UpsamplerConfig(**kwargs, add_attention=False).build()
    assert not any(isinstance(m, Attention) for m in free.modules())
    assert any(isinstance(m, Attention) for m in UpsamplerConfig(**kwargs).build().modules())
    for name in ("sr256", "sr1024"):
        assert load_stage_config(CONFIGS / f"{name}.yaml").upsampler.add_attention is False


def test_upsampler_attention_head_width_is_a_setting_defaulting_to_diffusers():
    kwargs = dict(tiny_upsampler_kwargs(16, 32))
    width = kwargs["block_out_channels"][-1]
    saved = {k: v for k, v in UpsamplerConfig(**kwargs).build().config.items() if k[0] != "_"}
    saved.pop("attention_head_dim")  # weights saved before the setting existed
    old = UnCLIPUpsampler.from_config(saved)
    wide = UpsamplerConfig(**kwargs, attention_head_dim=width // 2).build()

    def heads(model):
        return [m.heads for m in model.modules() if isinstance(m, Attention)]

    assert heads(old) == [width // 8] and heads(wide) == [2]
    # the same parameters: the head width only splits the same projections differently
    assert [p.shape for p in old.parameters()] == [p.shape for p in wide.parameters()]
    with pytest.raises(ValueError, match=r"attention_head_dim \(5\) must divide the mid block's"):
        UpsamplerConfig(**kwargs, attention_head_dim=5)
    with pytest.raises(ValueError, match=r"attention_head_dim \(5\) must divide the mid block's"):
        UnCLIPUpsampler(**kwargs, attention_head_dim=5)
    UpsamplerConfig(**kwargs, add_attention=False, attention_head_dim=5)  # no attention, no heads


def test_full_scale_decoder_has_the_papers_parameter_count():
    """Built on the meta device from configs/decoder_64.yaml: the paper's 3.5B, of which the
    caption transformer is what frozen-CLIP tokens would leave out."""
    cfg = load_stage_config(CONFIGS / "decoder_64.yaml")
    assert cfg.decoder.text_encoder == "transformer"
    n = count_parameters(cfg)
    assert 3.3e9 <= n <= 3.7e9, n
    clip_tokens = count_parameters(
        load_stage_config(CONFIGS / "decoder_64.yaml", ["decoder.text_encoder=clip"])
    )
    assert 2.1e9 <= clip_tokens <= 2.4e9, clip_tokens


def _readme_counts() -> dict:
    """``{config file: count}`` from the parameter-count table of configs/README.md."""
    import re

    text = (CONFIGS / "README.md").read_text()
    section = text.split("## Parameter counts", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w./-]+\.yaml)` \|[^|\n]*\| [^|\n(]*\(([\d,]+)\)", section, re.M)
    return {name: int(count.replace(",", "")) for name, count in rows}


def test_readme_parameter_counts_are_the_built_ones():
    """Every count configs/README.md states is what the config builds on the meta device, and
    every full-scale config has one."""
    written = _readme_counts()
    assert set(written) == {p.name for p in CONFIGS.glob("*.yaml") if p.stem in FULL_SCALE}
    for name, count in written.items():
        assert count_parameters(load_stage_config(CONFIGS / name)) == count, name


def test_linear_schedule_upsampler_trains_and_samples(tmp_path):
    """configs/sr1024.yaml's linear schedule: every sampler its sampling section names accepts it,
    and a tiny upsampler with it (and no attention) trains and samples."""
    full = load_stage_config(CONFIGS / "sr1024.yaml")
    assert full.diffusion.beta_schedule == "linear"
    make_scheduler(full.sampling.scheduler, full.diffusion)
    run = tmp_path / "run"
    overrides = [
        "diffusion.beta_schedule=linear",
        "upsampler.add_attention=false",
        "train.max_steps=3",
        "train.checkpoint_every=3",
        "train.log_every=1",
    ]
    assert train_tiny(CONFIGS / "tiny" / "sr64.yaml", run, *overrides) == 0
    stage = json.loads((run / "final" / "sr64" / "unclip_stage.json").read_text())
    assert stage["diffusion"]["beta_schedule"] == "linear"
    up = UnCLIPUpsampler.from_pretrained(run / "final" / "sr64")
    assert up.config.add_attention is False
    low = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    cfg = load_stage_config(CONFIGS / "tiny" / "sr64.yaml", overrides[:1])
    out = sample_upsampler(
        up, low, cfg.sampling, cfg.diffusion, generator=torch.Generator(), progress=False
    )
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()


def test_decoder_checkpointing_covers_attention_and_keeps_gradients(tmp_path):
    """The decoder's checkpointing adds its attention layers to diffusers' (resnets only): less
    memory saved for backward, the same gradients."""
    from unclip.nets.text_encoding import TextEncoding
    from unclip.pipeline.tiny import tiny_decoder_kwargs
    from unclip.train.plan import MemoryTracker

    def grads_and_saved(which):
        torch.manual_seed(0)
        dec = UnCLIPDecoder(embed_dim=32, text_width=32, **tiny_decoder_kwargs())
        dec.train()
        {"none": lambda: None, "resnets": dec.unet.enable_gradient_checkpointing}.get(
            which, dec.enable_gradient_checkpointing
        )()
        torch.manual_seed(1)
        x = torch.randn(2, 3, dec.config.sample_size, dec.config.sample_size)
        emb = torch.randn(2, 32)
        text = TextEncoding(torch.randn(2, 32), torch.randn(2, 5, 32), torch.ones(2, 5, dtype=bool))
        mem = MemoryTracker("cpu")
        with mem:
            before = mem.current
            out = dec(x, torch.tensor([10, 500]), emb, text)
            saved = mem.current - before
        out.square().mean().backward()
        return [p.grad.clone() for p in dec.parameters() if p.grad is not None], saved

    g_none, saved_none = grads_and_saved("none")
    _, saved_resnets = grads_and_saved("resnets")
    g_all, saved_all = grads_and_saved("all")
    assert saved_all < saved_resnets < saved_none
    assert len(g_all) == len(g_none)
    for a, b in zip(g_all, g_none):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_papers_blur_is_three_taps_of_sigma_0_6():
    """configs/sr256.yaml's corruption: σ 0.6 over a 3-tap kernel, the weights written out here;
    the default (3σ each side: 5 taps at σ 0.6) blurs further."""
    import math

    from unclip.nets.decoder import degrade, gaussian_blur

    cfg = load_stage_config(CONFIGS / "sr256.yaml")
    assert cfg.upsampler_train.blur_sigma == [0.6, 0.6]
    assert cfg.upsampler_train.blur_kernel_size == 3
    x = torch.zeros(1, 1, 7, 7)
    x[0, 0, 3, 3] = 1.0  # an impulse: the blur's output is its kernel
    side = math.exp(-0.5 / 0.36)
    taps = torch.tensor([side, 1.0, side]) / (1 + 2 * side)
    out = gaussian_blur(x, torch.tensor([0.6]), kernel_size=3)[0, 0]
    torch.testing.assert_close(out[2:5, 2:5], taps[:, None] * taps[None, :])
    assert out.sum() == pytest.approx(1.0) and out[1].abs().max() == 0
    assert gaussian_blur(x, torch.tensor([0.6]))[0, 0, 1, 3] > 0  # the default's fifth tap
    gens = [torch.Generator().manual_seed(0)]
    img = torch.rand(1, 3, 32, 32) * 2 - 1
    three = degrade(img, 8, "blur", gens, (0.6, 0.6), 3)
    gens = [torch.Generator().manual_seed(0)]
    assert not torch.equal(three, degrade(img, 8, "blur", gens, (0.6, 0.6)))
    with pytest.raises(ConfigError, match="blur_kernel_size must be an odd number"):
        load_stage_config(CONFIGS / "sr256.yaml", ["upsampler_train.blur_kernel_size=4"])
    small = load_stage_config(CONFIGS / "tiny" / "sr32.yaml")
    assert small.upsampler_train.blur_kernel_size is None  # small models keep 3σ each side


def test_prior_embedding_scale_is_the_papers_fixed_17_2(tiny_clip):
    """``prior.embed_scale``: no data read, mean 0 and std 1/17.2, so the diffusion runs on 17.2
    times the unit-norm embedding; the small priors keep data statistics; checked values."""
    from unclip.train.prior import embedding_stats

    cfg = load_stage_config(CONFIGS / "prior_vit_l14.yaml")
    assert cfg.prior.embed_scale == 17.2
    tiny = load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["prior.embed_scale=17.2"])
    assert load_stage_config(CONFIGS / "tiny" / "prior.yaml").prior.embed_scale is None
    mean, std = embedding_stats(tiny, tiny_clip, "cpu")
    prior = tiny.model.build(tiny_clip)  # the switch is stored as statistics, not architecture
    prior.set_embedding_stats(mean, std)
    x = torch.nn.functional.normalize(torch.randn(3, tiny_clip.embed_dim), dim=-1)
    torch.testing.assert_close(prior.normalize(x), 17.2 * x)
    torch.testing.assert_close(prior.denormalize(prior.normalize(x)), x)
    for bad, match in (("prior.embed_scale=0", "must be > 0"), ("prior.type=ar", "diffusion")):
        with pytest.raises(ConfigError, match=match):
            load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["prior.embed_scale=17.2", bad])


def test_full_scale_priors_sampler_and_the_autoregressive_prior_config(tiny_clip):
    """The diffusion prior samples with the ancestral 'unclip' sampler at the paper's 64 steps
    (run here on a tiny prior); the autoregressive prior config is the paper's decoder size."""
    from unclip.sampling.settings import PriorSampling

    cfg = load_stage_config(CONFIGS / "prior_vit_l14.yaml")
    assert (cfg.sampling.scheduler, cfg.sampling.steps) == ("unclip", 64)
    prior = load_stage_config(CONFIGS / "tiny" / "prior.yaml").model.build(tiny_clip)
    text = tiny_clip.encode_text(["a red circle", "a blue square"])
    runs = []
    for scheduler in ("unclip", "ddim"):
        settings = PriorSampling(scheduler=scheduler, steps=4, guidance_scale=2.0)
        runs.append(sample_tiny_prior(prior, tiny_clip, text, settings)[0])
    assert torch.isfinite(runs[0]).all() and not torch.equal(*runs)  # ancestral noise added
    ar = load_stage_config(CONFIGS / "prior_ar_vit_l14.yaml")
    assert ar.prior.type == "ar" and ar.prior.num_layers == 24
    assert ar.prior.num_attention_heads * ar.prior.attention_head_dim == 1664
    assert (ar.prior.ar.pca_dims, ar.prior.ar.num_buckets) == (319, 1024)
