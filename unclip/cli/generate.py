"""``unclip generate``: text → images with a pipeline folder (or the bundled model), from the shell.

    unclip generate "a small red circle on the left" --num-images 4 --seed 0 --out samples/
    unclip generate "a cat" "a dog" --model path/to/pipeline --decoder-steps 50 --decoder-guidance 5

Writes one PNG per image, ``grid.png`` and ``generate.json`` with every setting needed to reproduce the
result (prompts, per-prompt seeds, model, per-stage sampler/steps/guidance, versions).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from unclip.config import to_dict

__all__ = ["main", "make_grid", "add_sampling_args", "sampling_overrides"]


def make_grid(images: list, cols: int | None = None) -> Image.Image:
    """Tile equally sized PIL images into one grid image."""
    if not images:
        raise ValueError("make_grid needs at least one image")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), (255, 255, 255))
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols) * h))
    return grid


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    for stage, label in (("prior", "prior"), ("decoder", "decoder"), ("sr", "every upsampler")):
        p.add_argument(
            f"--{stage}-sampler",
            choices=["ddpm", "ddim", "dpm++", "unclip"],
            help=f"{label} sampler",
        )
        p.add_argument(f"--{stage}-steps", type=int, help=f"{label} sampling steps")
        p.add_argument(
            f"--{stage}-guidance", type=float, help=f"{label} classifier-free guidance scale"
        )
    p.add_argument(
        "--prior-best-of", type=int, help="prior candidates per image, best by text similarity"
    )


def sampling_overrides(args) -> dict:
    out = {}
    for stage, key in (("prior", "prior"), ("decoder", "decoder"), ("sr", "upsamplers")):
        d = {}
        for opt, field in (
            ("sampler", "scheduler"),
            ("steps", "steps"),
            ("guidance", "guidance_scale"),
        ):
            v = getattr(args, f"{stage}_{opt}")
            if v is not None:
                d[field] = v
        if d:
            out[key] = d
    if args.prior_best_of is not None:
        out.setdefault("prior", {})["best_of"] = args.prior_best_of
    if getattr(args, "rerank", None) is not None:
        out.setdefault("decoder", {})["best_of"] = args.rerank
    return out


def load_pipeline(args):
    from unclip.pipeline import UnCLIPPipeline

    if args.tiny:
        from unclip.tiny import tiny_pipeline

        print(
            "note: --tiny builds a small *untrained* random pipeline on the fly; its images are noise",
            file=sys.stderr,
        )
        return tiny_pipeline(), "tiny (random, untrained)"
    return UnCLIPPipeline.from_pretrained(args.model), str(args.model or "shapes")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="unclip generate", description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="*", help="one or more prompts")
    p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line")
    p.add_argument(
        "--model",
        default=None,
        help="pipeline folder, diffusers/Karlo unCLIP folder, or 'shapes' (bundled, default)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="use a random untrained tiny pipeline (smoke test)"
    )
    p.add_argument("--num-images", type=int, default=1, help="images per prompt")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed S+i")
    p.add_argument(
        "--rerank",
        type=int,
        default=None,
        help="decode K base-resolution candidates per image and keep the best by CLIP score (the "
        "pipeline's reranker CLIP if it has one) (default: the model's decoder best_of setting; "
        "1 turns reranking off)",
    )
    p.add_argument("--out", default="samples", help="output folder")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--no-progress", action="store_true")
    add_sampling_args(p)
    args = p.parse_args(argv)
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            prompts += [
                l.strip()
                for l in Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
                if l.strip()
            ]
        except UnicodeDecodeError as exc:
            p.error(f"{args.prompts_file} is not UTF-8 text ({exc})")
    if not prompts:
        p.error("give at least one prompt (or --prompts-file)")
    if any(not s.strip() for s in prompts):
        p.error("prompts must not be empty strings")
    if args.num_images < 1 or (args.rerank is not None and args.rerank < 1):
        p.error("--num-images and --rerank must be >= 1")
    pipe, model_name = load_pipeline(args)
    pipe.to(args.device)
    sampling = sampling_overrides(args)
    for stage in pipe.stage_names:  # validate before compute
        pipe._settings(stage, sampling)
    seeds = [args.seed + i for i in range(len(prompts))]
    gens = [torch.Generator(device=args.device).manual_seed(s) for s in seeds]
    t0 = time.perf_counter()
    out = pipe(
        prompts,
        num_images_per_prompt=args.num_images,
        generator=gens,
        sampling=sampling,
        progress=not args.no_progress,
    )
    seconds = time.perf_counter() - t0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for i, prompt in enumerate(prompts):
        for j in range(args.num_images):
            f = out_dir / f"{i:03d}_{j:02d}.png"
            out.images[i * args.num_images + j].save(f)
            files.append({"file": f.name, "prompt": prompt, "seed": seeds[i], "index": j})
    make_grid(out.images, cols=args.num_images if len(prompts) > 1 else None).save(
        out_dir / "grid.png"
    )
    import unclip

    record = {
        "model": model_name,
        "prompts": prompts,
        "seeds": seeds,
        "num_images_per_prompt": args.num_images,
        "rerank_candidates": pipe._settings("decoder", sampling).best_of,
        "rerank_clip": "reranker" if pipe.reranker is not None else "clip",
        "device": args.device,
        "resolution": pipe.resolution,
        "sampling": {s: to_dict(pipe._settings(s, sampling)) for s in pipe.stage_names},
        "seconds": round(seconds, 3),
        "files": files,
        "grid": "grid.png",
        "versions": {"unclip": unclip.__version__, "torch": torch.__version__},
        "command": ["unclip", "generate", *(argv if argv is not None else sys.argv[1:])],
    }
    (out_dir / "generate.json").write_text(json.dumps(record, indent=2))
    print(
        f"wrote {len(files)} images ({pipe.resolution}px) + grid.png + generate.json to {out_dir} in {seconds:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
