"""Measure a shapes pipeline on the held-out split (the figures of ``docs/shapes_model.md``).

The command is ``unclip shapes-eval`` (:mod:`unclip.cli.shapes_eval`)::

    unclip shapes-eval                               # the bundled model, 200 + 200 prompts
    unclip shapes-eval --model runs/shapes/pipeline --num 200 --out report.json \\
        --grid docs/shapes_grid.png
    unclip shapes-eval --model P --num 60 --stages decoder \\
        --sampling '{"decoder": {"guidance_scale": 5}}'   # one point of a sampler/guidance sweep
    unclip shapes-eval --model P --oracle            # decoder from the true CLIP image embeddings
    unclip shapes-eval --model P --stages upsamplers \
        --sampling '{"sr64": {"steps": 2}}'        # the upsamplers alone, on true renders

Prompts: captions of the held-out split (``ShapesWorld(split="heldout")``, seed ``--prompt-seed``),
``--num`` single-object and ``--num`` two-object ones. Image ``i`` is sampled with its own generator
seeded ``seed + i``, through the pipeline's own sampling path (``pipe(...)``, which reports
per-stage images and timings). For every stage (decoder, each upsampler) the images are scored with
:func:`unclip.shapes.detector.evaluate_images`; the final images also get the CLIP score (100 ×
cosine between the pipeline CLIP's image and text embeddings), a CLIP-FID (Fréchet distance between
the pipeline CLIP's image features of the samples and of real held-out renders at the same
resolution, with :func:`unclip.eval.metrics.frechet_distance`; ``clip_fid_real_vs_real`` is the same
distance between two independent sets of real renders, the floor for this sample size) and the
prior's cosine with the true renders' image embeddings.

``stages="upsamplers"`` runs neither the prior nor the decoder: the upsamplers get the true renders
at the decoder's resolution (scored as stage ``renders``, the ceiling at that resolution), so what
each upsampler loses, e.g. with fewer sampling steps, is measured apart from the decoder's errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from unclip.eval.metrics import GaussianStats, clip_cosines, frechet_distance
from unclip.pipeline.auto import load_pipeline
from unclip.pipeline.output import UnCLIPOutput
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.shapes.detector import evaluate_images
from unclip.shapes.world import ShapesWorld
from unclip.utils.images import image_grid, pil_to_tensor, to_output
from unclip.utils.precision import dtype_name

__all__ = ["STAGES", "heldout_samples", "evaluate_pipeline", "binding_probe", "save_grid", "run"]

#: what ``evaluate_pipeline`` runs: the whole pipeline, up to the base decoder, or the upsamplers
#: alone on true renders
STAGES = ("all", "decoder", "upsamplers")


def heldout_samples(num: int, seed: int = 1000, resolution: int = 32):
    """``num`` single-object then ``num`` two-object held-out samples (captions + renders +
    truth)."""
    out = []
    for prob in (0.0, 1.0):
        world = ShapesWorld(resolution, seed=seed, split="heldout", two_object_prob=prob)
        out += [world[i] for i in range(num)]
    return out


def _encode_renders(pipe: UnCLIPPipeline, samples, chunk: int = 100) -> torch.Tensor:
    return torch.cat(
        [
            pipe.clip.encode_image(
                torch.stack([pil_to_tensor(s.image) for s in samples[i : i + chunk]])
            )
            for i in range(0, len(samples), chunk)
        ]
    )


def _upsample_renders(pipe: UnCLIPPipeline, renders, gens, sampling, progress) -> UnCLIPOutput:
    """The pipeline's upsamplers in turn on ``renders`` (PIL, at the decoder's resolution), timed
    per stage, as a :class:`UnCLIPOutput` like the pipeline's own (no image embeddings)."""
    x = torch.stack([pil_to_tensor(r) for r in renders]).to(pipe.device)
    out = UnCLIPOutput(images=None, image_embeds=None, stage_images={"renders": x})
    for name in pipe.upsampler_names:
        start = pipe._now()
        x = pipe.upsample(x, generator=gens, sampling=sampling, stages=[name], progress=progress)
        out.timings[name] = pipe._now() - start
        out.stage_images[name] = x
    return out


def _summary(report: dict) -> dict:
    keep = {}
    for kind in ("single", "pair"):
        keep[kind] = {k: round(v, 4) for k, v in report[kind].items() if not k.endswith("_count")}
    keep["all"] = round(report["all"], 4)
    return keep


