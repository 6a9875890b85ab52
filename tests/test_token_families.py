"""The other two seed families' networks: DALL-E's dVAE and transformer, DALL-E Mega's VQGAN and
BART transformer, and image-token sampling. Tiny seeded models on the CPU; full-scale sizes are
built on the meta device only."""

import math

import pytest
import torch
import torch.nn.functional as F

from unclip.nets.dvae import DVAEConfig, dvae_schedule
from unclip.nets.token_transformer import (
    DalleConfig,
    MegaConfig,
    dalle_attention_mask,
    dalle_layer_kinds,
    parameter_count,
)
from unclip.nets.vqgan import PerceptualLoss, VQGANConfig
from unclip.sampling import tokens as sampling


def tiny_dalle(**kw):
    torch.manual_seed(0)
    cfg = dict(
        num_layers=5,
        width=32,
        num_heads=4,
        text_len=6,
        grid=4,
        text_vocab_size=20,
        image_vocab_size=12,
        conv_kernel=3,
    )
    cfg.update(kw)
    return DalleConfig(**cfg).build().eval()


def tiny_mega():
    torch.manual_seed(0)
    return (
        MegaConfig(
            encoder_layers=2,
            decoder_layers=2,
            width=32,
            num_heads=4,
            glu_width=64,
            text_len=8,
            grid=3,
            text_vocab_size=20,
            image_vocab_size=12,
        )
        .build()
        .eval()
    )


def captions():
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 3, 3], [13, 14, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]).bool()
    return ids, mask


# ------------------------------------------------------------------------------- masks


def expected_mask(kind: str, text_len: int, grid: int) -> torch.Tensor:
    """The paper's patterns (Figure 11, after the Sparse Transformer) written geometrically on
    the token grid: an image token at (r, c) sees every text slot, and among earlier image tokens
    row: the earlier tokens of its row and the tokens of the row above at columns >= c;
    column: the tokens above it in its column; conv (3 × 3): the rows r-1 and r within one
    column, causally."""
    s = text_len + grid * grid
    m = torch.zeros(s, s, dtype=torch.bool)
    for q in range(s):
        for k in range(q + 1):
            if q <= text_len or k <= text_len or kind == "dense":
                m[q, k] = True
                continue
            (rq, cq), (rk, ck) = divmod(q - text_len - 1, grid), divmod(k - text_len - 1, grid)
            if kind == "row":
                ok = (rk == rq and ck <= cq) or (rk == rq - 1 and ck >= cq)
            elif kind == "column":
                ok = ck == cq and rk <= rq
            else:
                ok = rk in (rq - 1, rq) and abs(ck - cq) <= 1 and (rk < rq or ck <= cq)
            m[q, k] = ok
    return m


@pytest.mark.parametrize("kind", ["dense", "row", "column", "conv"])
def test_attention_masks_match_the_papers_patterns(kind):
    for text_len, grid in ((6, 4), (2, 5)):
        got = dalle_attention_mask(kind, text_len, grid, conv_kernel=3)
        assert torch.equal(got, expected_mask(kind, text_len, grid)), (kind, text_len, grid)


def test_row_mask_on_the_papers_toy_grid():
    # the 4 × 4 example: image token 8 (row 2, column 0) attends to tokens 4 … 8
    m = dalle_attention_mask("row", 6, 4)
    first = 7  # start token + 6 text slots
    seen = [j for j in range(15) if m[first + 8, first + j]]
    assert seen == [4, 5, 6, 7, 8]
    assert m[first + 8, :first].all()


def test_layer_schedule_is_the_papers():
    kinds = dalle_layer_kinds(64)
    assert kinds[:4] == ["row", "column", "row", "row"]
    assert kinds[-1] == "conv" and kinds.count("conv") == 1
    assert [i + 1 for i, k in enumerate(kinds) if k == "column"] == list(range(2, 64, 4))
    assert dalle_layer_kinds(3, sparse=False) == ["dense"] * 3


