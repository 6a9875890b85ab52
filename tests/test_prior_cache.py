"""The prior's text-position cache (``UnCLIPPrior.conditioned``, ``unclip.nets.prior.PrefixCache``):
the same predictions as the plain forward, used by the sampler, and out of the way afterwards. And
the forward without the batch's trailing text padding (``UnCLIPPrior._forward_trimmed``): the same
predictions and gradients as diffusers' forward over the whole sequence."""

import pytest
import torch
from conftest import sample_tiny_prior

from unclip.nets.prior import PrefixCache, UnCLIPPrior
from unclip.nets.text_encoding import TextEncoding
from unclip.pipeline.tiny import TINY_TEXT_ENCODER, tiny_prior_kwargs
from unclip.sampling.settings import PriorSampling

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a red circle", "two blue squares on the left of a big green triangle", "a dot"]


def random_prior(tiny_clip, **options) -> UnCLIPPrior:
    """Every weight random (diffusers starts positions and the prediction token at zero, which
    would hide a position mix-up)."""
    prior = UnCLIPPrior.from_clip(tiny_clip, **tiny_prior_kwargs(), **options).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in prior.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        prior.set_embedding_stats(torch.zeros(tiny_clip.embed_dim), torch.ones(tiny_clip.embed_dim))
    return prior


def guided_text(tiny_clip, repeats=2) -> TextEncoding:
    """``[uncond; cond]`` rows as guidance builds them: captions of different lengths (padding),
    each repeated, after the empty caption repeated as often."""
    text = tiny_clip.encode_text(CAPTIONS).repeat_interleave(repeats)
    assert not text.text_mask.all(), "the captions must leave padding for the mask to matter"
    return TextEncoding.cat([tiny_clip.encode_text([""] * len(text)), text])


@pytest.mark.parametrize(
    "options",
    [{}, {"normformer": True, "ff_activation": "swiglu"}],
    ids=["diffusers-blocks", "normformer-swiglu"],
)
def test_cached_prediction_equals_the_forward(tiny_clip, options):
    prior = random_prior(tiny_clip, **options)
    text = guided_text(tiny_clip)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fn = prior.conditioned(text)
        assert isinstance(fn, PrefixCache)
        # a Python float is truncated to a whole step, as diffusers does; a float tensor is not
        ts = (torch.tensor(999), torch.tensor(3), 500, 2.7, torch.tensor(2.7))
        for t in (*ts, torch.arange(len(text)) * 40):
            want = prior(x, t, text)
            got = fn(x, t)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (t, (got - want).abs().max())
    # the attention modules have their own forward back (none left on the instance)
    for block in prior.transformer.transformer_blocks:
        attn = block.attn if options else block.attn1
        assert "forward" not in attn.__dict__


def test_attention_is_restored_when_a_call_fails(tiny_clip):
    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    with torch.no_grad():
        fn = prior.conditioned(text)
        with pytest.raises(ValueError, match="rows of text"):
            fn(torch.randn(2, tiny_clip.embed_dim), 5)
        x = torch.randn(len(text), tiny_clip.embed_dim)
        fn(x, 5)  # the first call fills the cache
        fn.keys[1] = fn.keys[1][..., :1]  # a broken cache: the call fails in the second block
        with pytest.raises(RuntimeError):
            fn(x, 5)
    assert all("forward" not in b.attn1.__dict__ for b in prior.transformer.transformer_blocks)
    with torch.no_grad():  # and the plain forward still works
        assert prior(x, torch.tensor(5), text).shape == (len(text), tiny_clip.embed_dim)


def test_compiled_transformer_is_run_as_compiled(tiny_clip):
    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    assert isinstance(prior.conditioned(text), PrefixCache)
    prior.transformer.compile()  # compiles lazily, on the first call (none here)
    assert not isinstance(prior.conditioned(text), PrefixCache)


def test_training_mode_uses_the_plain_forward(tiny_clip):
    prior = random_prior(tiny_clip).train()
    text = guided_text(tiny_clip)
    fn = prior.conditioned(text)
    assert not isinstance(fn, PrefixCache)
    x = torch.randn(len(text), tiny_clip.embed_dim)
    with torch.no_grad():
        assert torch.equal(fn(x, torch.tensor(9)), prior(x, torch.tensor(9), text))


