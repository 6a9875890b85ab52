"""Kandinsky 2.2: tiny random prior and decoder folders built offline from diffusers' own classes
(``KandinskyV22PriorPipeline(...).save_pretrained`` and its decoder, image-to-image and inpainting
pipelines), read by :mod:`unclip.interop.kandinsky` and sampled by unclip's samplers.

The reference is diffusers' pipelines on the same folders: same prompts, negative prompts, seeds
or latents, steps, guidance and size → image embeddings and images equal to <= 1e-4.
"""

# ruff: noqa: E402
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from diffusers import (
    KandinskyV22CombinedPipeline,
    KandinskyV22Img2ImgCombinedPipeline,
    KandinskyV22Img2ImgPipeline,
    KandinskyV22InpaintCombinedPipeline,
    KandinskyV22InpaintPipeline,
    KandinskyV22Pipeline,
    KandinskyV22PriorPipeline,
)
from diffusers.pipelines.kandinsky2_2.pipeline_kandinsky2_2_inpainting import (
    prepare_mask,
    prepare_mask_and_masked_image,
)
from kandinsky_tiny import D, L, build_decoder, build_prior  # noqa: E402
from PIL import Image

from unclip.interop.diffusers_import import load_diffusers_unclip
from unclip.interop.kandinsky import (
    card_prior,
    check_pair,
    kandinsky_kind,
    read_kandinsky_decoder,
    read_kandinsky_prior,
)
from unclip.pipeline.auto import load_pipeline, pipeline_family
from unclip.pipeline.kandinsky import KandinskyPipeline, KandinskySampling
from unclip.sampling.kandinsky import prior_text, sample_prior_embeds
from unclip.sampling.latent import (
    grow_repaint_mask,
    img2img_inputs,
    img2img_latents,
    inpaint_inputs,
    inpaint_latents,
    sample_latents,
)

SIZE = 32  # image side: 16 × 16 latents under a 2× MoVQ
STEPS = 3
PROMPTS = ["a red circle!", "two blue squares"]
NEGATIVES = ["blurry", "a green triangle"]
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prior_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("k22") / "prior"
    return root, build_prior(root)


@pytest.fixture(scope="module")
def decoder_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("k22") / "decoder"
    return root, build_decoder(root)


@pytest.fixture(scope="module")
def inpaint_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("k22") / "decoder-inpaint"
    # bounded latents: diffusers' inpainting ends on channels-last latents (the layout of its
    # one-channel mask), and MoVQ rounds differently on them; on latents of ~30 that alone moves
    # pixels by 2e-4, on latents in [-1, 1] by far less than the tolerance
    return root, build_decoder(root, KandinskyV22InpaintPipeline, in_channels=9, clip_sample=True)


@pytest.fixture(scope="module")
def prior(prior_folder):
    return read_kandinsky_prior(prior_folder[0])