def test_dalle_transformer_applies_the_sparse_mask():
    # one layer: the conv mask (3 × 3); image token 15 at (3, 3) is predicted from slot 14's
    # state, which holds token 14 at (3, 2): token 0 at (0, 0) is outside its window, 10 inside
    model = tiny_dalle(num_layers=1)
    ids, mask = captions()
    image = torch.randint(0, 12, (3, 15), generator=torch.Generator().manual_seed(0))
    base = model.image_logits(ids, mask, image)[:, -1]
    for j, inside in ((0, False), (10, True)):
        changed = image.clone()
        changed[:, j] = (changed[:, j] + 1) % 12
        diff = (model.image_logits(ids, mask, changed)[:, -1] - base).abs().max()
        assert (diff > 1e-6) == inside, j


@pytest.mark.parametrize("family", ["dalle", "mega"])
def test_image_logits_are_causal_and_ignore_caption_padding(family):
    model = tiny_dalle() if family == "dalle" else tiny_mega()
    ids, mask = captions()
    n = model.grid * model.grid - 1
    image = torch.randint(0, 12, (3, n), generator=torch.Generator().manual_seed(4))
    base = model.image_logits(ids, mask, image)
    assert base.shape == (3, n + 1, 12)
    later = image.clone()
    later[:, 5] = (later[:, 5] + 1) % 12
    moved = model.image_logits(ids, mask, later)
    # row i predicts token i from tokens < i: rows 0 … 5 do not see token 5
    assert torch.allclose(moved[:, :6], base[:, :6], atol=1e-6)
    assert (moved[:, 6:] - base[:, 6:]).abs().max() > 1e-4
    # ids under a false mask are padding, whatever their value
    other = torch.where(mask, ids, torch.full_like(ids, 17))
    assert torch.allclose(model.image_logits(other, mask, image), base, atol=1e-6)
    # a whole grid of tokens leaves nothing to predict: refused, naming the most it takes
    whole = torch.cat([image, image[:, :1]], 1)
    with pytest.raises(
        ValueError, match=f"^{family}: feed at most {n} image tokens .*got {n + 1}$"
    ):
        model.image_logits(ids, mask, whole)


# ------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("family", ["dalle", "mega"])
def test_cached_sampling_equals_uncached(family):
    model = tiny_dalle() if family == "dalle" else tiny_mega()
    ids, mask = captions()
    for settings in (
        dict(),
        dict(temperature=0.7, top_k=5, top_p=0.9, guidance_scale=3.0),
    ):
        out = {}
        for use_cache in (True, False):
            gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
            out[use_cache] = sampling.sample_image_tokens(
                model,
                ids,
                mask,
                generator=gens,
                use_cache=use_cache,
                return_logits=True,
                **settings,
            )
        (tc, lc), (tu, lu) = out[True], out[False]
        assert tc.shape == (3, model.grid, model.grid)
        assert torch.equal(tc, tu)
        assert (lc - lu).abs().max() < 1e-5
        assert tc.unique().numel() > 1  # a real sample, not a constant


def test_sampling_filters_and_per_row_generators():
    model = tiny_mega()
    ids, mask = captions()
    # top_k = 1 is greedy decoding: every token is the argmax of the logits it was drawn from
    tokens, logits = sampling.sample_image_tokens(
        model, ids, mask, top_k=1, generator=torch.Generator().manual_seed(0), return_logits=True
    )
    assert torch.equal(tokens.flatten(1), logits.argmax(-1))
    # with one generator per row, a row's sample does not depend on the rows batched with it
    batch = sampling.sample_image_tokens(
        model, ids, mask, generator=[torch.Generator().manual_seed(20 + i) for i in range(3)]
    )
    alone = sampling.sample_image_tokens(
        model, ids[1:2], mask[1:2], generator=[torch.Generator().manual_seed(21)]
    )
    assert torch.equal(batch[1:2], alone)
    with pytest.raises(ValueError, match="generators"):
        sampling.sample_image_tokens(model, ids, mask, generator=[torch.Generator()])


