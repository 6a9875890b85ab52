"""``unclip generate``: text → images with a pipeline folder (or the bundled model), from the shell.

    unclip generate "a small red circle on the left" --num-images 4 --seed 0 --out samples/
    unclip generate "a cat" "a dog" --model path/to/pipeline --decoder-steps 50 \\
        --decoder-guidance-scale 5 --decoder-best-of 4
    unclip generate "a small pink circle on the left" --lora runs/pink/final/decoder_lora:0.8

Writes one PNG per image, ``grid.png`` (the first 64 images) and ``generate.json`` with every
setting needed to reproduce the result (prompts, per-prompt seeds, model, per-stage sampling
settings, batch size, versions). Images are sampled and written ``--batch-size`` at a time, so
``--num-images 10000`` needs no more memory than one batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unclip.cli.errors import seed_type
from unclip.config import SCHEDULERS

__all__ = ["main", "build_parser", "add_sampling_args", "sampling_overrides"]

#: ``--batch-size`` default; equals ``unclip.output.DEFAULT_BATCH_SIZE`` (kept here so that
#: ``--help`` imports no torch)
DEFAULT_BATCH_SIZE = 16
#: (flag prefix, ``sampling=`` key, help label)
STAGES = (
    ("prior", "prior", "prior"),
    ("decoder", "decoder", "decoder"),
    ("upsampler", "upsampler", "every upsampler"),
)
#: (flag suffix, SamplingConfig field)
FIELDS = (("scheduler", "scheduler"), ("steps", "steps"), ("guidance_scale", "guidance_scale"))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """``--{prior,decoder,upsampler}-{scheduler,steps,guidance-scale}``, ``--prior-best-of`` and
    ``--decoder-best-of``; :func:`sampling_overrides` turns them into ``sampling=``."""
    for prefix, _, label in STAGES:
        p.add_argument(f"--{prefix}-scheduler", choices=SCHEDULERS, help=f"{label} sampler")
        p.add_argument(f"--{prefix}-steps", type=int, help=f"{label} sampling steps")
        p.add_argument(
            f"--{prefix}-guidance-scale",
            type=float,
            help=f"{label} classifier-free guidance scale",
        )
    p.add_argument(
        "--prior-best-of",
        type=int,
        help="prior candidates per image; the one closest to the text embedding is kept",
    )
    p.add_argument(
        "--decoder-best-of",
        type=int,
        help="decode K base-resolution candidates per image and keep the best by CLIP score (the "
        "pipeline's reranker CLIP if it has one); 1 turns reranking off (default: the model's "
        "setting)",
    )


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The ``sampling=`` overrides given by :func:`add_sampling_args`' flags."""
    out = {}
    for prefix, key, _ in STAGES:
        values = {
            field: getattr(args, f"{prefix}_{flag}")
            for flag, field in FIELDS
            if getattr(args, f"{prefix}_{flag}") is not None
        }
        best_of = getattr(args, f"{prefix}_best_of", None)
        if best_of is not None:
            values["best_of"] = best_of
        if values:
            out[key] = values
    return out


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="images sampled at once (each from --decoder-best-of candidates); more images are "
        "sampled and written batch by batch, so memory stays bounded; a prompt whose images span "
        "batches continues its seed's random stream, so such images depend on the batch size "
        "(default: %(default)s)",
    )
    p.add_argument("--seed", type=seed_type, default=0, help="prompt i uses seed S+i")
    p.add_argument(
        "--negative",
        default=None,
        metavar="TEXT",
        help="a negative prompt: replaces the empty caption in the prior's and the decoder's "
        "guidance, steering every image away from it",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA adapter folder (<output_dir>/final/<stage>_lora of a train.lora run) loaded "
        "onto the stage it was trained for, with its strength (default 1); repeatable",
    )
    p.add_argument("--out", default="samples", help="output folder")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--no-progress", action="store_true")
    add_sampling_args(p)
    return p


def _prompts(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            p.error(f"{args.prompts_file} is not UTF-8 text ({exc})")
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        p.error("give at least one prompt (or --prompts-file)")
    if any(not s.strip() for s in prompts):
        p.error("prompts must not be empty strings")
    if args.num_images < 1:
        p.error("--num-images must be >= 1")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    return prompts


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    prompts = _prompts(p, args)
    from unclip.lora import parse_lora_spec
    from unclip.pipeline import generate_to_folder

    record = generate_to_folder(
        args.model,
        prompts,
        args.out,
        num_images_per_prompt=args.num_images,
        seed=args.seed,
        sampling=sampling_overrides(args),
        device=args.device,
        progress=not args.no_progress,
        tiny=args.tiny,
        batch_size=args.batch_size,
        negative_prompt=args.negative,
        lora=[parse_lora_spec(spec) for spec in args.lora],
        command=["unclip", "generate", *(argv if argv is not None else sys.argv[1:])],
    )
    print(
        f"wrote {len(record['files'])} images ({record['resolution']}px) + grid.png + "
        f"generate.json to {args.out} in {record['seconds']:.1f}s"
    )
    if args.tiny:  # after the run: a failed run's stderr is its one error line
        print("note: --tiny is a small *untrained* random pipeline; its images are noise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