def test_sampler_runs_the_three_new_positions_per_step(tiny_clip):
    prior = random_prior(tiny_clip)
    text = tiny_clip.encode_text(CAPTIONS)
    lengths = []
    hook = prior.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(args[0].shape[1]), with_kwargs=True
    )
    settings = PriorSampling(scheduler="ddim", steps=4, guidance_scale=3.0, best_of=2)
    best, cands = sample_tiny_prior(prior, tiny_clip, text, settings)
    hook.remove()
    # the text positions (tokens + text embedding) once, then three positions per step
    assert lengths == [tiny_clip.context_length + 1] + [3] * 4
    assert cands.shape == (len(CAPTIONS), 2, tiny_clip.embed_dim) and torch.isfinite(best).all()


def test_a_rows_prediction_does_not_depend_on_the_other_texts(tiny_clip):
    """Bit for bit, as the plain forward at one batch size: what another row's text is (e.g. a
    negative prompt instead of the empty caption) does not move this row's numbers."""
    prior = random_prior(tiny_clip)
    rows = tiny_clip.encode_text(["", CAPTIONS[0], CAPTIONS[1], CAPTIONS[1]])
    other = tiny_clip.encode_text(["a green triangle", CAPTIONS[0], CAPTIONS[1], CAPTIONS[2]])
    x = torch.randn(4, tiny_clip.embed_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = prior.conditioned(rows)(x, 40)
        b = prior.conditioned(other)(x, 40)
    assert torch.equal(a[1:3], b[1:3])
    assert not torch.allclose(a[0], b[0]) and not torch.allclose(a[3], b[3])


def test_cached_prediction_under_bf16_autocast_equals_the_forward(tiny_clip):
    """Under autocast the cache adds positions and the prediction token in the hidden states'
    dtype, as diffusers does, so both paths round alike (the cache runs the whole text, as
    diffusers' forward over the whole sequence does)."""
    prior = random_prior(tiny_clip)
    prior.trim_text_padding = False
    text = guided_text(tiny_clip)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = prior(x, torch.tensor(400), text)
        got = prior.conditioned(text)(x, torch.tensor(400))
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=1e-6, rtol=0), (got - want).abs().max()


def _sample_lengths(prior, tiny_clip, steps=3):
    """Sequence lengths the last block sees while ``sample_prior`` runs, and the embeddings."""
    lengths = []
    block = prior.transformer.transformer_blocks[-1]
    hook = block.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(args[0].shape[1]), with_kwargs=True
    )
    settings = PriorSampling(scheduler="ddim", steps=steps, guidance_scale=3.0)
    try:
        best, _ = sample_tiny_prior(prior, tiny_clip, tiny_clip.encode_text(CAPTIONS), settings)
    finally:
        hook.remove()
    return lengths, best


def test_a_torch_compile_wrapper_runs_compiled(tiny_clip):
    """``torch.compile(prior)`` hands attribute lookups such as ``conditioned`` to the module it
    wraps; the sampler calls the wrapper instead, so the compiled forward runs at every step."""
    prior = random_prior(tiny_clip)
    full = tiny_clip.context_length + 4
    assert _sample_lengths(prior, tiny_clip)[0] == [full - 3] + [3] * 3
    wrapped = torch.compile(prior, backend="eager")  # dynamo traces; eager keeps it cheap
    lengths, best = _sample_lengths(wrapped, tiny_clip)
    assert lengths == [full] * 3
    _, plain = _sample_lengths(random_prior(tiny_clip).train(), tiny_clip)  # the plain forward
    torch.testing.assert_close(best, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["prior", "transformer"])
def test_hooks_or_a_replaced_forward_use_the_plain_forward(tiny_clip, where):
    """The cache never calls the prior or its transformer, so their hooks would be skipped."""
    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    module = prior if where == "prior" else prior.transformer
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    assert not isinstance(prior.conditioned(text), PrefixCache)
    _sample_lengths(prior, tiny_clip, steps=3)
    assert len(calls) == 3  # the hook ran at every step
    handle.remove()
    handle = module.register_forward_pre_hook(lambda *_: None)
    assert not isinstance(prior.conditioned(text), PrefixCache)
    handle.remove()
    own = module.forward
    module.forward = own  # the class's own method on the instance (Accelerate leaves this)
    assert isinstance(prior.conditioned(text), PrefixCache)
    module.forward = lambda *a, **k: own(*a, **k)  # a user's wrapper
    assert not isinstance(prior.conditioned(text), PrefixCache)
    del module.forward
    assert isinstance(prior.conditioned(text), PrefixCache)


