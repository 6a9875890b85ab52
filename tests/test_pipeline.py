import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import EXACT, gens
from PIL import Image

import unclip.diffusion.loop as diffusion
from unclip import UnCLIPPipeline, slerp
from unclip.pipeline.tiny import tiny_pipeline

PROMPTS = [
    "a small red circle on the left",
    "a big blue square in the center on a black background",
]


def run(pipe, prompts=PROMPTS, seeds=(0, 1), **kw):
    kw.setdefault("output_type", "pt")
    return pipe(prompts, generator=gens(*seeds), progress=False, **kw)


def test_output_sizes_at_every_stage(tiny_pipe):
    out = run(tiny_pipe, num_images_per_prompt=2, return_intermediates=True)
    assert out.images.shape == (4, 3, 64, 64)
    assert {k: tuple(v.shape) for k, v in out.stage_images.items()} == {
        "decoder": (4, 3, 16, 16),
        "sr32": (4, 3, 32, 32),
        "sr64": (4, 3, 64, 64),
    }
    assert out.image_embeds.shape == (4, tiny_pipe.clip.embed_dim)
    assert out.images.min() >= 0 and out.images.max() <= 1
    pil = run(tiny_pipe, output_type="pil").images
    assert len(pil) == 2 and all(isinstance(i, Image.Image) and i.size == (64, 64) for i in pil)
    # "np" as diffusers returns it: float32 [N, H, W, 3] in [0, 1]; "uint8": the PIL pixels
    arr = run(tiny_pipe, output_type="np").images
    assert arr.shape == (2, 64, 64, 3) and arr.dtype == np.float32
    assert np.array_equal(arr, run(tiny_pipe, output_type="pt").images.permute(0, 2, 3, 1).numpy())
    pixels = run(tiny_pipe, output_type="uint8").images
    assert pixels.dtype == np.uint8 and np.array_equal(
        pixels, np.stack([np.asarray(i) for i in pil])
    )
    assert np.array_equal(pixels, (arr * 255).round().astype(np.uint8))
    latent = run(tiny_pipe, output_type="latent").images
    assert torch.equal((latent + 1) / 2, run(tiny_pipe, output_type="pt").images)


def test_seeds_reproduce_and_differ(tiny_pipe):
    a, b = run(tiny_pipe).images, run(tiny_pipe).images
    c = run(tiny_pipe, seeds=(5, 6)).images
    assert torch.equal(a, b)
    assert (a - c).abs().mean() > 1e-3


def test_save_load_identical(tiny_pipe, tmp_path):
    tiny_pipe.save_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "unclip.json").read_text())
    assert index["components"]["upsamplers"] == ["sr32", "sr64"]
    assert {p.name for p in (tmp_path / "p").iterdir()} >= {
        "clip",
        "prior",
        "decoder",
        "sr32",
        "sr64",
    }
    again = UnCLIPPipeline.from_pretrained(tmp_path / "p", **EXACT)
    assert again.sampling == tiny_pipe.sampling
    assert torch.equal(run(tiny_pipe).images, run(again).images)
    # saved again, a loaded pipeline's component configs name their subfolder, not the folder
    # they were loaded from (no path of the machine that wrote them)
    again.save_pretrained(tmp_path / "q")
    for name in ("prior", "decoder", "sr32", "sr64"):
        config = json.loads((tmp_path / "q" / name / "config.json").read_text())
        assert config["_name_or_path"] == name, config["_name_or_path"]
    assert str(tmp_path) not in "".join(f.read_text() for f in (tmp_path / "q").rglob("*.json"))
    # pruning is left out of the file while off, so the folder loads where it is not known; set,
    # it is saved and loaded back
    # (and so is best_of_contrasted)
    newer = ("prune_at", "prune_keep", "best_of_contrasted")
    assert all(not set(newer) & set(s) for s in index["sampling"].values())
    dec = again.sampling["decoder"]
    dec.prune_at, dec.prune_keep, dec.best_of_contrasted = 1, 2, 3
    again.save_pretrained(tmp_path / "r")
    saved = json.loads((tmp_path / "r" / "unclip.json").read_text())["sampling"]["decoder"]
    assert [saved[f] for f in newer] == [1, 2, 3]
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "r", **EXACT).sampling["decoder"]
    assert [getattr(loaded, f) for f in newer] == [1, 2, 3]


@pytest.fixture(scope="module")
def pipe64():
    # float64 so that the comparisons below test the sampling logic (generator streams, batching,
    # guidance) and not float32 kernels whose rounding depends on the batch size
    return tiny_pipeline(seed=0).to(dtype=torch.float64)


def test_batch_equals_one_by_one(pipe64):
    batched = run(pipe64, num_images_per_prompt=2, seeds=(3, 4)).images
    single = torch.cat(
        [
            pipe64(
                [p], num_images_per_prompt=2, generator=gens(s), output_type="pt", progress=False
            ).images
            for p, s in zip(PROMPTS, (3, 4))
        ]
    )
    assert torch.allclose(batched, single, atol=1e-7)
    assert not torch.allclose(batched[0], batched[1])  # two images per prompt differ


def test_guidance_one_is_the_unguided_path(pipe64):
    tiny_pipe = pipe64
    s = {"prior": {"guidance_scale": 1.0}, "decoder": {"guidance_scale": 1.0}}
    plain = run(tiny_pipe, sampling=s).images
    # force the batched [uncond; cond] path at scale 1: eps_u + 1·(eps_c − eps_u) must equal eps_c
    with (
        mock.patch.object(diffusion, "is_guided", lambda scale: True),
        mock.patch("unclip.sampling.stages.is_guided", lambda scale: True),
    ):
        forced = run(tiny_pipe, sampling=s).images
    assert torch.allclose(plain, forced, atol=1e-7)
    guided = run(tiny_pipe, sampling={"decoder": {"guidance_scale": 5.0}}).images
    assert (guided - plain).abs().mean() > 1e-3


def test_best_of_n_keeps_highest_similarity(tiny_pipe):
    text = tiny_pipe.encode_text(PROMPTS)
    best, cands = tiny_pipe.sample_image_embeds(
        text, 2, gens(0, 1), {"prior": {"best_of": 4}}, return_candidates=True, progress=False
    )
    assert cands.shape == (4, 4, tiny_pipe.clip.embed_dim)
    te = text.text_embed.repeat_interleave(2, 0)
    sims = torch.einsum("bnd,bd->bn", torch.nn.functional.normalize(cands, dim=-1), te)
    assert not torch.allclose(cands[:, 0], cands[:, 1])
    for i in range(4):
        assert torch.equal(best[i], cands[i, int(sims[i].argmax())])