@pytest.mark.parametrize("family", ["dalle", "mega"])
def test_super_conditioning(family):
    model = tiny_dalle() if family == "dalle" else tiny_mega()
    ids, mask = captions()

    def run(scale):
        g = torch.Generator().manual_seed(3)
        return sampling.sample_image_tokens(
            model, ids, mask, guidance_scale=scale, generator=g, return_logits=True
        )

    plain_tokens, plain = run(None)
    one_tokens, one = run(1.0)  # α = 1: the conditional pass alone, as None
    assert torch.equal(plain_tokens, one_tokens) and torch.equal(one, plain)

    # α = 3: the logits of each step are uncond + 3 (cond − uncond), the unconditional pass
    # reading the empty caption, recomputed here by teacher forcing on the sampled tokens
    tokens, guided = run(3.0)
    flat = tokens.flatten(1)[:, :-1]
    null_ids, null_mask = model.null_text(*ids.shape)
    cond = model.image_logits(ids, mask, flat)
    uncond = model.image_logits(null_ids, null_mask, flat)
    assert (guided - (uncond + 3.0 * (cond - uncond))).abs().max() < 1e-5
    assert (guided - cond).abs().max() > 1e-3


# ------------------------------------------------------------------------------- losses


def test_dalle_loss_weighs_text_and_image_by_one_and_seven_eighths():
    model = tiny_dalle()
    ids, mask = captions()
    image = torch.randint(0, 12, (3, 4, 4), generator=torch.Generator().manual_seed(1))
    got = model.loss(ids, mask, image)
    text_logits, image_logits = model(ids, mask, image.flatten(1)[:, :-1])
    # targets by hand: caption tokens, then padding token `20 + p` at free position p
    text_nll, image_nll = [], []
    for b in range(3):
        for p in range(6):
            real = p < 5 and bool(mask[b, p])
            target = int(ids[b, p]) if real else 20 + p
            text_nll.append(-text_logits[b, p].log_softmax(-1)[target])
        for i in range(16):
            image_nll.append(-image_logits[b, i].log_softmax(-1)[image.flatten(1)[b, i]])
    text = torch.stack(text_nll).mean()
    img = torch.stack(image_nll).mean()
    assert torch.allclose(got.text, text, atol=1e-6)
    assert torch.allclose(got.image, img, atol=1e-6)
    assert torch.allclose(got.loss, text / 8 + 7 * img / 8, atol=1e-6)
    assert not torch.allclose(got.loss, (text + img) / 2, atol=1e-4)


def test_mega_caption_dropout_uses_the_empty_caption():
    model = tiny_mega()
    ids, mask = captions()
    image = torch.randint(0, 12, (3, 9), generator=torch.Generator().manual_seed(2))
    null_ids, null_mask = model.null_text(*ids.shape)
    assert torch.equal(null_ids[0, :3], torch.tensor([0, 2, 1]))
    dropped = model.loss(ids, mask, image, cond_drop_prob=1.0)
    assert torch.allclose(dropped, model.loss(null_ids, null_mask, image))
    kept = model.loss(ids, mask, image, cond_drop_prob=0.0)
    manual = F.cross_entropy(model(ids, mask, image[:, :-1]).flatten(0, 1), image.flatten())
    assert torch.allclose(kept, manual)
    assert not torch.allclose(kept, dropped)


# ------------------------------------------------------------------------------- tokenizers