def test_model_offload_hooks_keep_the_cache_other_accelerate_hooks_do_not(tiny_clip):
    """The offloader's hook (on every module) only brings the weights in, so the cache applies
    and gives the forward's numbers; another Accelerate hook on the prior, e.g. one that changes
    the output, must run, so the plain forward is used."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from unclip.utils.offload import ModelOffloader

    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(4))
    offloader = ModelOffloader({"prior": prior}, torch.device("cpu"))
    with torch.no_grad():
        fn = prior.conditioned(text)
        assert isinstance(fn, PrefixCache)
        got = fn(x, 7)
        assert offloader.active == "prior" and offloader.loads["prior"] == 1  # its hooks ran
        want = prior(x, 7, text)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    offloader.remove()
    assert isinstance(prior.conditioned(text), PrefixCache)

    class Doubled(ModelHook):
        def post_forward(self, module, output):
            return 2 * output

    add_hook_to_module(prior, Doubled())
    with torch.no_grad():
        fn = prior.conditioned(text)
        assert not isinstance(fn, PrefixCache)
        torch.testing.assert_close(fn(x, 7), 2 * want, atol=1e-5, rtol=1e-5)


def test_other_cases_that_use_the_plain_forward(tiny_clip):
    """A block compiled in place, a global hook, a module left in training mode (dropout), an
    attention module's forward replaced by the user."""
    text = guided_text(tiny_clip)
    prior = random_prior(tiny_clip)
    prior.transformer.transformer_blocks[1].compile()  # lazily: never called here
    assert not isinstance(prior.conditioned(text), PrefixCache)

    prior = random_prior(tiny_clip)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        assert not isinstance(prior.conditioned(text), PrefixCache)
    finally:
        handle.remove()
    assert isinstance(prior.conditioned(text), PrefixCache)

    prior.transformer.transformer_blocks[0].train()
    assert not isinstance(prior.conditioned(text), PrefixCache)
    prior.eval()

    attn = prior.transformer.transformer_blocks[0].attn1
    own = attn.forward
    attn.forward = lambda *a, **k: 2 * own(*a, **k)
    fn = prior.conditioned(text)
    assert not isinstance(fn, PrefixCache)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        doubled = fn(x, 5)
        del attn.forward
        assert not torch.allclose(doubled, prior(x, 5, text), atol=1e-3)  # the user's forward ran


def test_attention_processors(tiny_clip):
    """Attention slicing's processor computes plain attention, so the cache applies; a user's own
    processor must run, so the plain forward is used."""
    from diffusers.models.attention_processor import AttnProcessor2_0, SlicedAttnProcessor

    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = prior(x, 9, text)
        prior.transformer.set_attn_processor(SlicedAttnProcessor(1))
        fn = prior.conditioned(text)
        assert isinstance(fn, PrefixCache)
        torch.testing.assert_close(fn(x, 9), ref, atol=1e-5, rtol=1e-5)

        class Doubled(AttnProcessor2_0):
            def __call__(self, *args, **kwargs):
                return 2 * super().__call__(*args, **kwargs)

        prior.transformer.set_attn_processor(Doubled())
        fn = prior.conditioned(text)
        assert not isinstance(fn, PrefixCache)
        doubled = fn(x, 9)
        assert not torch.allclose(doubled, ref, atol=1e-3)
        torch.testing.assert_close(doubled, prior(x, 9, text))


def test_cached_prediction_with_a_lora_adapter(tiny_clip):
    """peft wraps the attention projections the cache calls, so an adapter acts on it as on the
    forward."""
    pytest.importorskip("peft")
    from unclip.nets.lora import add_adapter

    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base = prior(x, 11, text)
        add_adapter(prior, "style", rank=2)
        g = torch.Generator().manual_seed(7)
        for name, p in prior.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        want = prior(x, 11, text)
        fn = prior.conditioned(text)
        assert isinstance(fn, PrefixCache)
        got = fn(x, 11)
    assert not torch.allclose(want, base, atol=1e-3)  # the adapter changes the prediction
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def positions_seen(prior: UnCLIPPrior, run) -> list[int]:
    """The sequence lengths the first transformer block sees while ``run()`` runs."""
    seen: list[int] = []
    block = prior.transformer.transformer_blocks[0]
    handle = block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    try:
        run()
    finally:
        handle.remove()
    return seen