def test_rerank_keeps_best_clip_candidate(tiny_pipe):
    prompt = PROMPTS[:1]
    kept = run(
        tiny_pipe,
        prompts=prompt,
        seeds=(7,),
        sampling={"decoder": {"best_of": 3}},
        return_intermediates=True,
    )
    cands = run(
        tiny_pipe, prompts=prompt, seeds=(7,), num_images_per_prompt=3, return_intermediates=True
    )
    small = cands.stage_images["decoder"]
    scores = tiny_pipe.clip_scores(small, tiny_pipe.encode_text(prompt).text_embed.repeat(3, 1))
    assert kept.images.shape == (1, 3, 64, 64)
    assert len(set(scores.tolist())) == 3
    assert torch.equal(kept.stage_images["decoder"][0], small[int(scores.argmax())])
    # the pipeline's stored decoder best_of is the default number of candidates
    stored = UnCLIPPipeline(
        tiny_pipe.clip,
        tiny_pipe.prior,
        tiny_pipe.decoder,
        tiny_pipe.upsamplers,
        diffusion=tiny_pipe.diffusion,
        sampling={
            **tiny_pipe.sampling,
            "decoder": {**vars(tiny_pipe.sampling["decoder"]), "best_of": 3},
        },
    )
    assert torch.equal(run(stored, prompts=prompt, seeds=(7,)).images, kept.images)
    assert tiny_pipe.rerank(small, prompt * 3, 1).tolist() == [0, 1, 2]
    assert tiny_pipe.rerank(small, prompt[0], 3).tolist() == [int(scores.argmax())]
    # keep: each group's best two, in their original order, so they form groups again
    top2 = sorted(scores.topk(2).indices.tolist())
    assert tiny_pipe.rerank(torch.cat([small, small]), prompt[0], 3, keep=2).tolist() == [
        *top2,
        *(i + 3 for i in top2),
    ]
    assert tiny_pipe.rerank(small, prompt[0], 3, keep=3).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="sr32: best_of is not a setting of an upsampler"):
        run(tiny_pipe, sampling={"upsampler": {"best_of": 2}})


def _with_reranker(pipe, seed=1):
    from unclip import CLIP
    from unclip.nets.clip import ClipConfig, tiny_clip_config

    torch.manual_seed(seed)
    other = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    return UnCLIPPipeline(
        pipe.clip,
        pipe.prior,
        pipe.decoder,
        pipe.upsamplers,
        diffusion=pipe.diffusion,
        sampling=pipe.sampling,
        reranker=other,
    )


def _cosines(clip, images, prompt):
    img = torch.nn.functional.normalize(clip.encode_image(images), dim=-1)
    return img @ clip.encode_text([prompt]).text_embed[0]


def _candidates_ranked_apart(pipe, prompt, score_a, score_b, tries, **kw):
    """``(seed, candidates, (scores_a, scores_b))`` for the first seed below ``tries`` whose 4
    decoder candidates ``score_a`` and ``score_b`` rank differently, so a test can tell the two
    rules apart."""
    for seed in range(tries):
        cands = run(
            pipe,
            prompts=[prompt],
            seeds=(seed,),
            num_images_per_prompt=4,
            return_intermediates=True,
            **kw,
        ).stage_images["decoder"]
        a, b = score_a(cands), score_b(cands)
        if int(a.argmax()) != int(b.argmax()):
            return seed, cands, (a, b)
    pytest.fail(f"no seed in {tries} where the two rules pick different candidates")


