"""What docs/full_scale.md's case for a half-precision frozen CLIP rests on: under bf16 autocast,
bf16 weights move the CLIP's embeddings from fp32's about as far as autocast alone does."""

import copy

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a red circle", "a big blue square on the left", "two green stars", ""]


def _encode(clip, images, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        text = clip.encode_text(CAPTIONS)
        return [
            clip.encode_image(images).float(),
            text.text_embed.float(),
            text.text_tokens.float(),
        ]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_bf16_weights_under_autocast_stay_near_autocast_alone(tiny_clip):
    torch.manual_seed(0)
    images = torch.rand(4, 3, tiny_clip.image_size, tiny_clip.image_size) * 2 - 1
    exact = _encode(tiny_clip, images, None)
    autocast = _encode(tiny_clip, images, torch.bfloat16)
    half = copy.deepcopy(tiny_clip)
    half.model.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16
    halved = _encode(half, images, torch.bfloat16)
    for fp32_weights, bf16_weights, want in zip(autocast, halved, exact):
        # autocast alone already rounds to bf16 (about 1 %); bf16 weights add at most half again
        assert _rel(fp32_weights, want) < 0.02
        assert _rel(bf16_weights, want) < 1.5 * max(_rel(fp32_weights, want), 1e-3)
