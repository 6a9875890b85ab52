"""The caption transformer (``text_encoder: transformer``) runs only up to the batch's longest
caption: the real tokens' states, the pooled state, the decoder's prediction and every gradient
are those of the whole context, with fewer positions computed."""

import pytest
import torch

from unclip.nets.text_encoder import CaptionTransformer, caption_tokenizer
from unclip.pipeline.tiny import TINY_TEXT_ENCODER, tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a red circle", "two blue squares on the left of a big green triangle", ""]


def run(module, trim: bool, fn):
    """``fn()`` with the caption transformer's trimming ``trim``; its result and the gradients
    of every parameter after ``fn()``'s scalar's backward."""
    caption = module if isinstance(module, CaptionTransformer) else module.text_transformer
    caption.trim_padding = trim
    module.zero_grad()
    out, loss = fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    caption.trim_padding = True
    return out, grads


def test_states_pooled_state_and_gradients_equal_the_whole_context():
    torch.manual_seed(0)
    # float64: the gradients are sums in the hundreds, whose float32 rounding (~3e-5) depends on
    # the summation order of the machine's kernels; in float64 the two contexts agree to 1e-10
    net = CaptionTransformer(49408, 49407, 16, 32, 2, 2).double()
    ids = caption_tokenizer("open_clip_bpe", 16)(CAPTIONS)
    longest = int((ids != 0).sum(1).max())
    assert longest < 16
    weights = torch.randn(16, 32, dtype=torch.float64)

    def fn():
        states, mask, final = net(ids)
        n = states.shape[1]
        # what a consumer reads: the real tokens' states (under the mask) and the pooled state
        return (states, mask, final), (states * weights[:n])[mask].sum() + final.square().sum()

    (states, mask, final), grads = run(net, True, fn)
    (w_states, w_mask, w_final), w_grads = run(net, False, fn)
    assert states.shape[1] == longest and w_states.shape[1] == 16
    torch.testing.assert_close(mask, w_mask[:, :longest])
    assert not w_mask[:, longest:].any()
    torch.testing.assert_close(states[mask], w_states[w_mask], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, w_final, atol=1e-10, rtol=1e-10)
    assert grads.keys() == w_grads.keys()
    for name, grad in w_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-10, rtol=1e-9, msg=name)


def test_decoder_prediction_and_gradients_equal_the_whole_context_with_fewer_keys():
    pipe = tiny_pipeline(decoder_kwargs=TINY_TEXT_ENCODER)
    decoder = pipe.decoder.train()
    ids = decoder.tokenize(CAPTIONS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, 16, 16, generator=g)
    embeds = torch.randn(3, pipe.clip.embed_dim, generator=g)
    t = torch.tensor([10, 500, 900])
    keys = []
    hook = decoder.unet.register_forward_pre_hook(
        lambda m, a, kw: keys.append(kw["encoder_hidden_states"].shape[1]), with_kwargs=True
    )

    def fn():
        out = decoder(x, t, embeds, ids)
        return out, out.square().mean()

    try:
        got, grads = run(decoder, True, fn)
        want, w_grads = run(decoder, False, fn)
    finally:
        hook.remove()
    n_image = decoder.config.num_image_tokens
    longest = int((ids != 0).sum(1).max())
    assert keys == [n_image + longest, n_image + ids.shape[1]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert grads.keys() == w_grads.keys()
    for name, grad in w_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_whole_context_where_lengths_must_not_depend_on_the_data():
    torch.manual_seed(0)
    net = CaptionTransformer(49408, 49407, 16, 32, 2, 2)
    ids = caption_tokenizer("open_clip_bpe", 16)(CAPTIONS)
    with torch.no_grad():
        assert net(ids)[0].shape[1] < 16
        traced = torch.jit.trace(net, ids, check_trace=False)
    assert traced(ids)[0].shape[1] == 16
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        assert net(torch.zeros(2, 16, dtype=torch.long)).__getitem__(0).shape[1] == 16