def test_reranker_clip_chooses_the_candidates(tiny_pipe, tmp_path):
    """A pipeline's `reranker` CLIP, not the conditioning CLIP, scores the decoder candidates; it is
    saved in reranker/ and loaded back; a folder without one reranks with the conditioning CLIP."""
    ranked = _with_reranker(tiny_pipe)
    assert ranked.rerank_clip is ranked.reranker and tiny_pipe.rerank_clip is tiny_pipe.clip
    prompt = PROMPTS[0]
    # a seed whose 4 candidates the two CLIPs rank differently, so the test tells them apart
    seed, cands, (own, other) = _candidates_ranked_apart(
        tiny_pipe,
        prompt,
        lambda c: _cosines(tiny_pipe.clip, c, prompt),
        lambda c: _cosines(ranked.reranker, c, prompt),
        tries=20,
    )
    four = {"decoder": {"best_of": 4}}
    kept = run(ranked, prompts=[prompt], seeds=(seed,), sampling=four, return_intermediates=True)
    assert torch.equal(kept.stage_images["decoder"][0], cands[int(other.argmax())])
    assert ranked.rerank(cands, [prompt], 4).tolist() == [int(other.argmax())]
    assert tiny_pipe.rerank(cands, [prompt], 4).tolist() == [int(own.argmax())]

    ranked.save_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "unclip.json").read_text())
    assert (
        index["components"]["reranker"] == "reranker"
        and (tmp_path / "p" / "reranker" / "config.json").is_file()
    )
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "p", autocast_dtype=None)
    assert loaded.reranker is not None
    assert torch.allclose(
        loaded.reranker.encode_image(cands), ranked.reranker.encode_image(cands), atol=1e-6
    )
    assert torch.allclose(
        run(loaded, prompts=[prompt], seeds=(seed,), sampling=four).images,
        run(ranked, prompts=[prompt], seeds=(seed,), sampling=four).images,
        atol=1e-4,
    )
    tiny_pipe.save_pretrained(tmp_path / "plain")
    assert (
        json.loads((tmp_path / "plain" / "unclip.json").read_text())["components"]["reranker"]
        is None
    )
    assert UnCLIPPipeline.from_pretrained(tmp_path / "plain").reranker is None

    # `unclip assemble --reranker` adds one to components
    from unclip.cli.assemble import main as assemble

    p = tmp_path / "p"
    assert (
        assemble(
            [
                "--clip",
                str(p / "clip"),
                "--prior",
                str(p / "prior"),
                "--decoder",
                str(p / "decoder"),
                "--upsampler",
                str(p / "sr32"),
                "--upsampler",
                str(p / "sr64"),
                "--reranker",
                str(p / "reranker"),
                "--out",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    assembled = UnCLIPPipeline.from_pretrained(tmp_path / "a")
    assert assembled.rerank(cands, [prompt], 4).tolist() == [int(other.argmax())]


def test_region_views_paint_the_far_side_of_each_split_in_the_border_median():
    """Each view keeps the pixels whose centres lie on the part's side of a split and paints the
    rest in the per-channel median of the image's border, per image."""
    from unclip.shapes.regions import region_views

    images = torch.rand(2, 3, 10, 10) * 2 - 1
    images[0, :, 0, :] = images[0, :, -1, :] = images[0, :, :, 0] = images[0, :, :, -1] = 0.25
    images[0, 1, 0, :] = -0.5  # 12 of the 40 border entries differ in one channel: not the median
    left = region_views(images, "x", True, splits=(0.3, 0.5))
    below = region_views(images, "y", False, splits=(0.5,))
    assert left.shape == (2, 2, 3, 10, 10) and below.shape == (1, 2, 3, 10, 10)
    assert torch.equal(left[0, :, :, :, :3], images[..., :3])  # centres 0.05-0.25 < 0.3
    assert (left[0, 0, :, :, 3:] == 0.25).all()
    assert torch.equal(left[1, :, :, :, :5], images[..., :5])
    border = torch.cat(
        [images[1, :, 0], images[1, :, -1], images[1, :, :, 0], images[1, :, :, -1]], -1
    )
    assert torch.equal(
        left[1, 1, :, :, 5:], border.median(-1).values[:, None, None].expand(3, 10, 5)
    )
    assert torch.equal(below[0, :, :, 5:], images[:, :, 5:])  # the lower half of the rows
    assert (below[0, 0, :, :5] == 0.25).all()
    with pytest.raises(ValueError, match="axis must be 'x' or 'y'"):
        region_views(images, "z", True)


def test_a_region_contrast_scorer_adds_each_parts_best_split_reading(tiny_pipe, monkeypatch):
    """A :class:`RegionContrastScorer` scores each candidate by its whole-image contrast plus, at
    the split that suits it best, the sum over the parts of ``log p(part's caption | the image
    masked to the part's side)``; ``rerank`` keeps the best by that sum, and a prompt whose
    ``regions`` are empty is scored by the whole-image contrast alone."""
    from unclip.sampling.scorers import RERANK_CONTRASTS
    from unclip.shapes.regions import REGION_SPLITS, RegionContrastScorer, RegionPart

    prompt, other = PROMPTS[0], "a big blue square in the center"
    whole = [prompt, other, "a green triangle at the top"]
    parts = [
        RegionPart(
            "x", True, ("a small red circle on the left", "a small blue circle on the left")
        ),
        RegionPart(
            "x", False, ("a small blue square on the right", "a small red square on the right")
        ),
    ]

    def parts_of(p):
        return parts if p == prompt else []

    contrast = RegionContrastScorer(lambda p: whole, parts_of)
    monkeypatch.setitem(RERANK_CONTRASTS, "test-regions", contrast)
    clip = tiny_pipe.clip
    torch.manual_seed(0)
    cands = torch.rand(4, 3, 32, 32) * 2 - 1

    def logp(images, captions):
        img = torch.nn.functional.normalize(clip.encode_image(images), dim=-1)
        txt = torch.nn.functional.normalize(clip.encode_text(list(captions)).text_embed, dim=-1)
        return (img @ txt.T * clip.logit_scale).log_softmax(-1)[:, 0]

    # the masks written out pixel by pixel: the border median, columns by their centres
    per_split = []
    for split in REGION_SPLITS:
        total = torch.zeros(4)
        for part in parts:
            views = cands.clone()
            for i in range(4):
                c = cands[i]
                fill = torch.cat([c[:, 0], c[:, -1], c[:, :, 0], c[:, :, -1]], -1).median(-1).values
                for col in range(32):
                    if ((col + 0.5) / 32 < split) != part.low:
                        views[i, :, :, col] = fill[:, None]
            total += logp(views, part.captions)
        per_split.append(total)
    regions = torch.stack(per_split).max(0).values
    expected = logp(cands, whole) + regions
    with torch.no_grad():
        got = contrast.score(clip, cands, [prompt] * 4)
        plain = contrast.score(clip, cands, [other] * 4)
        # prompts interleaved: each image gets its own prompt's terms
        mixed = contrast.score(clip, cands, [prompt, other, other, prompt])
    assert regions.abs().min() > 1e-3  # the term is there to be missed
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plain, logp(cands, whole), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        mixed, torch.where(torch.tensor([1, 0, 0, 1]).bool(), got, plain), rtol=1e-4, atol=1e-5
    )
    assert tiny_pipe.rerank(cands, prompt, 4, contrast="test-regions").tolist() == [
        int(expected.argmax())
    ]
    assert RegionPart("y", False, ["a", "b"]).captions == ("a", "b")
    with pytest.raises(ValueError, match="axis must be 'x' or 'y'"):
        RegionPart("z", True, ("a", "b"))
    with pytest.raises(ValueError, match="at least one alternative"):
        RegionPart("x", True, ("a",))
    with pytest.raises(TypeError, match="not one string"):
        RegionPart("x", True, "ab")
    with pytest.raises(TypeError, match="low must be True"):
        RegionPart("x", "left", ("a", "b"))
    contrast.regions = lambda p: ["a small red circle on the left"]
    with pytest.raises(TypeError, match="RegionPart objects, got str"):
        tiny_pipe.rerank(cands, prompt, 4, contrast="test-regions")


def test_rerank_contrast_scores_the_prompt_against_its_alternatives(tiny_pipe, monkeypatch):
    """``rerank_contrast`` keeps the candidate with the highest log-probability of the prompt's
    caption among its alternatives (softmax of the CLIP's logit scale × cosine), in ``rerank``, in
    the pipeline's reranking of finished candidates and in the ``rerank_at`` choice; a prompt
    without alternatives is scored by plain cosine."""
    from unclip.sampling.scorers import RERANK_CONTRASTS, register_rerank_contrast

    prompt = PROMPTS[0]
    captions = [prompt, "a big blue square in the center", "a green triangle at the top"]
    asked = []

    def alternatives(p):
        asked.append(p)
        return captions if p == prompt else []

    monkeypatch.setitem(RERANK_CONTRASTS, "test", alternatives)  # removed after the test
    register_rerank_contrast("test", alternatives)
    clip = tiny_pipe.clip
    txt = torch.nn.functional.normalize(clip.encode_text(captions).text_embed, dim=-1)

    def contrast(cands):
        img = torch.nn.functional.normalize(clip.encode_image(cands), dim=-1)
        return (img @ txt.T * clip.logit_scale).log_softmax(-1)[:, 0]

    # candidates the two rules rank differently, so the test tells them apart
    seed, cands, (logp, cos) = _candidates_ranked_apart(
        tiny_pipe,
        prompt,
        contrast,
        lambda c: _cosines(clip, c, prompt),
        tries=30,
        last_stage="decoder",
    )
    best, plain = int(logp.argmax()), int(cos.argmax())
    assert tiny_pipe.rerank(cands, prompt, 4, contrast="test").tolist() == [best]
    assert tiny_pipe.rerank(cands, prompt, 4, contrast=alternatives).tolist() == [best]
    assert tiny_pipe.rerank(cands, prompt, 4).tolist() == [plain]
    assert tiny_pipe.rerank(cands, prompt, 4, contrast=lambda p: []).tolist() == [plain]
    four = {"decoder": {"best_of": 4, "rerank_contrast": "test"}}
    kept = run(
        tiny_pipe,
        prompts=[prompt],
        seeds=(seed,),
        sampling=four,
        return_intermediates=True,
        last_stage="decoder",
    )
    assert torch.equal(kept.stage_images["decoder"][0], cands[best])
    # the part-way choice scores with it too
    asked.clear()
    early = {"decoder": {"best_of": 2, "steps": 3, "rerank_at": 1, "rerank_contrast": "test"}}
    run(tiny_pipe, prompts=[prompt, PROMPTS[1]], sampling=early, last_stage="decoder")
    assert asked == [prompt, PROMPTS[1]]
    with pytest.raises(ValueError, match="rerank_contrast must be one of .*'test'.* got 'nope'"):
        tiny_pipe.sampling_settings({"decoder": {"rerank_contrast": "nope"}})
    with pytest.raises(
        ValueError, match="prior: rerank_contrast is not a setting of the diffusion prior"
    ):
        tiny_pipe.sampling_settings({"prior": {"rerank_contrast": "test"}})
    with pytest.raises(TypeError, match="registered name, a Scorer or a function"):
        tiny_pipe.rerank(cands, prompt, 1, contrast=3)
    with pytest.raises(ValueError, match="candidates of a group must share one prompt"):
        tiny_pipe.rerank(cands, [prompt, PROMPTS[1]] * 2, 2, contrast="test")
    with pytest.raises(TypeError, match="fn must be a Scorer or callable"):
        register_rerank_contrast("x", "not a function")


def test_best_of_contrasted_draws_more_candidates_for_contrasted_prompts(tiny_pipe, monkeypatch):
    """With the decoder's ``best_of_contrasted``, prompts its ``rerank_contrast`` has alternatives
    for draw that many candidates and the others ``best_of``: each group is sampled as a call with
    its own count, and the outputs come back in prompt order."""
    from unclip.sampling.candidates import candidate_counts
    from unclip.sampling.scorers import RERANK_CONTRASTS

    hard = "a red circle above a blue square"
    monkeypatch.setitem(
        RERANK_CONTRASTS, "test-hard", lambda p: [p, p.replace("red", "green")] if p == hard else []
    )
    prompts = [PROMPTS[0], hard, PROMPTS[1]]
    short = {"prior": {"steps": 2}, "decoder": {"steps": 2, "rerank_contrast": "test-hard"}}
    mixed = {**short, "decoder": {**short["decoder"], "best_of": 2, "best_of_contrasted": 3}}

    def fixed(count):
        return {**short, "decoder": {**short["decoder"], "best_of": count}}

    settings = tiny_pipe.sampling_settings(mixed)["decoder"]
    assert candidate_counts(settings, prompts) == [2, 3, 2]
    rows = []

    def count_rows(pipe, step, t, kw):
        if kw["stage"] == "decoder" and step == 0:
            rows.append(kw["latents"].shape[0])

    out = run(
        tiny_pipe,
        prompts=prompts,
        seeds=(0, 1, 2),
        sampling=mixed,
        num_images_per_prompt=2,
        return_intermediates=True,
        last_stage="sr32",
        callback_on_step_end=count_rows,
    )
    # the one-object prompts' 2 × 2 candidates each, then the contrasted prompt's 2 × 3
    assert rows == [8, 6]
    easy = run(
        tiny_pipe,
        prompts=[PROMPTS[0], PROMPTS[1]],
        seeds=(0, 2),
        sampling=fixed(2),
        num_images_per_prompt=2,
        return_intermediates=True,
        last_stage="sr32",
    )
    alone = run(
        tiny_pipe,
        prompts=[hard],
        seeds=(1,),
        sampling=fixed(3),
        num_images_per_prompt=2,
        return_intermediates=True,
        last_stage="sr32",
    )
    order = [0, 1, 4, 5, 2, 3]  # easy's rows, then alone's, back in prompt order
    for got, a, b in [
        (out.images, easy.images, alone.images),
        (out.image_embeds, easy.image_embeds, alone.image_embeds),
        (out.text_embeds, easy.text_embeds, alone.text_embeds),
        (out.stage_images["decoder"], easy.stage_images["decoder"], alone.stage_images["decoder"]),
    ]:
        assert torch.equal(got, torch.cat([a, b])[order])
    assert set(out.timings) == set(easy.timings) and out.timings["decoder"] > 0
    few = dict(prompts=prompts, seeds=(0, 1, 2), sampling=mixed, last_stage="decoder")
    pil, arr = run(tiny_pipe, **few, output_type="pil"), run(tiny_pipe, **few, output_type="uint8")
    assert len(pil.images) == len(arr.images) == 3
    assert all(np.array_equal(np.asarray(im), a) for im, a in zip(pil.images, arr.images))
    # a model's setting: kept by other overrides, reset by a count given alone
    dec = dataclasses.replace(tiny_pipe.sampling["decoder"], **mixed["decoder"])
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", dec)
    assert candidate_counts(tiny_pipe.sampling_settings()["decoder"], prompts) == [2, 3, 2]
    steps = tiny_pipe.sampling_settings({"decoder": {"steps": 3}})["decoder"]
    assert candidate_counts(steps, prompts) == [2, 3, 2]
    alone4 = tiny_pipe.sampling_settings({"decoder": {"best_of": 4}})["decoder"]
    assert alone4.best_of_contrasted is None and candidate_counts(alone4, prompts) == [4, 4, 4]
    with pytest.raises(
        ValueError, match="prior: best_of_contrasted is not a setting of the diffusion prior"
    ):
        tiny_pipe.sampling_settings({"prior": {"best_of_contrasted": 3}})
    with pytest.raises(ValueError, match="best_of_contrasted must be an integer >= 1, got 0"):
        tiny_pipe.sampling_settings({"decoder": {"best_of_contrasted": 0}})
    with pytest.raises(ValueError, match=r"6 generators for 3 prompts × 1 images \(the decoder"):
        tiny_pipe(prompts, generator=gens(*range(3 * 2)), sampling=mixed, progress=False)
    # one generator per image is taken with differing counts: each image keeps its own
    kw = dict(sampling=mixed, progress=False, output_type="pt")
    per_image = tiny_pipe(prompts, 2, generator=gens(*range(6)), **kw).images
    alone = tiny_pipe(prompts[1:2], 2, generator=gens(2, 3), **kw).images
    assert torch.equal(per_image[2:4], alone)
    # every group's settings are checked before the first group samples
    calls = []
    heun = {**mixed, "decoder": {**mixed["decoder"], "best_of": 1, "scheduler": "heun"}}
    heun["decoder"].update(rerank_at=1)
    with pytest.raises(ValueError, match="rerank_at 1"):
        tiny_pipe(prompts, sampling=heun, progress=False, callback_on_step_end=calls.append)
    assert calls == []
    # pruning is checked for the contrasted count too, and the error says so
    pruned = {"decoder": {**mixed["decoder"], "best_of": 2, "best_of_contrasted": 8}}
    pruned["decoder"].update(prune_at=1, prune_keep=4)
    with pytest.raises(ValueError, match="for the 8 candidates of best_of_contrasted"):
        tiny_pipe.sampling_settings(pruned)


def test_rerank_refuses_bad_arguments(tiny_pipe):
    images = torch.zeros(6, 3, 16, 16)
    with pytest.raises(TypeError, match="takes the prompts"):
        tiny_pipe.rerank(images, tiny_pipe.encode_text(["a red circle"] * 6).text_embed, 3)
    with pytest.raises(ValueError, match="4 prompts for 6 images in groups of 3"):
        tiny_pipe.rerank(images, ["a red circle"] * 4, 3)
    with pytest.raises(ValueError, match="not groups of 4"):
        tiny_pipe.rerank(images, "a red circle", 4)
    with pytest.raises(TypeError, match="reranker must be a CLIP"):
        UnCLIPPipeline(tiny_pipe.clip, tiny_pipe.prior, tiny_pipe.decoder, reranker="clip/")


def test_variations_and_interpolation(tiny_pipe, tmp_path):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    img.save(tmp_path / "in.png")
    v = tiny_pipe.variations(
        tmp_path / "in.png", num_images=3, generator=gens(0, 1, 2), output_type="pt", progress=False
    )
    assert v.images.shape == (3, 3, 64, 64)
    assert torch.allclose(v.image_embeds[0], tiny_pipe.clip.encode_image(img)[0])
    it = tiny_pipe.interpolate("a red circle", img, num_steps=4, output_type="pt", progress=False)
    assert it.images.shape == (4, 3, 64, 64)
    assert torch.allclose(it.image_embeds[-1], tiny_pipe.clip.encode_image(img)[0], atol=1e-5)
    assert not torch.allclose(it.images[0], it.images[-1])


def test_slerp_endpoints_and_norm():
    a, b = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)
    assert torch.allclose(slerp(a, b, 0.0), a, atol=1e-6) and torch.allclose(
        slerp(a, b, 1.0), b, atol=1e-6
    )
    assert torch.allclose(slerp(a, b, 0.3).norm(), torch.tensor(1.0), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"prompt": []}, ValueError, "empty"),
        ({"prompt": 5}, TypeError, "string"),
        ({"prompt": ["ok", 3]}, TypeError, r"prompt\[1\]"),
        ({"sampling": {"decoder": {"scheduler": "eulr"}}}, ValueError, "unknown sampler 'eulr'"),
        ({"sampling": {"prior": {"guidance_scale": -1}}}, ValueError, "guidance scale must be"),
        ({"sampling": {"sr32": {"steps": 0}}}, ValueError, "steps must be an integer >= 1"),
        (
            {"sampling": {"decoder": {"scheduler": "unclip", "steps": 1}}},
            ValueError,
            "needs steps >= 2",
        ),
        ({"sampling": {"decoder": {"stepz": 3}}}, ValueError, "unknown sampling setting 'stepz'"),
        ({"sampling": {"decodr": {"steps": 3}}}, ValueError, "unknown stage 'decodr'"),
        ({"sampling": {"upsamplers": {"steps": 3}}}, ValueError, "use 'upsampler' for every"),
        ({"sampling": {"decoder": 3}}, TypeError, r"sampling\['decoder'\] must be a dict"),
        ({"sampling": [("decoder", {})]}, TypeError, "sampling must be a dict"),
        ({"last_stage": "sr128"}, ValueError, "last_stage must be 'decoder' or one of"),
        ({"image_embeds": torch.zeros(2, 32)}, ValueError, "2 embeddings for 1 prompts"),
        ({"callback_on_step_end": 3}, TypeError, "callback_on_step_end must be callable"),
        ({"num_images_per_prompt": 0}, ValueError, "num_images_per_prompt"),
        ({"output_type": "jpeg"}, ValueError, "output_type"),
    ],
)
def test_bad_input_fails_before_compute(tiny_pipe, kwargs, exc, match):
    kwargs = {"prompt": "a red circle", **kwargs}
    with mock.patch.object(tiny_pipe.prior, "forward", side_effect=AssertionError("computed")):
        with pytest.raises(exc, match=match):
            tiny_pipe(progress=False, **kwargs)