@pytest.fixture(scope="module")
def decoder(decoder_folder):
    return read_kandinsky_decoder(decoder_folder[0])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _max_diff(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _np_images(decoder, latents) -> np.ndarray:
    """Images ``[B, H, W, 3]`` in [0, 1] as diffusers' ``output_type="np"`` gives them."""
    with torch.no_grad():
        images = decoder.decode(latents)
    return (images * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def _embeds(seed: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


# ------------------------------------------------------------------------------------ reading
def test_folders_are_told_apart_and_read(prior_folder, decoder_folder, inpaint_folder, tmp_path):
    assert kandinsky_kind(prior_folder[0]) == "prior"
    assert kandinsky_kind(decoder_folder[0]) == "decoder"
    assert kandinsky_kind(inpaint_folder[0]) == "decoder"
    assert kandinsky_kind(tmp_path) is None
    dec = read_kandinsky_decoder(inpaint_folder[0])["decoder"]
    assert dec.inpaint and dec.learned_variance and dec.scale_factor == 2
    assert dec.latent_size(SIZE, SIZE) == (16, 16)


def test_prior_text_matches_the_tokenizer_and_text_encoder(prior_folder, prior):
    """The prompt "!" holds the pad token: the mask still covers it, as the tokenizer's does."""
    dpipe = prior_folder[1]
    prompts = PROMPTS + ["!", ""]
    tok = dpipe.tokenizer(prompts, padding="max_length", max_length=L, return_tensors="pt")
    with torch.no_grad():
        ref = dpipe.text_encoder(tok.input_ids)
    enc = prior_text(prior["clip"], prompts)
    assert torch.equal(enc.text_mask, tok.attention_mask.bool())
    assert _max_diff(enc.text_embed, ref.text_embeds) <= TOL
    assert _max_diff(enc.text_tokens, ref.last_hidden_state) <= TOL


# -------------------------------------------------------------------------------------- prior
@pytest.mark.parametrize("negative", [None, NEGATIVES], ids=["zero-image", "negative-prompt"])
def test_prior_embeddings_match_diffusers(prior_folder, prior, negative):
    ref = prior_folder[1](
        PROMPTS,
        negative_prompt=negative,
        num_images_per_prompt=2,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        generator=_gen(1),
    )
    got = sample_prior_embeds(
        prior["prior"],
        prior["prior_scheduler"],
        prior["clip"],
        PROMPTS,
        negative,
        num_images_per_prompt=2,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        generator=_gen(1),
        progress=False,
    )
    assert got[0].shape == (4, D)
    assert _max_diff(got[0], ref.image_embeds) <= TOL
    assert _max_diff(got[1], ref.negative_image_embeds) <= TOL
    # the negative really is what its rule says: not the positive, and (without a negative
    # prompt) one embedding repeated
    assert _max_diff(got[0], got[1]) > 1e-2
    if negative is None:
        assert torch.equal(got[1], got[1][:1].expand_as(got[1]))


def test_prior_with_given_latents_and_no_guidance_matches_diffusers(prior_folder, prior):
    latents = torch.randn(2, D, generator=_gen(2))
    kwargs = dict(num_inference_steps=STEPS, guidance_scale=1.0, latents=latents)
    ref = prior_folder[1](PROMPTS, generator=_gen(3), **kwargs)
    got = sample_prior_embeds(
        prior["prior"],
        prior["prior_scheduler"],
        prior["clip"],
        PROMPTS,
        generator=_gen(3),
        progress=False,
        **kwargs,
    )
    assert _max_diff(got[0], ref.image_embeds) <= TOL


# ------------------------------------------------------------------------------------ decoder
# unguided, diffusers repeats the embeddings for several images per prompt only when guided
@pytest.mark.parametrize("guidance, per_prompt", [(4.0, 2), (1.0, 1)])
def test_decoder_images_match_diffusers(decoder_folder, decoder, guidance, per_prompt):
    embed, negative = _embeds(4)
    kwargs = dict(
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        num_images_per_prompt=per_prompt,
    )
    ref = decoder_folder[1](
        image_embeds=embed,
        negative_image_embeds=negative,
        generator=_gen(5),
        output_type="np",
        **kwargs,
    ).images
    latents = sample_latents(
        decoder["decoder"],
        decoder["scheduler"],
        embed,
        negative,
        generator=_gen(5),
        progress=False,
        **kwargs,
    )
    assert latents.shape == (2 * per_prompt, 4, 16, 16)
    assert _max_diff(_np_images(decoder["decoder"], latents), ref) <= TOL


def test_decoder_with_given_latents_matches_diffusers(decoder_folder, decoder):
    embed, negative = _embeds(6, rows=1)
    start = torch.randn(1, 4, 16, 16, generator=_gen(7))
    kwargs = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS, latents=start)
    ref = decoder_folder[1](
        image_embeds=embed,
        negative_image_embeds=negative,
        generator=_gen(8),
        output_type="np",
        **kwargs,
    ).images
    latents = sample_latents(
        decoder["decoder"],
        decoder["scheduler"],
        embed,
        negative,
        generator=_gen(8),
        progress=False,
        **kwargs,
    )
    assert _max_diff(_np_images(decoder["decoder"], latents), ref) <= TOL


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))


def test_img2img_matches_diffusers(decoder_folder, decoder):
    embed, negative = _embeds(9, rows=1)
    ref_pipe = KandinskyV22Img2ImgPipeline(**decoder_folder[1].components)
    ref_pipe.set_progress_bar_config(disable=True)
    picture = _picture(0)
    ref = ref_pipe(
        image_embeds=embed,
        negative_image_embeds=negative,
        image=picture,
        height=SIZE,
        width=SIZE,
        strength=0.5,
        num_inference_steps=4,
        num_images_per_prompt=2,
        generator=_gen(10),
        output_type="np",
    ).images
    dec = decoder["decoder"]
    images = img2img_inputs(picture, SIZE, SIZE, dec.scale_factor, dec.latent_channels)
    assert images.shape == (1, 3, SIZE, SIZE)
    latents = img2img_latents(
        dec,
        decoder["scheduler"],
        embed,
        negative,
        images,
        strength=0.5,
        num_inference_steps=4,
        num_images_per_prompt=2,
        generator=_gen(10),
        progress=False,
    )
    assert _max_diff(_np_images(dec, latents), ref) <= TOL


def _band_mask() -> Image.Image:
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[8:20, 4:28] = 255  # repaint a band
    return Image.fromarray(mask)


def test_inpaint_inputs_match_diffusers_preprocessing():
    picture, mask_image = _picture(1), _band_mask()
    keep, ref_images = prepare_mask_and_masked_image(picture, mask_image, SIZE, SIZE)
    images, repaint = inpaint_inputs(picture, mask_image, SIZE, SIZE)
    assert torch.equal(images, ref_images)
    assert torch.equal(repaint, 1 - keep)  # diffusers turns the mask into the kept region


def test_inpainting_matches_diffusers(inpaint_folder):
    root, ref_pipe = inpaint_folder
    parts = read_kandinsky_decoder(root)
    embed, negative = _embeds(11, rows=1)
    picture, mask_image = _picture(1), _band_mask()
    kwargs = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS, num_images_per_prompt=2)
    ref = ref_pipe(
        image_embeds=embed,
        negative_image_embeds=negative,
        image=picture,
        mask_image=mask_image,
        generator=_gen(12),
        output_type="np",
        **kwargs,
    ).images
    images, repaint = inpaint_inputs(picture, mask_image, SIZE, SIZE)
    latents = inpaint_latents(
        parts["decoder"],
        parts["scheduler"],
        embed,
        negative,
        images,
        repaint,
        generator=_gen(12),
        progress=False,
        **kwargs,
    )
    out = _np_images(parts["decoder"], latents)
    assert _max_diff(out, ref) <= TOL
    # the kept region survives in latent space (MoVQ's attention mixes it in pixel space): the
    # band is latent rows 4-9, grown by one; below it the latents are the image's own
    with torch.no_grad():
        kept = parts["decoder"].encode(images).repeat_interleave(2, dim=0)
    assert _max_diff(latents[:, :, 11:], kept[:, :, 11:]) <= TOL
    assert _max_diff(latents[:, :, 5:9, 4:12], kept[:, :, 5:9, 4:12]) > 1e-2