@torch.no_grad()
def evaluate_pipeline(
    pipe: UnCLIPPipeline,
    num: int = 200,
    *,
    seed: int = 0,
    prompt_seed: int = 1000,
    batch_size: int = 50,
    sampling: dict | None = None,
    stages: str = "all",
    oracle: bool = False,
    progress: bool = False,
) -> dict:
    """Generate for the held-out prompts and score every stage (see module doc).
    ``stages="decoder"`` stops after the base decoder, ``stages="upsamplers"`` upsamples true
    renders instead of decoding (the report's ``prior_cosine_with_true_embed`` is then None);
    ``oracle`` decodes from the true renders' CLIP image embeddings.

    The report's ``_images`` (uint8 arrays of the final stage) and ``_captions`` are for
    :func:`save_grid`; drop them before writing the report."""
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    renders_only = stages == "upsamplers"
    if renders_only and oracle:
        raise ValueError(
            "oracle decodes from true image embeddings; stages='upsamplers' decodes none"
        )
    if renders_only and not pipe.upsamplers:
        raise ValueError("stages='upsamplers': this pipeline has no upsamplers to measure")
    settings = pipe.sampling_settings(sampling)
    samples = heldout_samples(num, prompt_seed, pipe.clip.image_size)
    captions = [s.caption for s in samples]
    if renders_only:  # the same scenes, rendered at the upsamplers' input size
        base = heldout_samples(num, prompt_seed, pipe.upsamplers[0].config.low_res_size)
        renders = [s.image for s in base]
    per_stage: dict[str, list] = {}
    # the prior's time stays 0 when it does not run (oracle); with renders only there is no prior
    timing: dict[str, float] = {} if renders_only else {"prior": 0.0}
    cos_prior: list[torch.Tensor] = []
    clip_img: list[torch.Tensor] = []
    text_emb: list[torch.Tensor] = []
    last = "decoder" if stages == "decoder" else None
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        gens = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        if renders_only:
            out = _upsample_renders(
                pipe, renders[start : start + batch_size], gens, sampling, progress
            )
            out.text_embeds = pipe.encode_text([s.caption for s in chunk]).text_embed
        else:
            true_embed = pipe.clip.encode_image(
                torch.stack([pil_to_tensor(s.image) for s in chunk])
            )
            out = pipe(
                [s.caption for s in chunk],
                generator=gens,
                sampling=sampling,
                output_type="pt",
                return_intermediates=True,
                progress=progress,
                image_embeds=true_embed if oracle else None,
                last_stage=last,
            )
            if out.image_embeds is not None:  # a token pipeline decodes no image embedding
                cos_prior.append(F.cosine_similarity(out.image_embeds, true_embed, dim=-1))
        for name, seconds in out.timings.items():
            timing[name] = timing.get(name, 0.0) + seconds
        for name, images in out.stage_images.items():
            per_stage.setdefault(name, []).extend(to_output(images, "uint8"))
        final = list(out.stage_images.values())[-1]  # [-1, 1], as scored by the CLIP
        clip_img.append(pipe.clip.encode_image(final))
        assert out.text_embeds is not None  # set above for every chunk
        text_emb.append(out.text_embeds)
    names = list(per_stage)
    n = len(samples)
    report: dict[str, Any] = {
        "num_prompts": {"single": num, "pair": num},
        "seed": seed,
        "prompt_seed": prompt_seed,
        "oracle_image_embeds": oracle,
        "sampling": {  # the stages that ran
            k: vars(v) for k, v in settings.items() if not renders_only or k in pipe.upsampler_names
        },
        "seconds_per_image": {k: round(v / n, 4) for k, v in timing.items()},
        # the arithmetic the networks ran in: "auto" resolves per machine
        "autocast_dtype": dtype_name(pipe.autocast_dtype),
        "stages": {},
    }
    for name in names:
        imgs = per_stage[name]
        report["stages"][name] = {
            "resolution": int(imgs[0].shape[0]),
            **_summary(evaluate_images(imgs, captions)),
        }
    img, txt = torch.cat(clip_img), torch.cat(text_emb)
    report["clip_score_100"] = round(float(100 * clip_cosines(img, txt).mean()), 2)
    res = int(per_stage[names[-1]][0].shape[0])
    real = heldout_samples(num, prompt_seed, res)
    real_feat = _encode_renders(pipe, real)
    report["clip_score_100_real_renders"] = round(
        float(100 * clip_cosines(real_feat, txt).mean()), 2
    )
    a, b = GaussianStats(), GaussianStats()
    a.update(img)
    b.update(real_feat)
    report["clip_fid"] = round(frechet_distance(*a.mu_sigma(), *b.mu_sigma()), 3)
    # the floor for this many samples: the same distance between two independent sets of real
    # renders
    other = heldout_samples(num, prompt_seed + 1, res)
    c = GaussianStats()
    c.update(_encode_renders(pipe, other))
    report["clip_fid_real_vs_real"] = round(frechet_distance(*c.mu_sigma(), *b.mu_sigma()), 3)
    report["prior_cosine_with_true_embed"] = (
        round(float(torch.cat(cos_prior).mean()), 4) if cos_prior else None
    )
    report["final_stage"] = names[-1]
    report["_images"] = per_stage[names[-1]]
    report["_captions"] = captions
    return report