def test_sampling_settings_resolve_and_validate_every_stage(tiny_pipe):
    """The public settings API: defaults per stage, overrides by stage or for every upsampler (a
    stage's own key wins), a copy each time, and errors that name the bad key and the valid ones."""
    default = tiny_pipe.sampling_settings()
    assert list(default) == tiny_pipe.stage_names == ["prior", "decoder", "sr32", "sr64"]
    assert default == tiny_pipe.sampling and default["decoder"] is not tiny_pipe.sampling["decoder"]
    s = tiny_pipe.sampling_settings(
        {"decoder": {"steps": 7, "best_of": 3}, "upsampler": {"steps": 4}, "sr64": {"steps": 2}}
    )
    assert (s["decoder"].steps, s["decoder"].best_of) == (7, 3)
    assert (s["sr32"].steps, s["sr64"].steps) == (4, 2)
    assert s["prior"] == tiny_pipe.sampling["prior"]
    assert s["sr32"].scheduler == tiny_pipe.sampling["sr32"].scheduler  # untouched fields kept
    from unclip.sampling.settings import DecoderSampling

    given = DecoderSampling(scheduler="ddpm", steps=3, guidance_scale=2.0, best_of=1)
    assert tiny_pipe.sampling_settings({"decoder": given})["decoder"] == given
    s["decoder"].steps = 99  # a copy: the pipeline's defaults are unchanged
    assert tiny_pipe.sampling["decoder"].steps != 99
    with pytest.raises(ValueError) as e:
        tiny_pipe.sampling_settings({"decodr": {"steps": 3}})
    msg = str(e.value)
    assert "'decodr'" in msg and "did you mean 'decoder'" in msg
    assert "valid: prior, decoder, sr32, sr64, upsampler" in msg
    with pytest.raises(ValueError) as e:
        tiny_pipe.sampling_settings({"upsamplers": {"steps": 3}})
    assert "unknown stage 'upsamplers'" in str(e.value) and "use 'upsampler'" in str(e.value)
    with pytest.raises(ValueError) as e:
        tiny_pipe.sampling_settings({"sr32": {"guidance": 3}})
    msg = str(e.value)
    assert "sampling['sr32']" in msg and "'guidance'" in msg
    assert "valid: scheduler, steps, guidance_scale, best_of" in msg
    # one set of overrides serves a pipeline without a prior too, still checked
    no_prior = UnCLIPPipeline(tiny_pipe.clip, None, tiny_pipe.decoder, tiny_pipe.upsamplers)
    assert list(no_prior.sampling_settings({"prior": {"steps": 3}})) == ["decoder", "sr32", "sr64"]
    with pytest.raises(ValueError, match="unknown sampling setting 'stepz'"):
        no_prior.sampling_settings({"prior": {"stepz": 3}})
    with pytest.raises(ValueError, match="unknown stage 'sr128'"):
        no_prior.sampling_settings({"sr128": {"steps": 3}})


