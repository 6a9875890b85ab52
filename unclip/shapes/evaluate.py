"""Measure a shapes pipeline on the held-out split (the figures of ``docs/shapes_model.md``).

    python -m unclip.shapes.evaluate                       # the bundled model, 200 + 200 prompts
    python -m unclip.shapes.evaluate --model runs/shapes/pipeline --num 200 --out report.json \\
        --grid docs/shapes_grid.png
    python -m unclip.shapes.evaluate --model P --num 60 --stages decoder \\
        --sampling '{"decoder": {"guidance_scale": 5}}'      # one point of a sampler/guidance sweep
    python -m unclip.shapes.evaluate --model P --oracle    # decoder from the true CLIP image embeddings

Prompts: captions of the held-out split (``ShapesWorld(split="heldout")``, seed ``--prompt-seed``), ``--num``
single-object and ``--num`` two-object ones. Image ``i`` is sampled with its own generator seeded
``seed + i``. For every stage (decoder, each upsampler) the images are scored with
:func:`unclip.shapes.detector.evaluate_images`; the final images also get the CLIP score (100 × cosine
between the pipeline CLIP's image and text embeddings), a CLIP-FID (Fréchet distance between the pipeline
CLIP's image features of the samples and of real held-out renders at the same resolution, with
:func:`unclip.eval.metrics.frechet_distance`; ``clip_fid_real_vs_real`` is the same distance between two independent
sets of real renders, the floor for this sample size) and the prior's cosine with the true renders' image
embeddings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from unclip.pipeline import UnCLIPPipeline, to_output
from unclip.shapes.detector import evaluate_images
from unclip.shapes.world import ShapesWorld
from unclip.train.data.loader import pil_to_tensor

__all__ = ["heldout_samples", "evaluate_pipeline", "main"]


def heldout_samples(num: int, seed: int = 1000, resolution: int = 32):
    """``num`` single-object then ``num`` two-object held-out samples (captions + renders + truth)."""
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
    """Generate for the held-out prompts and score every stage (see module doc). ``stages="decoder"``
    stops after the base decoder; ``oracle`` decodes from the true renders' CLIP image embeddings."""
    samples = heldout_samples(num, prompt_seed, pipe.clip.image_size)
    captions = [s.caption for s in samples]
    per_stage: dict[str, list] = {}
    timing: dict[str, float] = {}
    cos_prior, clip_img, text_emb = [], [], []
    names = ["decoder"] + ([] if stages == "decoder" else pipe.upsampler_names)
    k = pipe._settings(
        "decoder", sampling
    ).best_of  # CLIP reranking of decoder candidates, as pipe(...) does
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        caps = [s.caption for s in chunk]
        gens = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        gens_k = [g for g in gens for _ in range(k)]
        t0 = time.perf_counter()
        text = pipe.encode_text(caps)
        text_k = text.repeat_interleave(k)
        true_embed = pipe.clip.encode_image(torch.stack([pil_to_tensor(s.image) for s in chunk]))
        if oracle:
            embeds = true_embed.repeat_interleave(k, dim=0)
        else:
            embeds = pipe.sample_image_embeds(
                text_k, generator=gens_k, sampling=sampling, progress=progress
            )
        t1 = time.perf_counter()
        timing["prior"] = timing.get("prior", 0.0) + (t1 - t1 if oracle else t1 - t0)
        x = pipe.decode(embeds, text_k, gens_k, sampling, progress=progress)
        keep = pipe.rerank(x, caps, k)
        x, embeds = x[keep], embeds[keep]
        cos_prior.append(torch.nn.functional.cosine_similarity(embeds, true_embed, dim=-1))
        t2 = time.perf_counter()
        timing["decoder"] = timing.get("decoder", 0.0) + t2 - t1
        per_stage.setdefault("decoder", []).extend(to_output(x, "np"))
        for name, up in zip(pipe.upsampler_names, pipe.upsamplers):
            if name not in names:
                break
            t3 = time.perf_counter()
            x = pipe.upsample(x, gens, sampling, stages=[name], progress=progress)
            timing[name] = timing.get(name, 0.0) + time.perf_counter() - t3
            per_stage.setdefault(name, []).extend(to_output(x, "np"))
        clip_img.append(pipe.clip.encode_image(x))
        text_emb.append(text.text_embed)
    n = len(samples)
    report = {
        "num_prompts": {"single": num, "pair": num},
        "seed": seed,
        "prompt_seed": prompt_seed,
        "oracle_image_embeds": oracle,
        "sampling": {k: vars(pipe._settings(k, sampling)) for k in pipe.stage_names},
        "seconds_per_image": {k: round(v / n, 4) for k, v in timing.items()},
        "stages": {},
    }
    for name in names:
        imgs = per_stage[name]
        report["stages"][name] = {
            "resolution": int(imgs[0].shape[0]),
            **_summary(evaluate_images(imgs, captions)),
        }
    img, txt = torch.cat(clip_img), torch.cat(text_emb)
    from unclip.eval.metrics import GaussianStats, clip_cosines, frechet_distance

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
    # the floor for this many samples: the same distance between two independent sets of real renders
    other = heldout_samples(num, prompt_seed + 1, res)
    c = GaussianStats()
    c.update(_encode_renders(pipe, other))
    report["clip_fid_real_vs_real"] = round(frechet_distance(*c.mu_sigma(), *b.mu_sigma()), 3)
    report["prior_cosine_with_true_embed"] = round(float(torch.cat(cos_prior).mean()), 4)
    report["final_stage"] = names[-1]
    report["_images"] = per_stage[names[-1]]
    report["_captions"] = captions
    return report


