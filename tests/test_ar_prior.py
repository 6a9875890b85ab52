"""The autoregressive prior (prior.type: ar): PCA + quantisation, the causal transformer, sampling
(determinism, batching, guidance, top-k/top-p), save/load, pipelines, config errors."""

import pytest
import torch
from conftest import EXACT, gens

from unclip import UnCLIPPipeline
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.config import ARPriorOptions, PriorConfig
from unclip.nets.priors import load_prior
from unclip.nets.text_encoding import TextEncoding
from unclip.sampling.ar import filter_logits, sample_ar_prior
from unclip.sampling.settings import ARPriorSampling
from unclip.utils.config import ConfigError

CAPTIONS = ["a small red circle on the left", "a big blue square", "a green triangle", "two stars"]
TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16)


def embeddings(n=400, d=32, seed=0):
    """Anisotropic image embeddings with correlated text embeddings, like CLIP's."""
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(n, d, generator=g) * torch.linspace(2.0, 0.05, d)
    text = image + 0.5 * torch.randn(n, d, generator=g)
    return image, text


def fitted_prior(clip, seed=0, **kw):
    torch.manual_seed(seed)
    opts = dict(pca_dims=12, num_buckets=32, dot_buckets=8)
    prior = UnCLIPARPrior.from_clip(clip, **{**TINY, **opts, **kw}).eval()
    prior.fit_quantizer(*embeddings(d=clip.embed_dim))
    return prior


def no_null(n):
    raise AssertionError("the unconditional caption was used at guidance scale 1")


@pytest.fixture(scope="module")
def prior(tiny_clip):
    return fitted_prior(tiny_clip)


@pytest.fixture(scope="module")
def text(tiny_clip):
    return tiny_clip.encode_text(CAPTIONS)


def sample(prior, text, null, seeds, **settings):
    s = ARPriorSampling(**{"guidance_scale": 1.0, **settings})
    return sample_ar_prior(prior, text, null, s, generator=gens(*seeds), progress=False)