def test_callback_on_step_end_sees_every_step_of_every_stage(tiny_pipe):
    """diffusers-style ``callback_on_step_end(pipe, step, timestep, callback_kwargs)``: once per
    denoising step of each stage in order, with the stage's current x_t; a returned ``latents``
    replaces x_t. Per-stage timings come back on the output."""
    sampling = {
        "prior": {"steps": 3, "best_of": 2},
        "decoder": {"steps": 4, "best_of": 2},
        "upsampler": {"steps": 2},
    }
    seen = []

    def record(pipe, step, timestep, kwargs):
        assert pipe is tiny_pipe and isinstance(timestep, torch.Tensor)
        seen.append((kwargs["stage"], step, tuple(kwargs["latents"].shape)))

    plain = run(tiny_pipe, sampling=sampling)
    out = run(tiny_pipe, sampling=sampling, callback_on_step_end=record)
    assert torch.equal(out.images, plain.images)  # observing changes nothing
    d = tiny_pipe.clip.embed_dim
    expected = (
        [("prior", i, (2 * 2 * 2, d)) for i in range(3)]  # 2 prompts × decoder 2 × prior 2
        + [("decoder", i, (4, 3, 16, 16)) for i in range(4)]
        + [("sr32", i, (2, 3, 32, 32)) for i in range(2)]
        + [("sr64", i, (2, 3, 64, 64)) for i in range(2)]
    )
    assert seen == expected
    assert list(out.timings) == tiny_pipe.stage_names
    assert all(v > 0 for v in out.timings.values())

    def zero_last_upsampler_step(pipe, step, timestep, kwargs):
        if kwargs["stage"] == "sr64" and step == 1:
            return {"latents": torch.zeros_like(kwargs["latents"])}
        return None

    zeroed = run(tiny_pipe, sampling=sampling, callback_on_step_end=zero_last_upsampler_step)
    assert torch.equal(zeroed.images, torch.full_like(zeroed.images, 0.5))  # x = 0 is grey