def save_grid(images, captions, path, num: int = 8, cols: int = 8, tile: int = 96) -> None:
    """A small grid: first ``num`` single-object and first ``num`` two-object samples."""
    from PIL import Image

    half = len(images) // 2
    pick = list(range(min(num, half))) + list(range(half, half + min(num, half)))
    rows = (len(pick) + cols - 1) // cols
    grid = Image.new("RGB", (cols * tile, rows * tile), (255, 255, 255))
    for k, i in enumerate(pick):
        im = Image.fromarray(images[i]).resize((tile, tile), Image.BICUBIC)
        grid.paste(im, ((k % cols) * tile, (k // cols) * tile))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, optimize=True)
    Path(path).with_suffix(".txt").write_text("\n".join(captions[i] for i in pick) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m unclip.shapes.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model", default=None, help="pipeline folder (default: the bundled shapes model)"
    )
    p.add_argument("--num", type=int, default=200, help="prompts per kind (single, two-object)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seed", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument(
        "--sampling",
        default=None,
        help='JSON overrides, e.g. \'{"decoder": {"guidance_scale": 5}}\'',
    )
    p.add_argument("--stages", choices=("all", "decoder"), default="all")
    p.add_argument(
        "--oracle", action="store_true", help="decode from the true renders' CLIP image embeddings"
    )
    p.add_argument(
        "--decoder-weights",
        default=None,
        help="load these decoder weights instead (e.g. a training checkpoint's raw, non-EMA model.safetensors)",
    )
    p.add_argument(
        "--reranker",
        default=None,
        help="CLIP folder to score the decoder candidates with instead of the pipeline's own reranker/CLIP",
    )
    p.add_argument("--out", default=None, help="write the report JSON here")
    p.add_argument("--grid", default=None, help="write a small sample grid PNG here")
    args = p.parse_args(argv)
    pipe = UnCLIPPipeline.from_pretrained(args.model)
    if args.decoder_weights:
        from safetensors.torch import load_file

        state = load_file(args.decoder_weights)
        state = {k.removeprefix("module."): v for k, v in state.items()}
        pipe.decoder.load_state_dict(state)
    if args.reranker:
        from unclip.clip import FrozenCLIP

        pipe.reranker = FrozenCLIP.from_pretrained(args.reranker)
    sampling = json.loads(args.sampling) if args.sampling else None
    report = evaluate_pipeline(
        pipe,
        args.num,
        seed=args.seed,
        prompt_seed=args.prompt_seed,
        batch_size=args.batch_size,
        sampling=sampling,
        stages=args.stages,
        oracle=args.oracle,
    )
    images, captions = report.pop("_images"), report.pop("_captions")
    report.update(
        {
            "model": args.model or "bundled:shapes",
            "sampling_overrides": sampling,
            "decoder_weights": args.decoder_weights,
            "reranker": args.reranker
            or ("pipeline reranker" if pipe.reranker is not None else "pipeline CLIP"),
        }
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.grid:
        save_grid(images, captions, args.grid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
