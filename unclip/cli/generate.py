"""``unclip generate``: text → images with a pipeline folder (or the bundled model), from the shell.

    unclip generate "a small red circle on the left" --num-images 4 --seed 0 --out samples/
    unclip generate "a cat" "a dog" --model path/to/pipeline --decoder-steps 50 \\
        --decoder-guidance-scale 5 --decoder-best-of 4
    unclip generate "a cat" --model org/name --revision v1.0   # a Hugging Face Hub repo
    unclip generate "a small pink circle on the left" --lora runs/pink/final/decoder_lora:0.8

Writes one PNG per image, ``grid.png`` (the first 64 images) and ``generate.json`` with every
setting needed to reproduce the result (prompts, per-prompt seeds, model, per-stage sampling
settings, batch size, versions). Images are sampled and written ``--batch-size`` at a time, so
``--num-images 10000`` needs no more memory than one batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from unclip.cli import STARTED
from unclip.cli.errors import seed_type
from unclip.diffusion.config import SCHEDULERS

#: the sampler names ``--help`` lists (unclip.diffusion.schedulers.SCHEDULER_ALIASES, without
#: importing diffusers for ``--help``)
SAMPLER_NAMES = (*SCHEDULERS, "euler", "euler_a", "heun", "unipc", "deis", "dpm2", "dpm++2s", "lms")

__all__ = [
    "main",
    "build_parser",
    "add_autocast_arg",
    "add_hub_args",
    "add_sampling_args",
    "sampling_overrides",
]

#: ``--batch-size`` default; equals ``unclip.pipeline.jobs.DEFAULT_BATCH_SIZE`` (kept here so that
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
#: the autoregressive prior's own settings: (flag suffix, SamplingConfig field, type, help)
AR_FLAGS = (
    ("temperature", "temperature", float, "sampling temperature of the codes (default 1)"),
    ("top-k", "top_k", int, "sample among the k most likely codes only"),
    ("top-p", "top_p", float, "sample in the nucleus of probability p, in (0, 1]"),
    (
        "dot-product-quantile",
        "dot_product_quantile",
        float,
        "quantile in [0, 1] of the training text-image cosines to condition on (default: drawn "
        "from the top half, as the paper)",
    ),
)


def add_hub_args(p: argparse.ArgumentParser) -> None:
    """``--revision`` and ``--cache-dir``, for a model given as a Hub repo id."""
    p.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of a Hub repo id given as the model (default: main)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="Hugging Face Hub cache folder (default: HF_HUB_CACHE, ~/.cache/huggingface/hub); "
        "HF_HUB_OFFLINE=1 loads from it without the network",
    )


#: ``--autocast`` choices (unclip.utils.precision.parse_autocast reads them)
AUTOCAST_CHOICES = ("auto", "bf16", "fp16", "none")


def add_autocast_arg(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--autocast``: the arithmetic of the denoising networks (UnCLIPPipeline.autocast_dtype)."""
    p.add_argument(
        "--autocast",
        choices=AUTOCAST_CHOICES,
        default=default,
        help="arithmetic of the denoising networks: auto (fp16 on a GPU, bf16 on a CPU that runs "
        "it natively, else full precision), bf16, fp16, or none (full precision). Default: auto",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """``--{prior,decoder,upsampler}-{scheduler,steps,guidance-scale}``, ``--prior-best-of``,
    ``--decoder-best-of[-contrasted]``, ``--decoder-rerank-at``, ``--decoder-prune-{at,keep}``
    and the autoregressive prior's
    ``--prior-{temperature,top-k,top-p,dot-product-quantile}``; :func:`sampling_overrides` turns
    them into ``sampling=``."""
    for prefix, _, label in STAGES:
        p.add_argument(
            f"--{prefix}-scheduler",
            metavar="NAME",
            help=f"{label} sampler: {', '.join(SAMPLER_NAMES)}, or a diffusers scheduler class "
            "name",
        )
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
    ar = p.add_argument_group("autoregressive prior (prior.type: ar) only")
    for flag, field, kind, text in AR_FLAGS:
        ar.add_argument(f"--prior-{flag}", type=kind, dest=f"prior_{field}", help=text)
    p.add_argument(
        "--decoder-best-of",
        type=int,
        help="decode K base-resolution candidates per image and keep the best by the reranking "
        "CLIP (the pipeline's reranker CLIP if it has one; scored as --decoder-rerank-contrast "
        "says); 1 turns reranking off; given alone, every prompt draws K (default: the model's "
        "setting)",
    )
    p.add_argument(
        "--decoder-best-of-contrasted",
        type=_count_or_none,
        metavar="K",
        help="candidates per image for prompts --decoder-rerank-contrast has alternatives for "
        "(the bundled model: 24 for two-object prompts, 12 for the rest); 'none': "
        "--decoder-best-of for every prompt (default: the model's setting)",
    )
    p.add_argument(
        "--decoder-rerank-at",
        type=_step_or_none,
        metavar="STEP",
        help="with --decoder-best-of > 1: choose among the candidates after this many decoder "
        "steps, from each one's predicted final image, and finish only the chosen (fewer network "
        "calls); 'none' chooses among the finished images (default: the model's setting)",
    )
    p.add_argument(
        "--decoder-rerank-contrast",
        type=_contrast_or_none,
        metavar="NAME",
        help="with --decoder-best-of > 1: score the candidates by how much the CLIP prefers the "
        "prompt over alternatives of it ('shapes': a shapes caption's one-attribute variants and "
        "swaps; 'shapes-pairs': the same for two-object captions only; 'shapes-pairs-regions': "
        "'shapes-pairs' plus each object read on its own side of the image) instead of by plain "
        "CLIP score; 'none' turns it off (default: the model's setting)",
    )
    p.add_argument(
        "--decoder-prune-at",
        type=_step_or_none,
        metavar="STEP",
        help="with --decoder-rerank-at: keep only each image's --decoder-prune-keep best "
        "candidates after this earlier step, then choose among them (fewer network calls); "
        "'none' turns pruning off (default: the model's setting)",
    )
    p.add_argument(
        "--decoder-prune-keep",
        type=int,
        metavar="N",
        help="candidates per image kept at --decoder-prune-at (default: the model's setting)",
    )


def _contrast_or_none(text: str) -> str:
    """``--decoder-rerank-contrast``'s value: a registered name, or ``none``."""
    from unclip.sampling.scorers import RERANK_CONTRASTS

    name = text.strip()
    if name.lower() == "none":
        return "none"
    if name not in RERANK_CONTRASTS:
        raise argparse.ArgumentTypeError(
            f"expected one of {sorted(RERANK_CONTRASTS)} or 'none', got {text!r}"
        )
    return name


def _int_or_none(what: str):
    """An argparse ``type=`` taking an integer (``what``), or ``none`` to clear a model's
    setting."""

    def parse(text: str):
        if text.strip().lower() == "none":
            return "none"
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} or 'none', got {text!r}") from None

    return parse