def test_image_embeds_and_last_stage(tiny_pipe):
    """``image_embeds`` decodes given CLIP image embeddings instead of the prior's (the prior does
    not run); ``last_stage`` stops the cascade early with the same images up to there."""
    full = run(tiny_pipe, return_intermediates=True, sampling={"decoder": {"best_of": 2}})
    embeds = full.image_embeds
    with mock.patch.object(tiny_pipe.prior, "forward", side_effect=AssertionError("prior ran")):
        given = run(
            tiny_pipe,
            image_embeds=embeds,
            return_intermediates=True,
            sampling={"decoder": {"best_of": 2}},
        )
    assert torch.equal(given.image_embeds, embeds) and "prior" not in given.timings
    assert given.images.shape == full.images.shape
    short = run(tiny_pipe, last_stage="sr32", return_intermediates=True)
    assert list(short.stage_images) == ["decoder", "sr32"] and short.images.shape[-1] == 32
    assert list(short.timings) == ["prior", "decoder", "sr32"]
    again = run(tiny_pipe, return_intermediates=True)
    assert torch.equal(short.stage_images["sr32"], again.stage_images["sr32"])
    decoded = run(tiny_pipe, last_stage="decoder")
    assert decoded.images.shape[-1] == 16


def test_output_save_writes_images_grid_and_record(tiny_pipe, tmp_path):
    out = run(tiny_pipe, num_images_per_prompt=2, output_type="pil")
    record = out.save(tmp_path / "o", PROMPTS, {"model": "tiny"}, grid_cols=2, seeds=[0, 1])
    assert sorted(p.name for p in (tmp_path / "o").glob("0*.png")) == [
        "000_00.png",
        "000_01.png",
        "001_00.png",
        "001_01.png",
    ]
    assert json.loads((tmp_path / "o" / "generate.json").read_text()) == record
    assert record["files"][2] == {"file": "001_00.png", "prompt": PROMPTS[1], "seed": 1, "index": 0}
    assert Image.open(tmp_path / "o" / "grid.png").size == (128, 128)
    with pytest.raises(ValueError, match="do not split over 3 prompts"):
        out.save(tmp_path / "x", PROMPTS + ["a third"])


def test_over_long_prompt_warns(tiny_pipe):
    with pytest.warns(UserWarning, match="truncated"):
        run(tiny_pipe, prompts=["a red circle " * 20], seeds=(0,))


def test_load_errors(tiny_pipe, tmp_path):
    tiny_pipe.save_pretrained(tmp_path / "p")
    import shutil

    shutil.rmtree(tmp_path / "p" / "sr32")
    with pytest.raises(FileNotFoundError, match="'sr32' is missing"):
        UnCLIPPipeline.from_pretrained(tmp_path / "p")
    with pytest.raises(ValueError, match="not an unclip pipeline folder"):
        UnCLIPPipeline.from_pretrained(tmp_path)
    # embedding sizes that disagree are caught at load, naming both
    other = tiny_pipeline(seed=1, clip_kwargs={"embed_dim": 24})
    other.prior.save_pretrained(tmp_path / "p2" / "prior")
    tiny_pipe.save_pretrained(tmp_path / "p2")
    other.prior.save_pretrained(tmp_path / "p2" / "prior")
    with pytest.raises(ValueError, match="prior embed_dim 24 != CLIP embed_dim 32"):
        UnCLIPPipeline.from_pretrained(tmp_path / "p2")


def test_decode_checks_embeddings(tiny_pipe):
    with pytest.raises(ValueError, match=r"image_embed must be a tensor \[B, 32\]"):
        tiny_pipe.decode(torch.zeros(2, 7), progress=False)
    with pytest.raises(ValueError, match="NaN"):
        tiny_pipe.decode(torch.full((1, 32), float("nan")), progress=False)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm++", "unclip"])
def test_every_sampler_runs_every_stage(tiny_pipe, sampler):
    s = {
        "prior": {"scheduler": sampler, "steps": 3},
        "decoder": {"scheduler": sampler, "steps": 3},
        "upsampler": {"scheduler": sampler, "steps": 2},
    }
    a = run(tiny_pipe, sampling=s, seeds=(0,), prompts=PROMPTS[:1], return_intermediates=True)
    b = run(tiny_pipe, sampling=s, seeds=(0,), prompts=PROMPTS[:1])
    assert torch.isfinite(a.images).all() and torch.equal(a.images, b.images)
    assert a.stage_images["sr64"].shape == (1, 3, 64, 64)


def test_coordinate_channels():
    from unclip.nets.decoder import coordinate_grid

    grid = coordinate_grid(torch.zeros(2, 3, 4, 8))
    assert grid.shape == (2, 2, 4, 8)
    assert torch.allclose(
        grid[0, 0, 0], (torch.arange(8) + 0.5) / 8 * 2 - 1
    )  # x varies along the width
    assert torch.allclose(
        grid[0, 1, :, 0], (torch.arange(4) + 0.5) / 4 * 2 - 1
    )  # y along the height
    assert torch.equal(grid[0, 0], grid[0, 0].flip(-1).neg())  # symmetric about the centre

    pipe = tiny_pipeline(decoder_kwargs=dict(coord_channels=True))
    dec = pipe.decoder
    assert dec.unet.conv_in.in_channels == 5
    x = torch.randn(1, 3, 16, 16)
    emb = torch.randn(1, pipe.clip.embed_dim)
    text = pipe.encode_text(["a red circle"])
    with torch.no_grad():
        out = dec(x, torch.tensor([10]), emb, text)
        # the coordinate channels feed the first convolution: without their weights the output
        # changes
        dec.unet.conv_in.weight[:, 3:] = 0
        assert not torch.allclose(out, dec(x, torch.tensor([10]), emb, text))
    assert out.shape == (1, 3, 16, 16)
    images = pipe("a red circle", generator=gens(1), output_type="pt").images
    assert images.shape == (1, 3, 64, 64)