# ------------------------------------------------------------------------------ the code
def test_round_trip_error_is_small_and_falls_with_more_buckets():
    image, text = embeddings(n=2000)
    errors = []
    for k in (4, 16, 64, 256):
        prior = UnCLIPARPrior(embed_dim=32, text_width=32, context_length=4, num_buckets=k, **TINY)
        prior.fit_quantizer(image, text)
        codes = prior.encode(image)
        assert codes.shape == (2000, 32) and codes.min() >= 0 and codes.max() < k
        # quantile buckets: every code is (nearly) equally frequent in the fitted data
        counts = torch.bincount(codes[:, 0], minlength=k).float()
        assert counts.min() >= 0.5 * counts.mean()
        rel = ((prior.decode(codes) - image).norm(dim=1) / image.norm(dim=1)).mean()
        errors.append(float(rel))
    assert all(a > 1.5 * b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.03, errors
    # fewer components: the PCA keeps the high-variance directions (here the first 16 axes), so
    # it loses what dropping the 16 low-variance coordinates loses
    half = UnCLIPARPrior(embed_dim=32, text_width=32, context_length=4, pca_dims=16, **TINY)
    half.fit_quantizer(image, text)
    z = half.project(image)
    assert torch.all(z.var(0)[:-1] >= z.var(0)[1:])  # in order of decreasing variance
    err = (half.unproject(z) - image).square().sum(1).mean()
    axes = (image - image.mean(0))[:, 16:].square().sum(1).mean()
    assert 0.9 * axes < err <= axes * (1 + 1e-5)  # PCA is the best 16-d linear fit


def test_fit_is_needed_deterministic_and_checked(tiny_clip):
    prior = UnCLIPARPrior.from_clip(tiny_clip, pca_dims=12, num_buckets=32, dot_buckets=8, **TINY)
    image, text = embeddings()
    with pytest.raises(ValueError, match="fit_quantizer"):
        prior.encode(image)
    with pytest.raises(ValueError, match="more than 12 embeddings"):
        prior.fit_quantizer(image[:12], text[:12])
    with pytest.raises(ValueError, match=r"\[n, 32\]"):
        prior.fit_quantizer(image[:, :16], text[:, :16])
    prior.fit_quantizer(image, text)
    again = UnCLIPARPrior.from_clip(tiny_clip, pca_dims=12, num_buckets=32, dot_buckets=8, **TINY)
    again.fit_quantizer(image, text)
    for name in ("pca_mean", "pca_components", "bucket_edges", "dot_edges"):
        assert torch.equal(getattr(prior, name), getattr(again, name)), name
    assert torch.equal(prior.encode(image), again.encode(image))
    # the dot-product token: the training cosines fill its buckets evenly; a quantile picks one
    dots = prior.dot_token(text, image)
    assert torch.bincount(dots, minlength=8).min() >= 0.5 * len(dots) / 8
    assert prior.dot_token_at(torch.tensor([0.0, 0.5, 0.99, 1.0])).tolist() == [0, 4, 7, 7]


def test_later_codes_do_not_change_earlier_logits(prior, text):
    codes = prior.encode(torch.randn(4, 32))
    dot = torch.tensor([1, 2, 3, 7])
    logits = prior(codes, text, dot)
    assert logits.shape == (4, 12, 32)
    changed = codes.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 32
    other = prior(changed, text, dot)
    # the logits of code i see codes 0..i-1 only
    assert torch.equal(logits[:, :6], other[:, :6])
    assert not torch.allclose(logits[:, 6:], other[:, 6:])
    # the cached one-code-at-a-time path computes the same logits
    first, state = prior.transformer.start(text, dot)
    steps = [first] + [prior.transformer.step(codes[:, i], state) for i in range(11)]
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_normformer_and_glu_blocks_keep_causality_the_cache_and_save_load(
    tiny_clip, text, activation, tmp_path
):
    """DALL-E Mega's options in the AR prior's blocks: the extra norms and head scales exist, the
    logits stay causal, the cached decoding computes them too, and a saved prior rebuilds them;
    without the options a block keeps the plain GELU block's weight names."""
    cfg = PriorConfig(type="ar", **TINY, normformer=True, ff_activation=activation)
    cfg.ar = ARPriorOptions(pca_dims=12, num_buckets=32, dot_buckets=8)
    torch.manual_seed(0)
    prior = cfg.build(tiny_clip).eval()
    prior.fit_quantizer(*embeddings(d=tiny_clip.embed_dim))
    with torch.no_grad():  # away from their initial values, so that a lost one shows
        for block in prior.transformer.blocks:
            block.head_scale.copy_(torch.linspace(0.5, 1.5, block.head_scale.numel()))
    keys = set(prior.transformer.blocks[0].state_dict())
    assert {"head_scale", "attn_out_norm.weight", "mlp.0.inner_norm.weight"} <= keys
    assert prior.transformer.blocks[0].mlp[0].proj_in.out_features == 2 * (2 * 4 * 32 // 3)
    plain = fitted_prior(tiny_clip).transformer.blocks[0].state_dict()
    assert set(plain) == {
        f"{m}.{p}"
        for m in ("norm1", "qkv", "proj", "norm2", "mlp.0", "mlp.2")
        for p in ("weight", "bias")
    }
    codes = prior.encode(torch.randn(4, 32))
    dot = torch.tensor([1, 2, 3, 7])
    logits = prior(codes, text, dot)
    changed = codes.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 32
    assert torch.equal(logits[:, :6], prior(changed, text, dot)[:, :6])
    first, state = prior.transformer.start(text, dot)
    steps = [first] + [prior.transformer.step(codes[:, i], state) for i in range(11)]
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-5, rtol=1e-5)
    prior.save_pretrained(tmp_path / "prior", safe_serialization=True)
    loaded = load_prior(tmp_path / "prior").eval()
    assert loaded.config.normformer and loaded.config.ff_activation == activation
    a, _ = sample(prior, text, no_null, range(8), best_of=2)
    b, _ = sample(loaded, text, no_null, range(8), best_of=2)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ sampling
def test_sampling_is_deterministic_per_generator_and_independent_of_batching(prior, text):
    settings = dict(guidance_scale=3.0, best_of=2, temperature=1.5)
    null = lambda n: TextEncoding.cat([text[:1]] * n)  # noqa: E731 (any fixed caption)
    best, cands = sample(prior, text, null, range(8), **settings)
    assert best.shape == (4, 32) and cands.shape == (4, 2, 32)
    again, _ = sample(prior, text, null, range(8), **settings)
    assert torch.equal(best, again)
    # each row alone, with its own candidates' generators, draws the same codes (the decoded
    # embeddings differ only by float32 rounding of the batch-size-dependent matmul)
    for r in range(4):
        alone, alone_c = sample(prior, text[r : r + 1], null, (2 * r, 2 * r + 1), **settings)
        assert torch.equal(prior.encode(alone_c[0]), prior.encode(cands[r])), r
        torch.testing.assert_close(alone_c[0], cands[r], atol=1e-6, rtol=0)
    other, _ = sample(prior, text, null, range(10, 18), **settings)
    assert not torch.equal(best, other)
    # best of N keeps the candidate closest to the text embedding
    scores = (torch.nn.functional.normalize(cands, dim=-1) * text.text_embed[:, None]).sum(-1)
    assert torch.equal(best, cands[torch.arange(4), scores.argmax(1)])


def test_sample_prior_takes_a_torch_compile_wrapper(prior, text):
    """A ``torch.compile(prior)`` wrapper is not an instance of the AR prior's class; the sampler
    still sends it to the AR sampler, with the same codes."""
    from unclip.diffusion.config import DiffusionConfig
    from unclip.sampling.stages import sample_prior

    settings = ARPriorSampling(guidance_scale=1.0)
    wrapped = torch.compile(prior, backend="eager")
    got, _ = sample_prior(
        wrapped,
        text,
        no_null,
        settings,
        DiffusionConfig(),
        generator=gens(0, 1, 2, 3),
        progress=False,
    )
    want, _ = sample(prior, text, no_null, range(4))
    assert torch.equal(prior.encode(got), prior.encode(want))


def teacher_forced_argmax(prior, text, codes, dot, scale=1.0, null=None):
    logits = prior(codes, text, dot)
    if scale != 1.0:
        uncond = prior(codes, null, torch.full_like(dot, prior.null_dot))
        logits = uncond + scale * (logits - uncond)
    return logits.argmax(-1)


def test_top_k_one_is_greedy_and_guidance_one_is_unguided(prior, text, tiny_clip):
    q = 0.75
    greedy = dict(top_k=1, dot_product_quantile=q, temperature=0.7)
    _, a = sample(prior, text, no_null, range(4), guidance_scale=1.0, **greedy)
    _, b = sample(prior, text, no_null, range(20, 24), guidance_scale=1.0, **greedy)
    assert torch.equal(a, b)  # greedy: the generators do not matter
    codes = prior.encode(a[:, 0])
    dot = prior.dot_token_at(torch.full((4,), q))
    # every code is the conditional logits' argmax given the codes before it
    assert torch.equal(codes, teacher_forced_argmax(prior, text, codes, dot))
    null_text = tiny_clip.encode_text([""])
    null = null_text.repeat_interleave
    _, g = sample(prior, text, null, range(4), guidance_scale=4.0, **greedy)
    codes = prior.encode(g[:, 0])
    guided = teacher_forced_argmax(prior, text, codes, dot, 4.0, null_text.repeat_interleave(4))
    assert torch.equal(codes, guided) and not torch.equal(g, a)


def test_filter_logits_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.equal(filter_logits(logits), logits)
    assert torch.allclose(filter_logits(logits, temperature=2.0), logits / 2)
    kept = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.7)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.9)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_p=1.0)) == [True] * 4
    shuffled = logits[:, [2, 0, 3, 1]]
    assert kept(filter_logits(shuffled, top_p=0.7)) == [False, True, False, True]