def test_repaint_mask_grows_as_diffusers_prepare_mask():
    gen = _gen(13)
    keep = (torch.rand(3, 1, 9, 11, generator=gen) > 0.2).float()
    assert torch.equal(grow_repaint_mask(keep), prepare_mask(keep.clone()))


# ------------------------------------------------------------------------------------- errors
def test_foreign_and_broken_folders_are_refused_in_one_line(prior_folder, decoder_folder, tmp_path):
    with pytest.raises(ValueError, match="not a Kandinsky 2.2 decoder folder.*KandinskyV22Prior"):
        read_kandinsky_decoder(prior_folder[0])
    with pytest.raises(ValueError, match="not a Kandinsky 2.2 prior folder"):
        read_kandinsky_prior(decoder_folder[0])
    broken = Path(shutil.copytree(decoder_folder[0], tmp_path / "decoder"))
    shutil.rmtree(broken / "movq")
    with pytest.raises(ValueError, match="movq: component folder .* is missing"):
        read_kandinsky_decoder(broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["movq"] = ["diffusers", "AutoencoderKL"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="movq: .*'AutoencoderKL'; expected VQModel"):
        read_kandinsky_decoder(broken)
    text_unet = Path(shutil.copytree(decoder_folder[0], tmp_path / "text-unet"))
    cfg = json.loads((text_unet / "unet" / "config.json").read_text())
    cfg["addition_embed_type"] = None
    (text_unet / "unet" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unet: config addition_embed_type = None"):
        read_kandinsky_decoder(text_unet)


def test_pickle_only_weights_are_refused(decoder_folder, tmp_path):
    folder = Path(shutil.copytree(decoder_folder[0], tmp_path / "decoder"))
    weights = folder / "movq" / "diffusion_pytorch_model.safetensors"
    weights.rename(folder / "movq" / "diffusion_pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        read_kandinsky_decoder(folder)


def test_sampler_misuse_is_a_clear_error(decoder, inpaint_folder, prior):
    embed, negative = _embeds(14, rows=1)
    dec, sched = decoder["decoder"], decoder["scheduler"]
    with pytest.raises(ValueError, match="needs an inpainting decoder"):
        inpaint_latents(
            dec,
            sched,
            embed,
            negative,
            torch.zeros(1, 3, SIZE, SIZE),
            torch.zeros(1, 1, SIZE, SIZE),
        )
    inpaint = read_kandinsky_decoder(inpaint_folder[0])
    with pytest.raises(ValueError, match="inpainting decoder: sample it with inpaint_latents"):
        sample_latents(inpaint["decoder"], inpaint["scheduler"], embed, negative)
    with pytest.raises(ValueError, match=r"image_embeds must be \[B, 32\]"):
        sample_latents(dec, sched, embed[:, :8], negative[:, :8])
    with pytest.raises(ValueError, match="strength 0.1 of 4 steps runs no step"):
        img2img_latents(
            dec,
            sched,
            embed,
            negative,
            torch.zeros(1, 3, SIZE, SIZE),
            strength=0.1,
            num_inference_steps=4,
        )
    with pytest.raises(ValueError, match="1 negative prompts for 2 prompts"):
        sample_prior_embeds(
            prior["prior"], prior["prior_scheduler"], prior["clip"], PROMPTS, ["blurry"]
        )
    with pytest.raises(ValueError, match="mask tensors must be in"):
        inpaint_inputs(torch.zeros(3, SIZE, SIZE), torch.full((SIZE, SIZE), 2.0), SIZE, SIZE)
    with pytest.raises(ValueError, match="reads 16"):
        clip = prior["clip"]
        check_pair(clip, _Wide(16))


class _Wide:
    def __init__(self, dim):
        self.embed_dim = dim


def test_card_prior_reads_the_model_card(decoder_folder, tmp_path):
    folder = Path(shutil.copytree(decoder_folder[0], tmp_path / "decoder"))
    assert card_prior(folder) is None or isinstance(card_prior(folder), str)
    (folder / "README.md").write_text(
        "---\nprior:\n- kandinsky-community/kandinsky-2-2-prior\n---\n# decoder\n"
    )
    assert card_prior(folder) == "kandinsky-community/kandinsky-2-2-prior"


# ----------------------------------------------------------------------------------- pipeline
@pytest.fixture(scope="module")
def pipe(prior_folder, decoder_folder):
    return KandinskyPipeline.from_pretrained(decoder_folder[0], prior=prior_folder[0])


def test_pipeline_matches_diffusers_combined_pipeline(prior_folder, decoder_folder, pipe):
    """One call, one generator, diffusers' keywords: the images of KandinskyV22CombinedPipeline
    (AutoPipelineForText2Image's class for these folders)."""
    p, d = prior_folder[1], decoder_folder[1]
    combined = KandinskyV22CombinedPipeline(
        unet=d.unet,
        scheduler=d.scheduler,
        movq=d.movq,
        prior_prior=p.prior,
        prior_image_encoder=p.image_encoder,
        prior_text_encoder=p.text_encoder,
        prior_tokenizer=p.tokenizer,
        prior_scheduler=p.scheduler,
        prior_image_processor=p.image_processor,
    )
    combined.set_progress_bar_config(disable=True)
    kwargs = dict(
        negative_prompt=NEGATIVES,
        num_inference_steps=STEPS,
        prior_num_inference_steps=STEPS,
        guidance_scale=3.0,
        prior_guidance_scale=5.0,
        num_images_per_prompt=2,
        height=SIZE,
        width=SIZE,
        output_type="np",
    )
    ref = combined(PROMPTS, generator=_gen(15), **kwargs).images
    out = pipe(PROMPTS, generator=_gen(15), progress=False, **kwargs)
    assert out.images.shape == (4, SIZE, SIZE, 3)
    assert _max_diff(out.images, ref) <= TOL
    assert out.image_embeds.shape == (4, D)


def test_load_pipeline_finds_the_prior_in_the_model_card(
    prior_folder, decoder_folder, pipe, tmp_path
):
    folder = Path(shutil.copytree(decoder_folder[0], tmp_path / "decoder"))
    (folder / "README.md").write_text(f"---\nprior:\n- {prior_folder[0]}\n---\n")
    assert pipeline_family(folder) == "kandinsky"
    loaded = load_pipeline(folder)
    assert isinstance(loaded, KandinskyPipeline) and loaded.stage_names == ["prior", "decoder"]
    assert loaded.sampling_settings()["decoder"] == KandinskySampling(100, 4.0)  # diffusers'
    kwargs = dict(
        num_inference_steps=2,
        prior_num_inference_steps=2,
        height=SIZE,
        width=SIZE,
        output_type="pt",
        progress=False,
    )
    a = loaded("a cat", generator=_gen(16), **kwargs).images
    b = pipe("a cat", generator=_gen(16), **kwargs).images
    assert torch.equal(a, b)
    # the components rebuild it, as diffusers' pipelines do
    again = KandinskyPipeline(**loaded.components)
    assert torch.equal(again("a cat", generator=_gen(16), **kwargs).images, b)


def test_pipeline_refusals_name_what_to_do(prior_folder, decoder_folder, pipe):
    with pytest.raises(ValueError, match="is a Kandinsky 2.2 folder .* KandinskyPipeline"):
        load_diffusers_unclip(decoder_folder[0])
    with pytest.raises(ValueError, match="is a Kandinsky 2.2 prior folder; load the decoder"):
        load_pipeline(prior_folder[0])
    with pytest.raises(ValueError, match="decoder folder, not a prior one"):
        KandinskyPipeline.from_pretrained(decoder_folder[0], prior=decoder_folder[0])
    alone = KandinskyPipeline.from_pretrained(decoder_folder[0], prior=False)
    assert alone.stage_names == ["decoder"]
    with pytest.raises(ValueError, match="has no prior: load it with prior="):
        alone("a cat")
    with pytest.raises(ValueError, match="unknown setting 'rerank_at'"):
        pipe("a cat", sampling={"decoder": {"rerank_at": 2}})
    with pytest.raises(ValueError, match=r"sampling\['prior'\]: steps must be"):
        pipe("a cat", prior_num_inference_steps=0)
    with pytest.raises(ValueError, match="memory_format: not supported for a Kandinsky"):
        load_pipeline(decoder_folder[0], memory_format=torch.channels_last)


def _combined(cls, prior_pipe, decoder_pipe):
    """diffusers' combined pipeline ``cls`` over a prior and a decoder pipeline's components."""
    p, d = prior_pipe, decoder_pipe
    combined = cls(
        unet=d.unet,
        scheduler=d.scheduler,
        movq=d.movq,
        prior_prior=p.prior,
        prior_image_encoder=p.image_encoder,
        prior_text_encoder=p.text_encoder,
        prior_tokenizer=p.tokenizer,
        prior_scheduler=p.scheduler,
        prior_image_processor=p.image_processor,
    )
    combined.set_progress_bar_config(disable=True)
    return combined


def test_img2img_and_inpaint_methods_match_diffusers_combined_pipelines(
    prior_folder, decoder_folder, inpaint_folder, pipe
):
    """pipe.img2img and pipe.inpaint: one call with a prompt, one generator, diffusers' keywords,
    the images of KandinskyV22Img2ImgCombinedPipeline / KandinskyV22InpaintCombinedPipeline (what
    AutoPipelineForImage2Image / ForInpainting build); given embeddings, those of the decoder
    pipelines alone; an inpainting call on the text-to-image decoder says what to load."""
    picture, mask_image = _picture(0), _band_mask()
    common = dict(
        negative_prompt="blurry",
        num_inference_steps=4,
        prior_num_inference_steps=STEPS,
        guidance_scale=3.0,
        prior_guidance_scale=5.0,
        num_images_per_prompt=2,
        height=SIZE,
        width=SIZE,
        output_type="np",
    )
    combined = _combined(KandinskyV22Img2ImgCombinedPipeline, prior_folder[1], decoder_folder[1])
    ref = combined("a cat", image=picture, strength=0.5, generator=_gen(20), **common).images
    out = pipe.img2img(picture, "a cat", strength=0.5, generator=_gen(20), progress=False, **common)
    assert out.images.shape == (2, SIZE, SIZE, 3) and _max_diff(out.images, ref) <= TOL

    embed, negative = _embeds(9, rows=1)
    alone = KandinskyV22Img2ImgPipeline(**decoder_folder[1].components)
    alone.set_progress_bar_config(disable=True)
    kw = dict(height=SIZE, width=SIZE, strength=0.5, num_inference_steps=4, output_type="np")
    ref = alone(
        image_embeds=embed, negative_image_embeds=negative, image=picture,
        num_images_per_prompt=2, generator=_gen(10), **kw,
    ).images  # fmt: skip
    (images,) = pipe.img2img(
        picture, image_embeds=embed, negative_image_embeds=negative, num_images_per_prompt=2,
        generator=_gen(10), return_dict=False, progress=False, **kw,
    )  # fmt: skip
    assert _max_diff(images, ref) <= TOL
    with pytest.raises(ValueError, match="inpainting needs an inpainting decoder"):
        pipe.inpaint(picture, mask_image, "a cat")

    inpainter = KandinskyPipeline.from_pretrained(inpaint_folder[0], prior=prior_folder[0])
    combined = _combined(KandinskyV22InpaintCombinedPipeline, prior_folder[1], inpaint_folder[1])
    ref = combined("a cat", image=picture, mask_image=mask_image, generator=_gen(21), **common)
    out = inpainter.inpaint(
        picture, mask_image, "a cat", generator=_gen(21), progress=False, **common
    )
    assert _max_diff(out.images, ref.images) <= TOL
    with pytest.raises(ValueError, match="inpainting decoder .* use inpaint"):
        inpainter.img2img(picture, "a cat")


def test_variations_and_mix_decode_image_tower_embeddings(pipe):
    """Variations decode the image tower's embedding of the image (guided away from no image's);
    a mix of one image at weight 1 is its variation; prompts mix in through the prior; the
    attention-memory options give the same images."""
    from unclip.sampling.kandinsky import zero_image_embed

    picture = _picture(3)
    kw = dict(height=SIZE, width=SIZE, output_type="pt", progress=False)
    few = {"decoder": {"steps": 2}, "prior": {"steps": 2}}
    out = pipe.variations(picture, 2, generator=_gen(30), sampling=few, **kw)
    embed = pipe.clip.encode_image(picture)
    assert torch.equal(out.image_embeds, embed.repeat(2, 1))
    direct = pipe.decode(
        embed.repeat(2, 1), zero_image_embed(pipe.clip, 2), generator=_gen(30), sampling=few,
        height=SIZE, width=SIZE, output_type="pt", progress=False,
    )  # fmt: skip
    assert torch.equal(out.images, direct)
    mixed = pipe.mix([picture, "a cat"], [1.0, 0.0], 2, generator=_gen(30), sampling=few, **kw)
    assert mixed.image_embeds.shape == (2, D)
    halves = pipe.mix([picture, "a cat"], [0.5, 0.5], 2, generator=_gen(30), sampling=few, **kw)
    cat, _ = pipe.sample_image_embeds("a cat", generator=_gen(30), sampling=few, progress=False)
    torch.testing.assert_close(halves.image_embeds[:1], 0.5 * embed + 0.5 * cat)
    with pytest.raises(ValueError, match="2 images/prompts and 1 weights"):
        pipe.mix([picture, "a cat"], [1.0])
    pipe.enable_attention_slicing("max")
    try:
        sliced = pipe.variations(picture, 2, generator=_gen(30), sampling=few, **kw)
    finally:
        pipe.disable_attention_slicing()
    assert _max_diff(sliced.images, out.images) <= TOL  # float rounding of the sliced sums
    # disabling puts each layer's own processor back: the images of a pipeline never sliced
    unsliced = pipe.variations(picture, 2, generator=_gen(30), sampling=few, **kw)
    assert torch.equal(unsliced.images, out.images)


def test_hub_ids_load_and_generate_writes_a_kandinsky_folder(
    prior_folder, decoder_folder, pipe, hub_cache, tmp_path
):
    """load_pipeline takes a Kandinsky decoder's Hub id and finds the prior its model card names
    (another Hub id), as AutoPipelineForText2Image does, from the offline cache; `unclip
    generate --model` samples it into a folder with its record."""
    from unclip.pipeline.jobs import generate_to_folder

    decoder = Path(shutil.copytree(decoder_folder[0], tmp_path / "decoder"))
    (decoder / "README.md").write_text("---\nprior:\n- org/k22-prior\n---\n")
    hub_cache("org/k22-decoder", decoder)
    hub_cache("org/k22-prior", prior_folder[0])
    loaded = load_pipeline("org/k22-decoder")
    assert isinstance(loaded, KandinskyPipeline) and loaded.stage_names == ["prior", "decoder"]
    kwargs = dict(num_inference_steps=2, prior_num_inference_steps=2, height=SIZE, width=SIZE)
    kwargs.update(output_type="pt", progress=False)
    a = loaded("a cat", generator=_gen(16), **kwargs).images
    assert torch.equal(a, pipe("a cat", generator=_gen(16), **kwargs).images)

    loaded.resolution = SIZE  # a call's default size (diffusers' 512 without it)
    record = generate_to_folder(
        loaded,
        ["a cat", "a dog"],
        tmp_path / "out",
        num_images_per_prompt=2,
        sampling={"prior": {"steps": 2}, "decoder": {"steps": 2}},
        progress=False,
    )
    assert [f["file"] for f in record["files"]] == ["000_00.png", "000_01.png", "001_00.png",
                                                     "001_01.png"]  # fmt: skip
    assert record["resolution"] == SIZE and (tmp_path / "out" / "grid.png").is_file()
    with Image.open(tmp_path / "out" / "000_00.png") as image:
        assert image.size == (SIZE, SIZE)


def test_save_pretrained_writes_diffusers_layouts_that_both_libraries_load(
    prior_folder, decoder_folder, inpaint_folder, pipe, tmp_path
):
    """save_pretrained (and `unclip convert`) write the decoder's diffusers layout with the prior's
    in prior/: KandinskyPipeline loads the folder whole, diffusers loads each part, and both draw
    the images of the pipeline that was saved; an inpainting decoder saves as one."""
    from unclip.cli.convert import main as convert

    kwargs = dict(num_inference_steps=2, prior_num_inference_steps=2, height=SIZE, width=SIZE)
    before = pipe("a cat", generator=_gen(40), output_type="np", progress=False, **kwargs).images
    pipe.save_pretrained(tmp_path / "k22")
    again = KandinskyPipeline.from_pretrained(tmp_path / "k22")
    assert again.stage_names == ["prior", "decoder"]
    after = again("a cat", generator=_gen(40), output_type="np", progress=False, **kwargs).images
    assert np.array_equal(after, before)
    # diffusers draws from the saved folders what it draws from the ones they came from (the
    # tiny random decoder amplifies the prior's float rounding past TOL at default guidance, so
    # the comparison with unclip's own images is the combined-pipeline test's)
    prior = KandinskyV22PriorPipeline.from_pretrained(tmp_path / "k22" / "prior")
    decoder = KandinskyV22Pipeline.from_pretrained(tmp_path / "k22")
    ref = _combined(KandinskyV22CombinedPipeline, prior, decoder)
    ref = ref("a cat", generator=_gen(40), output_type="np", **kwargs).images
    source = _combined(KandinskyV22CombinedPipeline, prior_folder[1], decoder_folder[1])
    assert np.array_equal(
        ref, source("a cat", generator=_gen(40), output_type="np", **kwargs).images
    )

    decoder_copy = Path(shutil.copytree(decoder_folder[0], tmp_path / "src"))
    (decoder_copy / "README.md").write_text(f"---\nprior:\n- {prior_folder[0]}\n---\n")
    assert convert([str(decoder_copy), str(tmp_path / "converted")]) == 0
    converted = KandinskyPipeline.from_pretrained(tmp_path / "converted")
    images = converted("a cat", generator=_gen(40), output_type="np", progress=False, **kwargs)
    assert np.array_equal(images.images, before)
    with pytest.raises(ValueError, match="prior folder; convert the decoder folder"):
        convert([str(prior_folder[0]), str(tmp_path / "nope")])

    with pytest.raises(ValueError, match="without a model card; leave model_card out"):
        pipe.save_pretrained(tmp_path / "carded", model_card={"license": "mit"})
    inpainter = KandinskyPipeline.from_pretrained(inpaint_folder[0], prior=False)
    inpainter.save_pretrained(tmp_path / "inpaint")
    assert (
        KandinskyV22InpaintPipeline.from_pretrained(tmp_path / "inpaint").unet.config.in_channels
        == 9
    )
    assert not (tmp_path / "inpaint" / "prior").exists()


def test_any_diffusers_scheduler_per_stage(decoder_folder, pipe):
    """sampling={"decoder": {"scheduler": name}} samples with that diffusers scheduler built from
    the folder's config, as a diffusers user swaps one in; the prior takes one too; an unknown
    name is refused naming the choices."""
    from diffusers import DDIMScheduler

    embed, negative = _embeds(5, rows=1)
    ref_pipe = KandinskyV22Pipeline(**decoder_folder[1].components)
    ref_pipe.scheduler = DDIMScheduler.from_config(ref_pipe.scheduler.config)
    ref_pipe.set_progress_bar_config(disable=True)
    kw = dict(height=SIZE, width=SIZE, num_inference_steps=4, output_type="np")
    ref = ref_pipe(image_embeds=embed, negative_image_embeds=negative, generator=_gen(6), **kw)
    ours = pipe.decode(
        embed, negative, height=SIZE, width=SIZE, generator=_gen(6), output_type="np",
        sampling={"decoder": {"steps": 4, "scheduler": "ddim"}}, progress=False,
    )  # fmt: skip
    assert _max_diff(ours, ref.images) <= TOL
    default = pipe.decode(
        embed, negative, height=SIZE, width=SIZE, generator=_gen(6), output_type="np",
        sampling={"decoder": {"steps": 4}}, progress=False,
    )  # fmt: skip
    assert _max_diff(default, ours) > 1e-3  # the folder's DDPM draws noise every step; DDIM not
    assert type(pipe.scheduler).__name__ == "DDPMScheduler"  # the pipeline's own is untouched
    both = {"prior": {"steps": 2, "scheduler": "euler"}, "decoder": {"steps": 2}}
    kw = dict(height=SIZE, width=SIZE, output_type="pt", progress=False)
    out = pipe("a cat", sampling=both, generator=_gen(7), **kw)
    assert torch.isfinite(out.images).all()
    with pytest.raises(ValueError, match="unknown sampler 'ddimm'; did you mean 'ddim'"):
        pipe("a cat", sampling={"decoder": {"scheduler": "ddimm"}})


def test_generator_lists_and_settings_objects_in_every_call(pipe, decoder_folder):
    """One generator per prompt, with a negative prompt (the prior samples the negatives beside
    the prompts) and in the edits; a stage's settings given as a KandinskySampling; the push
    writer's folder (its card names only the repo)."""
    kw = dict(height=SIZE, width=SIZE, output_type="pt", progress=False)
    few = {"prior": KandinskySampling(2, 4.0), "decoder": {"steps": 2}}
    out = pipe(["a cat", "a dog"], negative_prompt=["blurry", "dark"], num_images_per_prompt=2,
               generator=[_gen(1), _gen(2)], sampling=few, **kw)  # fmt: skip
    alone = pipe("a dog", negative_prompt="dark", num_images_per_prompt=2, generator=[_gen(2)],
                 sampling=few, **kw)  # fmt: skip
    assert out.images.shape[0] == 4
    # a prompt's rows draw from its own generator (compared at the prior's output: the tiny
    # decoder amplifies batch-size rounding, see the save test)
    torch.testing.assert_close(out.image_embeds[2:], alone.image_embeds, atol=1e-5, rtol=1e-5)
    picture = _picture(4)
    gens = [_gen(1), _gen(2)]
    edited = pipe.img2img([picture, picture], ["a cat", "a dog"], num_images_per_prompt=2,
                          generator=gens, sampling=few, strength=0.5, **kw)  # fmt: skip
    assert edited.images.shape[0] == 4
    with tempfile.TemporaryDirectory() as tmp:
        pipe._push_writer("me/k22")(Path(tmp))
        assert (Path(tmp) / "prior" / "model_index.json").is_file()


def test_best_of_reranks_prior_and_decoder_candidates_by_clip(pipe):
    """``best_of`` k: each image's k candidates are the draws of k images per prompt from its
    generator, and the kept one is the candidate closest in CLIP cosine to the prompt's text
    embedding: prior embeddings directly, decoder images through the image tower."""
    k, steps = 3, {"prior": {"steps": 2}, "decoder": {"steps": 2}}
    prompts = ["a red circle", "two blue squares"]
    text = prior_text(pipe.clip, prompts).text_embed

    def gens():
        return [_gen(7), _gen(8)]

    # prior: the candidates are three images per prompt, each prompt's from its generator
    cands, _ = pipe.sample_image_embeds(
        prompts,
        num_images_per_prompt=k,
        generator=[g for g in gens() for _ in range(k)],
        sampling=steps,
        progress=False,
    )
    cos = torch.nn.functional.cosine_similarity(cands, text.repeat_interleave(k, 0), dim=-1)
    want = cands.view(2, k, D)[torch.arange(2), cos.view(2, k).argmax(1)]
    got, negative = pipe.sample_image_embeds(
        prompts,
        generator=gens(),
        sampling={**steps, "prior": {"steps": 2, "best_of": k}},
        progress=False,
    )
    assert torch.equal(got, want) and negative.shape == got.shape
    assert not torch.equal(got, cands.view(2, k, D)[:, 0])  # a choice was made somewhere
    # decoder: three images per embedding, scored by the image tower
    settings = {"prior": {"steps": 2}, "decoder": {"steps": 2, "best_of": k}}
    out = pipe(prompts, height=SIZE, width=SIZE, generator=gens(), sampling=settings,
               output_type="latent", progress=False)  # fmt: skip
    g = gens()
    embeds, negatives = pipe.sample_image_embeds(prompts, generator=g, sampling=steps,
                                                  progress=False)  # fmt: skip
    lat = pipe.decode(embeds.repeat_interleave(k, 0), negatives.repeat_interleave(k, 0), SIZE,
                      SIZE, generator=[x for x in g for _ in range(k)], sampling=steps,
                      progress=False)  # fmt: skip
    with torch.no_grad():
        imgs = pipe.decoder.decode(lat).float().clamp(-1, 1)
        score = torch.nn.functional.cosine_similarity(
            pipe.clip.encode_image(imgs), text.repeat_interleave(k, 0), dim=-1
        )
    best = score.view(2, k).argmax(1)
    assert torch.equal(out.images, lat.view(2, k, *lat.shape[1:])[torch.arange(2), best])
    with pytest.raises(ValueError, match="best_of must be an integer in 1"):
        pipe.sampling_settings({"decoder": {"best_of": 0}})
    with pytest.raises(ValueError, match="latents= or best_of"):
        pipe(prompts[0], sampling=settings, latents=lat[:1], height=SIZE, width=SIZE)


def test_inversion_text_diff_and_interpolation_on_the_latent_decoder(pipe):
    """DDIM inversion of MoVQ latents decodes back to what MoVQ makes of the image (a random UNet
    at 20 steps needs the fixed-point refinement: 30 iterations), and the inverted latents decode
    the same through diffusers' own DDIM step; a text diff's θ = 0 frame is that reconstruction
    and later frames move; an interpolation's first frame is its start's embedding decoded with
    the frames' one seed, its last the prompt's prior embedding."""
    from diffusers import DDIMScheduler

    image = _picture(3).resize((SIZE, SIZE))
    inv = pipe.invert(image, steps=20, size=SIZE, progress=False, fixed_point=30)
    assert inv.latents.shape == (1, 4, 16, 16) and inv.error is not None
    # the round trip against the image as MoVQ itself reconstructs it (the floor of any inversion)
    with torch.no_grad():
        direct = pipe.decoder.decode(pipe.decoder.encode(inv.image)).float().clamp(-1, 1)
    assert float((inv.reconstruction - direct).abs().max()) < 0.02
    # the decode is diffusers' own DDIM (DDIMScheduler.step, eta 0) from the same latents
    from unclip.pipeline.kandinsky_edits import _decoder_ddim

    sched = DDIMScheduler.from_config(pipe.scheduler.config)
    sched.set_timesteps(20)
    x = torch.randn(1, 4, 16, 16, generator=_gen(9))
    ours = _decoder_ddim(pipe, inv.image_embeds, 20, 1.0, x, False, False, "decode")
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(pipe.decoder(x, t, inv.image_embeds)[:, :4], t, x, eta=0.0).prev_sample
    # float32 steps (diffusers) against float64 coefficients (here)
    assert float((ours - x).abs().max()) < 1e-5 * float(x.abs().max())

    out = pipe.text_diff(image, "a red circle", "a blue square", num_steps=3, steps=20,
                         size=SIZE, output_type="pt", progress=False, fixed_point=30)  # fmt: skip
    frames = out.images * 2 - 1
    assert out.info["theta"] == [0.0, 0.25, 0.5]
    # θ = 0 is the image's own embedding (to the rounding of normalising and rescaling it), which
    # this chaotic random decoder turns into the reconstruction within 1e-2
    assert float((out.image_embeds[0] - inv.image_embeds[0]).abs().max()) < 1e-6
    assert float((frames[0] - inv.reconstruction[0]).abs().max()) < 1e-2
    assert float((frames[2] - frames[0]).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="encode identically"):
        pipe.text_diff(image, "a cat", "a cat", steps=2, size=SIZE, progress=False)
    with pytest.raises(ValueError, match="multiple of 4"):
        pipe.invert(image, steps=2, size=30, progress=False)

    settings = {"prior": {"steps": 2}, "decoder": {"steps": 2}}
    frames = pipe.interpolate(image, "a red circle", num_steps=3, generator=_gen(4), height=SIZE,
                              width=SIZE, sampling=settings, output_type="latent",
                              progress=False)  # fmt: skip
    # the frames' one seed is drawn after the prior's draws for the prompt end
    from unclip.pipeline.edit_ops import _same_seed
    from unclip.sampling.kandinsky import zero_image_embed

    g = _gen(4)
    end, _ = pipe.sample_image_embeds("a red circle", generator=g, sampling=settings,
                                      progress=False)  # fmt: skip
    assert torch.allclose(frames.image_embeds[2], end[0], atol=1e-6)
    assert torch.allclose(frames.image_embeds[0], pipe.clip.encode_image(image)[0], atol=1e-6)
    first = pipe.decode(frames.image_embeds[:1], zero_image_embed(pipe.clip, 1), SIZE, SIZE,
                        generator=_same_seed(g, 1), sampling=settings, progress=False)  # fmt: skip
    assert float((frames.images[0] - first[0]).abs().max()) < 1e-4  # batch of 3 against 1
    assert not torch.equal(frames.images[0], frames.images[2])


def test_offload_hooks_and_step_callbacks_change_no_image(pipe):
    """With the model offloader's hooks on every component (execution device the CPU, so nothing
    is copied) a call draws the same images, bringing in the CLIP, then the prior, then the
    decoder; ``callback_on_step_end`` sees every step of both stages, in order."""
    from unclip.utils.offload import ModelOffloader

    kw = dict(height=SIZE, width=SIZE, output_type="pt", progress=False)
    sampling = {"prior": {"steps": 2}, "decoder": {"steps": 3}}
    ref = pipe("a red circle", generator=_gen(3), sampling=sampling, **kw).images
    seen = []

    def callback(p, step, timestep, kwargs):
        seen.append((kwargs["stage"], step))
        return {}

    off = ModelOffloader(pipe.modules(), torch.device("cpu"))
    order = []
    activate = off.activate
    off.activate = lambda name: (order.append(name) if name != off.active else None, activate(name))
    try:
        out = pipe("a red circle", generator=_gen(3), sampling=sampling,
                   callback_on_step_end=callback, **kw).images  # fmt: skip
    finally:
        off.remove()
    assert torch.equal(out, ref)
    assert order[:3] == ["clip", "prior", "decoder"]
    assert seen == [("prior", 0), ("prior", 1), ("decoder", 0), ("decoder", 1), ("decoder", 2)]