def quadrant_images(n=4):
    cols = torch.rand(n, 3, 2, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return F.interpolate(cols, size=16, mode="nearest")


@pytest.mark.parametrize("recon", ["logit_laplace", "l1", "mse"])
def test_dvae_round_trip_and_training_reduce_reconstruction_error(recon):
    torch.manual_seed(0)
    dvae = DVAEConfig(
        image_size=16, num_codes=16, n_hid=8, blocks_per_group=1, n_init=8, recon=recon
    ).build()
    x = quadrant_images()
    tokens = dvae.encode(x)
    assert tokens.shape == (4, 2, 2) and tokens.dtype == torch.long
    out = dvae.decode(tokens)
    assert out.shape == x.shape and out.min() >= -1 and out.max() <= 1

    def error():
        return (dvae.decode(dvae.encode(x)) - x).pow(2).mean().item()

    before = error()
    opt = torch.optim.Adam(dvae.parameters(), 1e-2)
    first = None
    # 80 steps: mse's hard round trip only starts to follow the soft one after ~50 on this torch
    for i in range(80):
        loss = dvae.loss(
            x, temperature=1.0, kl_weight=0.0, generator=torch.Generator().manual_seed(i)
        )
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
        first = loss.recon.item() if first is None else first
    assert loss.recon.item() < (first - 0.3 if recon == "logit_laplace" else 0.75 * first)
    assert error() < 0.6 * before


@pytest.mark.parametrize("recon", ["l1", "mse"])
def test_dvae_plain_reconstruction_terms_score_the_decoded_pixels(recon):
    """Under ``l1`` / ``mse`` the decoder's three channels are the pixels: ``recon`` is their
    mean absolute / squared error (with the loss's own gumbel sample), and decoding hard
    tokens returns them clamped to [-1, 1]."""
    torch.manual_seed(0)
    cfg = DVAEConfig(image_size=16, num_codes=16, n_hid=8, blocks_per_group=1, recon=recon)
    dvae, x = cfg.build(), quadrant_images(2)
    assert dvae.decoder[-1].out_channels == 3
    with torch.no_grad():
        dvae.decoder[-1].bias.add_(3.0)  # push the pixels past 1, so the clamp shows
        loss = dvae.loss(x, 0.5, 0.0, generator=torch.Generator().manual_seed(7))
        logits = dvae.logits(x)
        u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(7))
        gumbel = -torch.log(-torch.log(u))
        pixels = dvae.decoder(dvae.decoder_in(((logits + gumbel) / 0.5).softmax(1)))
        err = (pixels - x).abs() if recon == "l1" else (pixels - x).pow(2)
        assert torch.allclose(loss.recon, err.mean(), atol=1e-5)
        tokens = dvae.encode(x)
        hard = dvae.decoder(dvae.decoder_in(F.one_hot(tokens, 16).permute(0, 3, 1, 2).float()))
        assert hard.max() > 1
        assert torch.allclose(dvae.decode(tokens), hard.clamp(-1, 1), atol=1e-5)
    with pytest.raises(ValueError, match="dvae: recon must be one of logit_laplace, l1, mse"):
        DVAEConfig(recon="l2")


def test_dvae_posterior_perplexities_count_the_codes_in_use():
    """``posterior_perplexity`` (of the batch's mean posterior) and ``token_perplexity`` (of each
    token's), the tokenizer runs' collapse gauges, on logits ``[B, K, h, w]`` over 16 codes."""
    from unclip.train.tokens import posterior_metrics

    flat = torch.zeros(2, 16, 2, 2)
    assert posterior_metrics(flat) == pytest.approx(
        {"posterior_perplexity": 16, "token_perplexity": 16}
    )
    # every token sure of its code; half the tokens on code 3, half on code 5
    sure = torch.zeros(2, 16, 2, 2)
    sure[0, 3], sure[1, 5] = 50.0, 50.0
    assert posterior_metrics(sure) == pytest.approx(
        {"posterior_perplexity": 2, "token_perplexity": 1}, abs=1e-4
    )
    # every token split evenly between codes 3 and 5
    split = torch.zeros(2, 16, 2, 2)
    split[:, 3], split[:, 5] = 50.0, 50.0
    assert posterior_metrics(split) == pytest.approx(
        {"posterior_perplexity": 2, "token_perplexity": 2}, abs=1e-4
    )


def test_dvae_kl_is_to_the_uniform_prior():
    torch.manual_seed(0)
    dvae = DVAEConfig(image_size=16, num_codes=16, n_hid=8, blocks_per_group=1, n_init=8).build()
    x = quadrant_images(2)
    loss = dvae.loss(x, 1.0, 2.5, generator=torch.Generator().manual_seed(0))
    q = dvae.logits(x).softmax(1)  # [B, K, h, w]
    kl = (q * (q * 16).log()).sum(1).flatten(1).sum(1).mean() / x[0].numel()
    assert torch.allclose(loss.kl, kl, atol=1e-6)
    assert torch.allclose(loss.loss, loss.recon + 2.5 * loss.kl)


