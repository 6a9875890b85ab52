"""DALL-E Mega's transformer options for the prior: NormFormer and GLU feed-forwards
(``unclip.nets.blocks``, ``prior.normformer``, ``prior.ff_activation``)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock

from unclip.interop.diffusers_export import export_problems
from unclip.nets.blocks import TransformerBlock, ff_hidden_width
from unclip.nets.config import PriorConfig
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.tiny import tiny_pipeline, tiny_prior_kwargs
from unclip.utils.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("one_thread")

#: TransformerBlock's names for BasicTransformerBlock's weights
TO_DIFFUSERS = {
    "attn_norm": "norm1",
    "attn.to_q": "attn1.to_q",
    "attn.to_k": "attn1.to_k",
    "attn.to_v": "attn1.to_v",
    "attn.to_out": "attn1.to_out.0",
    "ff_norm": "norm3",
    "ff.proj_in": "ff.net.0.proj",
    "ff.proj_out": "ff.net.2",
}


def causal_mask(batch, heads, s):
    """Diffusers' prior layout: additive, ``[B * heads, S, S]``."""
    return torch.full((s, s), -10000.0).triu(1)[None].repeat(batch * heads, 1, 1)


def test_plain_block_computes_what_diffusers_block_computes():
    torch.manual_seed(0)
    ref = BasicTransformerBlock(32, 2, 16, activation_fn="gelu", attention_bias=True).eval()
    block = TransformerBlock(32, 2, 16).eval()
    theirs = ref.state_dict()
    block.load_state_dict(
        {
            k: theirs[TO_DIFFUSERS[k.rsplit(".", 1)[0]] + "." + k.rsplit(".", 1)[1]]
            for k in block.state_dict()
        }
    )
    x = torch.randn(3, 7, 32)
    mask = causal_mask(3, 2, 7)
    assert torch.allclose(block(x, mask), ref(x, attention_mask=mask), atol=1e-6)


def reference_block(block: TransformerBlock, x, mask, activation):
    """NormFormer with a GLU feed-forward written out from the papers, with the block's weights:
    ``x + LN(Attn(LN(x)))`` with each head's output scaled before the output projection, then
    ``x + W2 LN(act(W1 LN(x)))`` (for a GLU ``act(W1 x)`` is ``value * gelu/silu(gate)``)."""
    a = block.attn
    b, s, _ = x.shape
    h = F.layer_norm(x, (x.shape[-1],), block.attn_norm.weight, block.attn_norm.bias)

    def heads(t):
        return t.view(b, s, 2, 16).transpose(1, 2)

    q, k, v = heads(a.to_q(h)), heads(a.to_k(h)), heads(a.to_v(h))
    w = torch.softmax(q @ k.transpose(-1, -2) / 4.0 + mask.view(b, 2, s, s), dim=-1)
    o = (w @ v) * a.head_scale.view(1, 2, 1, 1)
    o = a.to_out(o.transpose(1, 2).reshape(b, s, 32))
    x = x + F.layer_norm(o, (32,), block.attn_out_norm.weight, block.attn_out_norm.bias)
    f = block.ff
    u = f.proj_in(F.layer_norm(x, (32,), block.ff_norm.weight, block.ff_norm.bias))
    if activation == "gelu":
        u = F.gelu(u)
    else:
        value, gate = u.chunk(2, dim=-1)
        u = value * (F.gelu(gate) if activation == "geglu" else F.silu(gate))
    u = F.layer_norm(u, (u.shape[-1],), f.inner_norm.weight, f.inner_norm.bias)
    return x + f.proj_out(u)


@pytest.mark.parametrize("activation", ["gelu", "geglu", "swiglu"])
def test_normformer_block_matches_the_papers(activation):
    torch.manual_seed(0)
    block = TransformerBlock(32, 2, 16, normformer=True, ff_activation=activation).eval()
    with torch.no_grad():  # non-trivial head scales and norm gains, as after training
        block.attn.head_scale.copy_(torch.tensor([0.5, 2.0]))
        for norm in (block.attn_out_norm, block.ff.inner_norm):
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 32)
    mask = causal_mask(2, 2, 5)
    assert torch.allclose(block(x, mask), reference_block(block, x, mask, activation), atol=1e-5)