#: the renders :func:`binding_probe` offers for each scene, in order (the first is the true one)
BINDING_PROBE_RENDERS = ("true scene", "colors swapped", "another relation", "another shape")


@torch.no_grad()
def binding_probe(
    pipe: UnCLIPPipeline, num: int = 200, seed: int = 5, contrast="shapes"
) -> dict[str, list[int]]:
    """Which render does the reranking rule pick? For ``num`` held-out two-object scenes (32 px,
    world seed ``seed``), the pipeline's :meth:`~UnCLIPPipeline.rerank` chooses among four clean
    renders (:data:`BINDING_PROBE_RENDERS`: the true scene, the same scene with the objects' colors
    swapped, another relation, another shape for one object), by the plain cosine and by
    ``contrast``. Returns ``{"cosine": counts, "contrast": counts}``, how often each render was
    picked."""
    import random

    from unclip.shapes.world import contrast_truth, render

    world = ShapesWorld(32, seed=seed, split="heldout", two_object_prob=1.0)
    rng = random.Random(0)
    counts = {"cosine": [0] * 4, "contrast": [0] * 4}
    for i in range(num):
        s = world[i]
        # the swap draws nothing but its attribute, so it gets its own generator and the
        # relation and shape variants below see the same draws as ever
        swapped, _ = contrast_truth(s.truth, random.Random(0), "all", {"swap": 1})
        scenes = [s.truth, swapped]
        scenes += [contrast_truth(s.truth, rng, "all", {k: 1})[0] for k in ("relation", "shape")]
        images = torch.stack([pil_to_tensor(render(x, 32)) for x in scenes])
        counts["cosine"][int(pipe.rerank(images, s.caption, 4))] += 1
        counts["contrast"][int(pipe.rerank(images, s.caption, 4, contrast=contrast))] += 1
    return counts


def save_grid(images, captions, path, num: int = 8, cols: int = 8, tile: int = 96) -> None:
    """A small grid: first ``num`` single-object and first ``num`` two-object samples, each resized
    to ``tile`` pixels; their captions go to the same path with suffix ``.txt``."""
    from PIL import Image

    half = len(images) // 2
    pick = list(range(min(num, half))) + list(range(half, half + min(num, half)))
    tiles = [
        Image.fromarray(images[i]).resize((tile, tile), Image.Resampling.BICUBIC) for i in pick
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image_grid(tiles, cols=cols).save(path, optimize=True)
    Path(path).with_suffix(".txt").write_text("\n".join(captions[i] for i in pick) + "\n")


def run(
    model: str | None = None,
    num: int = 200,
    *,
    decoder_weights: str | None = None,
    reranker: str | None = None,
    out: str | None = None,
    grid: str | None = None,
    autocast_dtype="auto",
    **settings,
) -> dict:
    """Load a pipeline (``model``: a folder, default the bundled shapes model), optionally swap its
    decoder weights (e.g. a training checkpoint's raw ``model.safetensors``, a ``repa:`` run's
    too: its alignment head is left out) or its reranker CLIP,
    evaluate it with :func:`evaluate_pipeline` (``settings``: its keyword arguments, e.g. ``seed``,
    ``sampling``, ``oracle``), write the report JSON to ``out`` and a sample grid to ``grid``;
    returns the report. ``autocast_dtype``: as in :meth:`UnCLIPPipeline.from_pretrained` (the
    report records what it resolved to)."""
    if settings.get("stages") == "upsamplers" and (decoder_weights or reranker):
        raise ValueError(
            "stages='upsamplers' runs no decoder and no reranking; drop decoder_weights/reranker"
        )
    pipe = load_pipeline(model, autocast_dtype=autocast_dtype)
    if pipe.clip is None:
        raise ValueError(
            f"{model} has no CLIP to score its images with; export the token pipeline with "
            "rerank_clip set (e.g. unclip/bundled/shapes/clip)"
        )
    if decoder_weights:
        from safetensors.torch import load_file

        from unclip.train.repa import exported_state

        state = load_file(decoder_weights)
        state = {k.removeprefix("module."): v for k, v in state.items()}
        pipe.decoder.load_state_dict(exported_state(state))
    if reranker:
        from unclip.nets.clip import CLIP

        pipe.reranker = CLIP.from_pretrained(reranker)
    report = evaluate_pipeline(pipe, num, **settings)
    images, captions = report.pop("_images"), report.pop("_captions")
    report.update(
        {
            "model": model or "bundled:shapes",
            "sampling_overrides": settings.get("sampling"),
            "decoder_weights": decoder_weights,
            "reranker": None  # nothing is reranked when only the upsamplers run
            if settings.get("stages") == "upsamplers"
            else reranker
            or ("pipeline reranker" if pipe.reranker is not None else "pipeline CLIP"),
        }
    )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    if grid:
        save_grid(images, captions, grid)
    return report
