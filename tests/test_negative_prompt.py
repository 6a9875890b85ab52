"""Negative prompts: a caption that takes the empty caption's place in the unconditional branch of
classifier-free guidance, in the prior and the decoder."""

import json

import pytest
import torch
from conftest import gens

from unclip.cli import generate

GUIDED = {
    "prior": {"steps": 3, "guidance_scale": 3.0, "best_of": 1},
    "decoder": {"steps": 3, "guidance_scale": 3.0},
}

pytestmark = pytest.mark.usefixtures("one_thread")


def run(pipe, negative=None, sampling=GUIDED, prompts=("a red circle", "a blue square")):
    return pipe(
        list(prompts),
        generator=gens(1, 2),
        sampling=sampling,
        output_type="pt",
        progress=False,
        last_stage="decoder",
        negative_prompt=negative,
    )


def test_negative_prompt_replaces_the_empty_caption_in_guidance(tiny_pipe):
    plain = run(tiny_pipe)
    # the empty caption as negative prompt is exactly the usual unconditional branch
    empty = run(tiny_pipe, negative="")
    assert torch.equal(plain.images, empty.images)
    assert torch.equal(plain.image_embeds, empty.image_embeds)
    steered = run(tiny_pipe, negative="a green triangle")
    assert not torch.allclose(plain.image_embeds, steered.image_embeds)  # the prior
    assert not torch.allclose(plain.images, steered.images)
    # one per prompt: the first prompt's negative only changes the first prompt's images
    mixed = run(tiny_pipe, negative=["a green triangle", ""])
    assert torch.equal(mixed.images[1], plain.images[1])
    assert torch.equal(mixed.images[0], steered.images[0])


def test_negative_prompt_in_the_decoder_alone(tiny_pipe):
    embeds = torch.nn.functional.normalize(torch.randn(2, tiny_pipe.clip.embed_dim), dim=-1)
    kw = dict(sampling=GUIDED, progress=False)
    plain = tiny_pipe.decode(embeds, ["a red circle"] * 2, gens(3, 4), **kw)
    empty = tiny_pipe.decode(embeds, ["a red circle"] * 2, gens(3, 4), negative_prompt="", **kw)
    steered = tiny_pipe.decode(embeds, ["a red circle"] * 2, gens(3, 4), negative_prompt="x", **kw)
    assert torch.equal(plain, empty) and not torch.allclose(plain, steered)


def test_negative_prompt_does_nothing_without_guidance(tiny_pipe):
    unguided = {
        "prior": {"steps": 3, "guidance_scale": 1.0, "best_of": 1},
        "decoder": {"steps": 3, "guidance_scale": 1.0},
    }
    assert torch.equal(
        run(tiny_pipe, sampling=unguided).images,
        run(tiny_pipe, "a green triangle", sampling=unguided).images,
    )


def test_negative_prompt_errors(tiny_pipe):
    with pytest.raises(ValueError, match="negative_prompt: 3 for 2 prompts"):
        run(tiny_pipe, negative=["a", "b", "c"])
    with pytest.raises(TypeError, match="negative_prompt"):
        run(tiny_pipe, negative=5)


def test_cli_negative_is_recorded(tmp_path):
    out = tmp_path / "out"
    argv = ["a red circle", "--tiny", "--out", str(out), "--no-progress", "--decoder-steps", "2"]
    assert generate.main([*argv, "--prior-steps", "2", "--negative", "a blue square"]) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["negative_prompt"] == "a blue square"
    assert "--negative" in record["command"]


def test_negative_prompt_with_a_decoder_that_has_its_own_caption_encoder(tiny_pipe):
    from unclip import UnCLIPPipeline
    from unclip.nets.decoder import UnCLIPDecoder
    from unclip.pipeline.tiny import TINY_TEXT_ENCODER, tiny_decoder_kwargs

    torch.manual_seed(0)
    decoder = UnCLIPDecoder(
        embed_dim=tiny_pipe.clip.embed_dim,
        text_width=tiny_pipe.clip.text_width,
        **TINY_TEXT_ENCODER,
        **tiny_decoder_kwargs(),
    )
    pipe = UnCLIPPipeline(tiny_pipe.clip, tiny_pipe.prior, decoder)
    embeds = torch.nn.functional.normalize(torch.randn(2, tiny_pipe.clip.embed_dim), dim=-1)
    plain, empty, steered = (
        pipe.decode(embeds, ["a red circle"] * 2, gens(3, 4), GUIDED, negative_prompt=n)
        for n in (None, "", "a green triangle")
    )
    assert torch.equal(plain, empty) and not torch.allclose(plain, steered)
    with pytest.raises(ValueError, match="negative_prompt: 3 for 2 images"):
        pipe.decode(embeds, ["a red circle"] * 2, negative_prompt=["a", "b", "c"])