def test_dvae_schedule_endpoints():
    total = 30_000
    start, end = dvae_schedule(0, total), dvae_schedule(total, total)
    assert (start.temperature, start.kl_weight, start.lr) == (1.0, 0.0, 1e-4)
    assert end.temperature == pytest.approx(1 / 16)
    assert end.kl_weight == pytest.approx(6.6)
    assert end.lr == pytest.approx(1.25e-6)
    # the paper's spans scaled by total / 3,000,000: β reaches 6.6 at 50 steps, τ 1/16 at 1,500
    assert dvae_schedule(50, total).kl_weight == pytest.approx(6.6)
    assert dvae_schedule(25, total).kl_weight == pytest.approx(3.3)
    assert dvae_schedule(1_500, total).temperature == pytest.approx(1 / 16)
    assert dvae_schedule(750, total).temperature == pytest.approx((1 + 1 / 16) / 2)


def test_dvae_schedule_spans_can_be_set_in_steps():
    """``tau_steps`` / ``kl_steps`` replace the scaled spans of a short run (here 1,000 steps,
    where the paper's would be 50 and 1.7 steps)."""
    s = dvae_schedule(300, 1_000, tau_steps=600, kl_steps=400)
    assert s.temperature == pytest.approx(1 / 16 + (1 - 1 / 16) / 2)
    assert s.kl_weight == pytest.approx(6.6 * (1 - math.cos(math.pi * 0.75)) / 2)
    assert dvae_schedule(600, 1_000, tau_steps=600).temperature == pytest.approx(1 / 16)
    assert dvae_schedule(300, 1_000).temperature == pytest.approx(1 / 16)  # scaled: 50 steps
    from conftest import CONFIGS

    from unclip.train.config import ConfigError
    from unclip.train.token_config import load_tokenizer_train_config

    tiny = CONFIGS / "tiny" / "dvae.yaml"
    assert load_tokenizer_train_config(tiny, ["kl_steps=400"]).kl_steps == 400
    for bad in ("0", "-3"):
        with pytest.raises(ConfigError, match="tau_steps must be an integer >= 1 or null"):
            load_tokenizer_train_config(tiny, [f"tau_steps={bad}"])
    with pytest.raises(ConfigError, match="'kl_steps' must be an integer"):
        load_tokenizer_train_config(tiny, ["kl_steps=2.5"])


def test_vqgan_l2_codes_look_up_by_cosine_and_survive_a_save(tmp_path):
    from unclip.nets.token_components import TokenizerConfig, load_tokenizer, save_component

    torch.manual_seed(0)
    vqgan = tiny_vqgan_config(l2_codes=True).build()
    x = quadrant_images()
    z_e, z_q, tokens = vqgan.quantize(x)
    assert torch.allclose(z_e.norm(dim=1), torch.ones(()), atol=1e-5)
    assert torch.allclose(z_q.norm(dim=1), torch.ones(()), atol=1e-5)
    # the nearest unit code is the one of largest cosine with the raw code vectors
    raw = vqgan.model.quantize.embedding.weight
    cos = torch.einsum("bchw,kc->bkhw", z_e, F.normalize(raw, dim=1))
    assert torch.equal(tokens, cos.argmax(1))
    direct = vqgan.model.decoder(vqgan.model.post_quant_conv(z_q)).clamp(-1, 1)
    assert torch.allclose(vqgan.decode(tokens), direct, atol=1e-5)
    plain = tiny_vqgan_config().build()
    plain.load_state_dict(vqgan.state_dict())
    assert not torch.allclose(plain.decode(tokens), vqgan.decode(tokens), atol=1e-3)

    cfg = TokenizerConfig(type="vqgan", vqgan=tiny_vqgan_config(l2_codes=True))
    save_component(vqgan, tmp_path / "tok", "tokenizer", cfg)
    loaded, loaded_cfg = load_tokenizer(tmp_path / "tok")
    assert loaded_cfg.vqgan.l2_codes and loaded.l2_codes
    assert torch.equal(loaded.encode(x), tokens)


def tiny_vqgan_config(**kw):
    return VQGANConfig(
        image_size=16,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=8,
        num_codes=32,
        norm_num_groups=8,
        **kw,
    )