def test_embed_scale_scales_the_conditioning_embeddings():
    from unclip.nets.text_encoding import TextEncoding

    pipe = tiny_pipeline(decoder_kwargs=dict(embed_scale=8.0))
    plain = tiny_pipeline(decoder_kwargs=dict(embed_scale=1.0)).decoder
    plain.load_state_dict(pipe.decoder.state_dict())
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 500])
    emb = torch.nn.functional.normalize(torch.randn(2, pipe.clip.embed_dim), dim=-1)
    text = pipe.encode_text(["a red circle", "a blue square"])
    scaled_text = TextEncoding(text.text_embed * 8, text.text_tokens, text.text_mask)
    with torch.no_grad():
        out = pipe.decoder(x, t, emb, text)
        assert torch.allclose(out, plain(x, t, emb * 8, scaled_text), atol=1e-5)
        assert not torch.allclose(out, plain(x, t, emb, text), atol=1e-3)


def test_components_of_a_pipeline_folder_reassemble_with_their_settings(tmp_path):
    """`unclip assemble` from the component folders of a saved pipeline keeps each stage's diffusion
    and sampling settings (from the pipeline's unclip.json); a bare folder with neither warns."""
    import dataclasses
    import shutil

    pipe = tiny_pipeline(seed=0)
    pipe.diffusion["sr32"] = dataclasses.replace(
        pipe.diffusion["sr32"], prediction_type="v_prediction", min_snr_gamma=5.0
    )
    pipe.sampling["decoder"].best_of = 3
    pipe.sampling["prior"].guidance_scale = 1.5
    pipe.save_pretrained(tmp_path / "p")
    p = tmp_path / "p"
    again = UnCLIPPipeline.from_components(
        p / "clip", p / "decoder", p / "prior", [p / "sr32", p / "sr64"]
    )
    assert again.diffusion == pipe.diffusion and again.sampling == pipe.sampling
    shutil.copytree(p / "sr32", tmp_path / "loose" / "sr32")
    with pytest.warns(UserWarning, match="neither unclip_stage.json nor a pipeline unclip.json"):
        loose = UnCLIPPipeline.from_components(
            p / "clip", p / "decoder", p / "prior", [tmp_path / "loose" / "sr32"]
        )
    assert loose.diffusion["sr32"].prediction_type == "epsilon"


def test_upsampler_noise_level_noises_the_low_res_image_at_sampling(tmp_path):
    """`noise_level` (upsampler config) is the level the low-res image is noised to before
    upsampling: 0 leaves it clean; a level changes the result, reproducibly per seed, and survives
    save/load."""
    pipe = tiny_pipeline(seed=0)
    low = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    up = pipe.upsamplers[0]

    def sr(p):
        return p.upsample(low, gens(0, 1), stages=[p.upsampler_names[0]], progress=False)

    clean = sr(pipe)
    up.register_to_config(noise_level=100)
    noisy, again = sr(pipe), sr(pipe)
    assert torch.equal(noisy, again)
    assert (noisy - clean).abs().mean() > 1e-3
    pipe.save_pretrained(tmp_path / "p")
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "p", **EXACT)
    assert loaded.upsamplers[0].config.noise_level == 100
    assert torch.allclose(sr(loaded), noisy, atol=1e-5)


def test_sample_upsampler_is_the_pipeline_upsample_step():
    """`unclip.sampling.sample_upsampler` runs one upsampler without a pipeline and gives exactly
    what `UnCLIPPipeline.upsample` gives for that stage (noise-level step and guidance included);
    it refuses input of the wrong size and an upsampler best_of."""
    from unclip.sampling.stages import sample_upsampler

    pipe = tiny_pipeline(seed=0)
    up = pipe.upsamplers[0]
    up.register_to_config(noise_level=100)
    low = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    over = {"sr32": {"guidance_scale": 2.0, "steps": 3}}
    settings = pipe.sampling_settings(over)["sr32"]
    alone = sample_upsampler(up, low, settings, pipe.diffusion["sr32"], generator=gens(0, 1))
    piped = pipe.upsample(low, gens(0, 1), over, stages=["sr32"], progress=False)
    assert alone.shape == (2, 3, 32, 32)
    assert torch.equal(alone, piped)
    with pytest.raises(ValueError, match="sr32 expects 16px input, got 32px"):
        sample_upsampler(up, alone, settings, pipe.diffusion["sr32"])
    with pytest.raises(AttributeError, match="best_of"):
        settings.best_of = 2  # an upsampler's settings have no candidates to set
    with pytest.raises(ValueError, match="sr32: best_of is not a setting of an upsampler"):
        sample_upsampler(up, low, {"best_of": 2}, pipe.diffusion["sr32"])


def test_shapes_finalize_sets_sampling_stores_fp16_and_closes_the_reranker_vocabulary(
    tiny_pipe, tmp_path
):
    from safetensors.torch import load_file

    from unclip.cli.shapes_finalize import main as finalize

    ranked = _with_reranker(tiny_pipe)
    ranked.save_pretrained(tmp_path / "p")
    (tmp_path / "s.yaml").write_text(
        "decoder: {scheduler: ddim, steps: 5, guidance_scale: 1.0, best_of: 3}\n"
    )
    before = (tmp_path / "p" / "reranker" / "model.safetensors").stat().st_size
    assert (
        finalize(
            [
                str(tmp_path / "p"),
                "--sampling",
                str(tmp_path / "s.yaml"),
                "--closed-vocabulary",
                "reranker",
            ]
        )
        == 0
    )
    state = load_file(str(tmp_path / "p" / "reranker" / "model.safetensors"))
    assert "kept_token_ids" in state and state["token_embedding.weight"].dtype == torch.float16
    assert (tmp_path / "p" / "reranker" / "model.safetensors").stat().st_size < before / 2
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "p")
    assert loaded.sampling["decoder"].best_of == 3 and loaded.sampling["decoder"].steps == 5
    assert loaded.reranker.kept_token_ids is not None and loaded.clip.kept_token_ids is None
    caption = "a small red circle on the left on a gray background"
    assert torch.allclose(
        loaded.reranker.encode_text([caption]).text_embed,
        ranked.reranker.encode_text([caption]).text_embed,
        atol=2e-3,
    )  # fp16 weights
    tiny_pipe.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="this pipeline has no reranker component"):
        finalize(
            [
                str(tmp_path / "plain"),
                "--sampling",
                str(tmp_path / "s.yaml"),
                "--closed-vocabulary",
                "reranker",
            ]
        )


def _run_recording_choices(pipe, **kw):
    """``run(pipe, **kw)`` with the decoder's batch rows of every network call and every
    candidate choice (:func:`~unclip.sampling.candidates.rerank_candidates`) recorded:
    ``(output, rows, kept)``."""
    from unclip.sampling import candidates

    rows, kept = [], []
    hook = pipe.decoder.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    rerank = candidates.rerank_candidates
    try:
        with mock.patch.object(
            candidates,
            "rerank_candidates",
            lambda *a, **k: kept.append(rerank(*a, **k)) or kept[-1],
        ):
            out = run(pipe, **kw)
    finally:
        hook.remove()
    return out, rows, kept