def test_dot_product_quantile_conditions_the_sample(prior, text):
    low, _ = sample(prior, text, no_null, range(4), dot_product_quantile=0.0)
    high, _ = sample(prior, text, no_null, range(4), dot_product_quantile=1.0)
    paper, _ = sample(prior, text, no_null, range(4))  # the top half, drawn per sample
    assert not torch.equal(low, high) and not torch.equal(paper, low)


def test_save_load_gives_identical_samples(prior, text, tmp_path):
    prior.save_pretrained(tmp_path / "prior", safe_serialization=True)
    loaded = load_prior(tmp_path / "prior")
    assert isinstance(loaded, UnCLIPARPrior) and loaded.is_fitted
    for key, value in prior.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    a, _ = sample(prior, text, no_null, range(8), best_of=2, top_p=0.9)
    b, _ = sample(loaded.eval(), text, no_null, range(8), best_of=2, top_p=0.9)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ pipelines
@pytest.fixture(scope="module")
def ar_pipe(tiny_pipe):
    p = tiny_pipe
    prior = fitted_prior(p.clip, seed=1)
    sampling = {k: v for k, v in p.sampling.items() if k != "prior"}
    sampling["prior"] = ARPriorSampling(guidance_scale=2.0, best_of=2, top_k=8)
    return UnCLIPPipeline(p.clip, prior, p.decoder, p.upsamplers, p.diffusion, sampling)