def prediction_and_grads(prior: UnCLIPPrior, x, t, text, trim: bool):
    prior.trim_text_padding = trim
    prior.zero_grad()
    out = prior(x, t, text)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in prior.named_parameters() if p.grad is not None}
    prior.trim_text_padding = True
    return out.detach(), grads


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"normformer": True, "ff_activation": "swiglu"},
        {"text_encoder": "transformer", **TINY_TEXT_ENCODER},
    ],
    ids=["diffusers-blocks", "normformer-swiglu", "own-caption-transformer"],
)
def test_trimmed_forward_equals_the_whole_sequence_with_gradients(tiny_clip, options):
    prior = random_prior(tiny_clip, **options).train()
    text = guided_text(tiny_clip, repeats=1)
    if prior.has_text_encoder:  # the caption transformer's own tokens and mask
        text = text.with_caption_ids(prior.tokenize([""] * len(CAPTIONS) + CAPTIONS))
    with torch.no_grad():
        _, mask = prior.text_inputs(text)
    longest, n = int(mask.sum(1).max()), mask.shape[1]
    assert longest < n
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(2))
    t = torch.arange(len(text)) * 150
    seen = positions_seen(prior, lambda: prediction_and_grads(prior, x, t, text, True))
    assert seen == [longest + 4]  # the text up to the longest caption, then the four others
    got, got_grads = prediction_and_grads(prior, x, t, text, True)
    assert positions_seen(prior, lambda: prediction_and_grads(prior, x, t, text, False)) == [n + 4]
    want, want_grads = prediction_and_grads(prior, x, t, text, False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        # the attention's key biases have a gradient of exactly zero in exact arithmetic
        # (a bias added to every key shifts a query's scores alike); both sides round near 1e-7
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    pos = got_grads["transformer.positional_embedding"][0]
    assert pos[longest:n].abs().max() == 0  # padding positions get no gradient either way
    assert pos[:longest].abs().max() > 0 and pos[n:].abs().max() > 0


def test_trimmed_forward_under_bf16_autocast_is_close_to_the_whole_sequence(tiny_clip):
    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip, repeats=1)
    x = torch.randn(len(text), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = prior(x, torch.tensor(400), text)
        prior.trim_text_padding = False
        want = prior(x, torch.tensor(400), text)
    assert got.dtype == want.dtype
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.02 * scale


def test_whole_sequence_where_trimming_does_not_apply(tiny_clip):
    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip, repeats=1)
    n = text.text_tokens.shape[1]
    x = torch.randn(len(text), tiny_clip.embed_dim)

    def run(txt=text):
        with torch.no_grad():
            prior(x, 5, txt)

    assert positions_seen(prior, run) != [n + 4]  # trimmed by default
    # a forward or backward hook on the transformer must see its call
    handle = prior.transformer.register_forward_hook(lambda *a: None)
    assert positions_seen(prior, run) == [n + 4]
    handle.remove()
    handle = prior.transformer.register_full_backward_hook(lambda *a: None)
    assert positions_seen(prior, run) == [n + 4]
    handle.remove()
    assert positions_seen(prior, run) != [n + 4]
    # no padding common to every row: nothing to trim
    full = TextEncoding(
        text.text_embed, text.text_tokens, torch.ones_like(text.text_mask, dtype=torch.bool)
    )
    assert positions_seen(prior, lambda: run(full)) == [n + 4]


def test_a_flop_counter_sees_the_trimmed_work(tiny_clip):
    """FlopCounterMode's global module hooks do not turn trimming off: it counts what runs."""
    from torch.utils.flop_counter import FlopCounterMode

    prior = random_prior(tiny_clip)
    text = guided_text(tiny_clip, repeats=1)
    x = torch.randn(len(text), tiny_clip.embed_dim)
    counts = {}
    for trim in (True, False):
        prior.trim_text_padding = trim
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            prior(x, 5, text)
        counts[trim] = counter.get_total_flops()
    n, longest = text.text_tokens.shape[1], int(text.text_mask.sum(1).max())
    assert counts[True] < counts[False] * (longest + 4) / (n + 4) * 1.5