def test_rerank_at_chooses_part_way_and_denoises_only_the_chosen(tiny_pipe):
    """The decoder's ``rerank_at``: the CLIP chooses among the candidates from their predicted
    images after that many steps, then only the chosen are denoised (network rows counted), each
    finishing as that candidate does undecided (guided, with a negative prompt: the conditioning
    rows follow the choice), with its own image embedding; steps or more means the finished images;
    bad values are refused."""
    few = {"prior": {"steps": 2}, "decoder": {"steps": 4}, "upsampler": {"steps": 2}}
    neg = ["a green square", "a red triangle"]  # one per prompt: the unconditional rows differ
    cands = run(tiny_pipe, sampling=few, num_images_per_prompt=3, negative_prompt=neg)
    cands_small = run(
        tiny_pipe,
        sampling=few,
        num_images_per_prompt=3,
        negative_prompt=neg,
        last_stage="decoder",
        output_type="pt",
    ).images
    early = {**few, "decoder": {"steps": 4, "best_of": 3, "rerank_at": 1}}
    out, rows, kept = _run_recording_choices(
        tiny_pipe, sampling=early, negative_prompt=neg, return_intermediates=True
    )
    # 2 prompts: 6 candidates for step 1, then the 2 chosen for steps 2-4; guided (scale 2), so
    # each call carries the unconditional half too
    assert rows == [12, 4, 4, 4] and len(kept) == 1 and kept[0].tolist() != [0, 3]
    torch.testing.assert_close(out.image_embeds, cands.image_embeds[kept[0]])
    torch.testing.assert_close(
        out.stage_images["decoder"], cands_small[kept[0]] * 2 - 1, atol=1e-5, rtol=0
    )

    plain = run(tiny_pipe, sampling={**few, "decoder": {"steps": 4, "best_of": 3}})
    at_end = run(tiny_pipe, sampling={**few, "decoder": {"steps": 4, "best_of": 3, "rerank_at": 9}})
    assert torch.equal(at_end.images, plain.images)
    for bad, match in [
        ({"decoder": {"rerank_at": 0}}, "rerank_at must be an integer >= 1"),
        ({"decoder": {"rerank_at": True}}, "rerank_at must be an integer"),
        ({"prior": {"rerank_at": 2}}, "prior: rerank_at is not a setting of the diffusion prior"),
        ({"upsampler": {"rerank_at": 2}}, "rerank_at is not a setting of an upsampler.*decoder"),
        ({"decoder": {"best_of": 2, "scheduler": "heun", "rerank_at": 1}}, "one network call"),
    ]:
        with pytest.raises(ValueError, match=match):
            run(tiny_pipe, sampling=bad)


def test_pruning_keeps_the_best_candidates_then_chooses_among_them(tiny_pipe):
    """The decoder's ``prune_at`` / ``prune_keep``: after step 1 the reranking CLIP keeps each
    image's 2 best of 4 candidates by their predicted images (network rows counted), after step 2
    it chooses one of those 2, and that candidate finishes as it does undecided, with its own
    image embedding. A ``best_of`` at or below ``prune_keep`` prunes nothing; bad values are
    refused with the fix."""
    few = {"prior": {"steps": 2}, "decoder": {"steps": 3}, "upsampler": {"steps": 2}}
    cands = run(tiny_pipe, sampling=few, num_images_per_prompt=4, last_stage="decoder")
    dec = {"steps": 3, "best_of": 4, "rerank_at": 2, "prune_at": 1, "prune_keep": 2}
    out, rows, kept = _run_recording_choices(
        tiny_pipe, sampling={**few, "decoder": dec}, return_intermediates=True, last_stage="decoder"
    )
    # 2 prompts: 8 candidates for step 1, the 4 kept for step 2, the 2 chosen for step 3 (each
    # call carries guidance's unconditional half too when the decoder is guided)
    per = rows[0] // 8
    assert rows == [8 * per, 4 * per, 2 * per]
    pruned, chosen = kept  # pruned: 2 of each prompt's 4; chosen: 1 of each prompt's 2 survivors
    assert [int(i) // 4 for i in pruned] == [0, 0, 1, 1]
    assert [int(i) // 2 for i in chosen] == [0, 1]
    final = pruned[chosen]
    torch.testing.assert_close(out.image_embeds, cands.image_embeds[final])
    torch.testing.assert_close(out.images, cands.images[final], atol=1e-5, rtol=0)

    plain = {"steps": 3, "best_of": 2, "rerank_at": 2}
    same = run(tiny_pipe, sampling={**few, "decoder": {**plain, "prune_at": 1, "prune_keep": 2}})
    assert torch.equal(same.images, run(tiny_pipe, sampling={**few, "decoder": plain}).images)
    for bad, match in [
        ({"decoder": {**dec, "prune_keep": None}}, "prune_at needs prune_keep too"),
        ({"decoder": {**dec, "prune_at": 0}}, "prune_at must be an integer >= 1"),
        ({"decoder": {**dec, "prune_at": 2}}, "needs the final choice later.*stop pruning"),
        ({"decoder": {**dec, "rerank_at": None}}, "needs the final choice later"),
        (
            {"prior": {"prune_at": 1, "prune_keep": 2}},
            "prior: prune_at is not a setting of the diffusion prior.*decoder",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            run(tiny_pipe, sampling=bad)


def test_each_stage_has_its_own_settings_type_and_old_files_load():
    """Per-stage settings: a stage's type holds only its settings; a dict in the one-type layout
    of earlier versions (every setting of every stage, the others at their defaults) loads for
    every stage, and a setting another stage owns is refused naming that stage when it is set."""
    import json

    from unclip.pipeline.folders import bundled_model_path
    from unclip.sampling.settings import (
        ARPriorSampling,
        DecoderSampling,
        PriorSampling,
        UpsamplerSampling,
        sampling_for,
    )

    old = json.loads((bundled_model_path() / "unclip.json").read_text())["sampling"]
    assert "rerank_at" in old["sr64"] and "temperature" in old["decoder"]  # the old layout
    loaded = {stage: sampling_for(stage, values) for stage, values in old.items()}
    assert type(loaded["prior"]) is PriorSampling and type(loaded["decoder"]) is DecoderSampling
    assert type(loaded["sr64"]) is UpsamplerSampling and not hasattr(loaded["sr64"], "best_of")
    assert loaded["decoder"].rerank_contrast == old["decoder"]["rerank_contrast"]
    ar = sampling_for("prior", {**old["prior"], "temperature": 0.5}, ar=True)
    assert type(ar) is ARPriorSampling and ar.temperature == 0.5  # no scheduler or steps there
    with pytest.raises(
        ValueError, match="sr64: rerank_at is not a setting of an upsampler.*decoder"
    ):
        sampling_for("sr64", {**old["sr64"], "rerank_at": 3})
    with pytest.raises(ValueError, match="temperature is not a setting of the diffusion prior"):
        sampling_for("prior", {**old["prior"], "temperature": 0.5})
    with pytest.raises(ValueError, match="unknown sampling setting 'stpes'.*did you mean 'steps'"):
        sampling_for("decoder", {"stpes": 3})
    with pytest.raises(AttributeError, match="no setting 'temperature'"):
        loaded["decoder"].temperature = 1.0