def test_pipeline_with_an_ar_prior_samples_saves_and_loads(ar_pipe, tmp_path):
    kw = dict(output_type="pt", progress=False, negative_prompt="a square", last_stage="decoder")
    out = ar_pipe(CAPTIONS[:2], generator=gens(0, 1), **kw)
    assert out.images.shape == (2, 3, 16, 16) and torch.isfinite(out.images).all()
    ar_pipe.save_pretrained(tmp_path / "pipe")
    again = UnCLIPPipeline.from_pretrained(tmp_path / "pipe", **EXACT)
    assert isinstance(again.prior, UnCLIPARPrior)
    assert again.sampling["prior"].top_k == 8
    assert torch.equal(again(CAPTIONS[:2], generator=gens(0, 1), **kw).images, out.images)
    embeds = again.sample_image_embeds(CAPTIONS[0], 2, gens(3), sampling={"prior": {"top_p": 0.5}})
    assert embeds.shape == (2, 32)
    with pytest.raises(ValueError, match="latents"):
        again.sample_image_embeds(CAPTIONS[0], latents=torch.zeros(2, 32), progress=False)
    seen = []
    again.sample_image_embeds(
        CAPTIONS[0],
        generator=gens(0),
        progress=False,
        callback_on_step_end=lambda pipe, i, t, kw: seen.append(kw["latents"].shape),
    )
    assert seen[0] == (2, 1) and seen[-1] == (2, 12)  # best_of 2 candidates, 12 codes


def test_ar_settings_are_checked_and_refused_where_they_do_not_apply(ar_pipe, tiny_pipe):
    assert ar_pipe.sampling_settings({"prior": {"temperature": 0.5}})["prior"].temperature == 0.5
    for bad, match in [
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"temperature": 0}, "temperature must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"dot_product_quantile": 1.5}, r"dot_product_quantile must be in \[0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            ar_pipe.sampling_settings({"prior": bad})
    with pytest.raises(
        ValueError, match="prior: temperature is not a setting of the diffusion prior"
    ):
        tiny_pipe.sampling_settings({"prior": {"temperature": 0.5}})
    with pytest.raises(ValueError, match="decoder: top_k is not a setting of the decoder"):
        ar_pipe.sampling_settings({"decoder": {"top_k": 5}})


def test_export_to_diffusers_refuses_an_ar_prior(ar_pipe):
    from unclip.interop.diffusers_export import export_diffusers, export_problems

    assert any("autoregressive prior" in p for p in export_problems(ar_pipe))
    with pytest.raises(ValueError, match="autoregressive prior"):
        export_diffusers(ar_pipe, "/nonexistent/never-written")


def test_config_values_are_checked(tiny_clip):
    assert PriorConfig().type == "diffusion" and PriorConfig().ar is None
    built = PriorConfig(type="ar", **TINY, ar=ARPriorOptions(pca_dims=8)).build(tiny_clip)
    assert isinstance(built, UnCLIPARPrior) and built.pca_dims == 8
    assert built.config.num_buckets == 1024  # the paper's default
    assert PriorConfig(type="ar", **TINY).build(tiny_clip).pca_dims == 32  # null: every dimension
    with pytest.raises(ValueError, match=r"pca_dims must be in \[1, 32\]"):
        PriorConfig(type="ar", **TINY, ar=ARPriorOptions(pca_dims=33)).build(tiny_clip)
    from unclip.utils.config import from_dict

    for ar, match in [
        ({"pca_dims": 0}, "prior.ar.pca_dims must be an integer >= 1"),
        ({"num_buckets": 1}, "prior.ar.num_buckets must be an integer >= 2"),
        ({"dot_buckets": 0}, "prior.ar.dot_buckets must be an integer >= 1"),
        ({"fit_samples": 1}, "prior.ar.fit_samples must be an integer >= 2"),
        ({"num_bucket": 8}, "did you mean 'prior.ar.num_buckets'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            from_dict(PriorConfig, {"type": "ar", "ar": ar}, prefix="prior")
    with pytest.raises(ConfigError, match="set prior.type: ar"):
        from_dict(PriorConfig, {"ar": {"pca_dims": 8}}, prefix="prior")
    with pytest.raises(ConfigError, match="must be one of"):
        from_dict(PriorConfig, {"type": "autoregressive"}, prefix="prior")


def test_generate_command_takes_the_ar_settings():
    from unclip.cli.generate import build_parser, sampling_overrides

    args = build_parser().parse_args(
        ["a red circle", "--prior-top-k", "5", "--prior-temperature", "0.5", "--prior-top-p", "0.9"]
    )
    assert sampling_overrides(args) == {"prior": {"top_k": 5, "temperature": 0.5, "top_p": 0.9}}
    args = build_parser().parse_args(["a red circle", "--prior-dot-product-quantile", "0.8"])
    assert sampling_overrides(args) == {"prior": {"dot_product_quantile": 0.8}}