def test_vqgan_round_trip_and_training_reduce_reconstruction_error():
    torch.manual_seed(0)
    cfg = tiny_vqgan_config(discriminator_weights="init", discriminator_layers=1)
    vqgan, loss_fn = cfg.build(), cfg.build_loss()
    x = quadrant_images()
    tokens = vqgan.encode(x)
    assert tokens.shape == (4, 8, 8) and int(tokens.max()) < 32
    assert vqgan.decode(tokens).shape == x.shape
    # decoding the tokens is decoding their code vectors
    _, z_q, _ = vqgan.quantize(x)
    direct = vqgan.model.decoder(vqgan.model.post_quant_conv(z_q)).clamp(-1, 1)
    assert torch.allclose(vqgan.decode(tokens), direct, atol=1e-5)

    terms = loss_fn(vqgan, x)
    z_e, z_q, _ = vqgan.quantize(x)
    assert torch.allclose(terms["commitment"], (z_e - z_q).pow(2).mean())
    expected = (
        terms["recon"] + terms["codebook"] + 0.25 * terms["commitment"] + 0.1 * terms["adversarial"]
    )
    assert torch.allclose(terms["loss"], expected)

    def error():
        return (vqgan.decode(vqgan.encode(x)) - x).pow(2).mean().item()

    before = error()
    opt = torch.optim.Adam(vqgan.parameters(), 2e-3)
    for _ in range(30):
        terms = loss_fn(vqgan, x)
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
    assert error() < 0.6 * before


def test_vqgan_perceptual_term_from_a_local_file(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = PerceptualLoss()
    state = {f"features.{k}": v.contiguous() for k, v in net.features.state_dict().items()}
    state["lin0.weight"] = torch.full((1, 64, 1, 1), 2.0)
    path = tmp_path / "vgg_lpips.safetensors"
    save_file(state, str(path))
    loss_fn = tiny_vqgan_config(perceptual_weights=str(path)).build_loss()
    x = quadrant_images(2)
    y = x.flip(0)
    assert loss_fn.perceptual(x, x).item() == 0.0
    assert loss_fn.perceptual(x, y).item() > 0.0
    assert torch.equal(loss_fn.perceptual.lin0, torch.full((1, 64, 1, 1), 2.0))
    with pytest.raises(ValueError, match="does not exist"):
        tiny_vqgan_config(perceptual_weights=str(tmp_path / "missing.pt")).build_loss()


# ------------------------------------------------------------------------------- full scale


def test_full_scale_parameter_counts():
    # DALL-E (paper §2.2, appendix B.1): 64 pre-LN blocks of width 3,968 with biases:
    # attention 4d² + 4d, MLP 8d² + 5d, two LayerNorms 4d
    d = 3968
    blocks = 64 * (12 * d * d + 13 * d)
    embeddings = (16384 + 256 + 1) * d + 257 * d + 8192 * d + 2 * 32 * d
    heads = (d + 1) * (16384 + 256) + (d + 1) * 8192 + 2 * d
    dalle_expected = blocks + embeddings + heads
    with torch.device("meta"):
        dalle = DalleConfig().build()
    assert parameter_count(dalle) == dalle_expected
    assert 11.5e9 < dalle_expected < 12.5e9  # "a 12-billion parameter ... transformer"

    # DALL-E Mega (training journal): no biases; NormFormer LNs; GLU with two d × 4096 matrices in
    # and one out plus an LN over its 4,096 hidden units
    d, g = 2048, 4096
    ff = 3 * d * g + 2 * g + 2 * d
    enc_layer = 4 * d * d + 4 * d + ff
    dec_layer = 8 * d * d + 8 * d + ff
    mega_expected = (
        50264 * d
        + 64 * d
        + 2 * d
        + 24 * enc_layer
        + 2 * d  # encoder
        + 16385 * d
        + 256 * d
        + 2 * d
        + 24 * dec_layer
        + 2 * d  # decoder
        + d * 16384  # head
    )
    with torch.device("meta"):
        mega = MegaConfig().build()
    assert parameter_count(mega) == mega_expected
    # the figure quoted for DALL-E Mega is 2.6 billion
    assert math.isclose(mega_expected, 2.6e9, rel_tol=0.02)