#: ``--decoder-rerank-at`` / ``--decoder-prune-at`` and ``--decoder-best-of-contrasted``
_step_or_none = _int_or_none("a step number")
_count_or_none = _int_or_none("a number of candidates")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The ``sampling=`` overrides given by :func:`add_sampling_args`' flags."""
    out = {}
    for prefix, key, _ in STAGES:
        values = {
            field: getattr(args, f"{prefix}_{flag}")
            for flag, field in FIELDS
            if getattr(args, f"{prefix}_{flag}") is not None
        }
        extra = {
            "prior": ["best_of", *(f for _, f, _, _ in AR_FLAGS)],
            "decoder": [
                "best_of",
                "best_of_contrasted",
                "rerank_at",
                "rerank_contrast",
                "prune_at",
                "prune_keep",
            ],
        }.get(prefix, ["best_of"])
        for field in extra:
            value = getattr(args, f"{prefix}_{field}", None)
            if value is not None:
                values[field] = None if value == "none" else value
        if "prune_at" in values and values["prune_at"] is None:
            values.setdefault("prune_keep", None)  # 'none' turns pruning off as a whole
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
        help="pipeline folder, diffusers/Karlo unCLIP folder, Hugging Face Hub repo id of either "
        "(org/name), or 'shapes' (bundled, default)",
    )
    add_hub_args(p)
    p.add_argument(
        "--tiny", action="store_true", help="use a random untrained tiny pipeline (smoke test)"
    )
    p.add_argument("--num-images", type=int, default=1, help="images per prompt")
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="images sampled at once (each from --decoder-best-of or --decoder-best-of-contrasted "
        "candidates); more images are "
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
    add_autocast_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
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
    from unclip.nets.lora import parse_lora_spec
    from unclip.pipeline.jobs import generate_to_folder

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
        revision=args.revision,
        cache_dir=args.cache_dir,
        lora=[parse_lora_spec(spec) for spec in args.lora],
        autocast_dtype=args.autocast,
        command=["unclip", "generate", *(argv if argv is not None else sys.argv[1:])],
    )
    n = len(record["files"])
    # the run's own time, and the time since the process started (imports take seconds)
    total = time.monotonic() - STARTED
    print(
        f"wrote {n} image{'' if n == 1 else 's'} ({record['resolution']}px) + grid.png + "
        f"generate.json to {args.out} in {record['seconds']:.1f}s ({total:.1f}s since start)"
    )
    if args.tiny:  # after the run: a failed run's stderr is its one error line
        print("note: --tiny is a small *untrained* random pipeline; its images are noise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