def test_glu_keeps_the_feed_forward_parameter_count():
    dim = 256

    def ff_params(activation):
        return sum(
            p.numel()
            for p in TransformerBlock(dim, 4, 64, ff_activation=activation).ff.parameters()
        )

    assert ff_hidden_width(dim, "gelu") == 4 * dim and ff_hidden_width(dim, "swiglu") == 682
    gelu = ff_params("gelu")
    for activation in ("geglu", "swiglu"):
        assert abs(ff_params(activation) - gelu) / gelu < 0.005


def test_block_options_are_checked():
    with pytest.raises(ValueError, match="ff_activation must be one of gelu, geglu, swiglu"):
        TransformerBlock(32, 2, 16, ff_activation="relu")
    with pytest.raises(ValueError, match="ff_activation must be one of"):
        UnCLIPPrior(embed_dim=32, text_width=32, context_length=8, ff_activation="reglu")
    with pytest.raises(ConfigError, match="'ff_activation' must be one of"):
        load_config({"ff_activation": "reglu"}, schema=PriorConfig)
    cfg = load_config(None, ["normformer=true", "ff_activation=geglu"], schema=PriorConfig)
    assert cfg.normformer is True and cfg.ff_activation == "geglu"


def test_default_prior_keeps_diffusers_blocks_and_options_swap_them(tiny_clip):
    plain = UnCLIPPrior.from_clip(tiny_clip, **tiny_prior_kwargs())
    assert all(isinstance(b, BasicTransformerBlock) for b in plain.transformer.transformer_blocks)
    mega = UnCLIPPrior.from_clip(
        tiny_clip, **tiny_prior_kwargs(), normformer=True, ff_activation="swiglu"
    )
    blocks = mega.transformer.transformer_blocks
    assert len(blocks) == 2 and all(isinstance(b, TransformerBlock) for b in blocks)
    assert blocks[0].attn.head_scale is not None and blocks[0].ff.ff_activation == "swiglu"
    # everything outside the blocks is diffusers' prior as before
    outside = {k for k in plain.state_dict() if ".transformer_blocks." not in k}
    assert outside == {k for k in mega.state_dict() if ".transformer_blocks." not in k}


def test_prior_with_options_saves_loads_and_samples(tiny_clip, tmp_path):
    torch.manual_seed(0)
    prior = UnCLIPPrior.from_clip(
        tiny_clip, **tiny_prior_kwargs(), normformer=True, ff_activation="geglu"
    ).eval()
    with torch.no_grad():
        for b in prior.transformer.transformer_blocks:
            b.attn.head_scale.copy_(torch.tensor([0.7, 1.3]))
    prior.save_pretrained(tmp_path / "prior")
    loaded = UnCLIPPrior.from_pretrained(tmp_path / "prior").eval()
    assert loaded.config.normformer is True and loaded.config.ff_activation == "geglu"
    text = tiny_clip.encode_text(["a red circle", "two blue squares"])
    x_t, t = torch.randn(2, tiny_clip.embed_dim), torch.tensor([3, 900])
    with torch.no_grad():
        assert torch.equal(prior(x_t, t, text), loaded(x_t, t, text))
    pipe = tiny_pipeline(seed=0)
    pipe.prior = loaded
    embeds = pipe.sample_image_embeds(
        ["a red circle"], generator=torch.Generator().manual_seed(0), progress=False
    )
    assert embeds.shape == (1, tiny_clip.embed_dim) and torch.isfinite(embeds).all()


def test_export_refuses_a_prior_with_mega_blocks(tiny_clip):
    pipe = tiny_pipeline(seed=0)
    before = export_problems(pipe)
    assert not any("normformer" in p for p in before)
    pipe.prior = UnCLIPPrior.from_clip(tiny_clip, **tiny_prior_kwargs(), ff_activation="swiglu")
    problems = [p for p in export_problems(pipe) if p not in before]
    assert len(problems) == 1
    assert "normformer=False, ff_activation=swiglu" in problems[0]
    assert "BasicTransformerBlocks only" in problems[0]
