"""``unclip evaluate``: FID, CLIP score, CLIP-FID and shapes faithfulness of a pipeline's samples.

    unclip evaluate --model PATH --shapes --out DIR
    unclip evaluate --model PATH --coco-captions captions_val2014.json --reference val2014/ \\
        --out DIR
    unclip evaluate --samples DIR --reference REF --out OUT   # score existing captioned images

The protocol (seeds, preprocessing, metrics) is described in :mod:`unclip.eval.evaluate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unclip.cli.errors import seed_type
from unclip.cli.generate import add_autocast_arg, add_hub_args


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unclip evaluate",
        description="FID, CLIP score, CLIP-FID and shapes "
        "faithfulness of a pipeline's samples (see the unclip.eval.evaluate docs).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="pipeline folder or Hugging Face Hub repo id (org/name)")
    src.add_argument(
        "--samples", help="score existing images instead: folder of images with .txt captions"
    )
    pr = p.add_mutually_exclusive_group()
    pr.add_argument("--prompts", help="UTF-8 text file, one prompt per line")
    pr.add_argument("--coco-captions", help="COCO captions JSON (e.g. captions_val2014.json)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--reference", help="reference image folder or stats .npz (enables FID)")
    p.add_argument(
        "--reference-cache",
        help="where to cache a folder's stats (default OUT/reference_stats.npz)",
    )
    p.add_argument("--allow-small-reference", action="store_true")
    p.add_argument(
        "--num-samples", type=_positive, help="default: one per prompt; COCO 30000; shapes 500"
    )
    p.add_argument("--batch-size", type=_positive, default=16)
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument(
        "--inception",
        help="local FID Inception weights (torch-fidelity's weights-inception-2015-12-05-*.pth, "
        "or .safetensors); 'random' = TEST ONLY",
    )
    p.add_argument(
        "--inception-feature",
        type=int,
        default=2048,
        choices=(64, 192, 768, 2048),
        help="Inception layer; FID is defined on 2048 (smaller ones only for quick tests)",
    )
    p.add_argument(
        "--clip-model",
        help="evaluation CLIP: open_clip model name, or a CLIP folder "
        "(default: the pipeline's own CLIP)",
    )
    p.add_argument(
        "--clip-pretrained", help="local weights of --clip-model (or an open_clip tag: downloads)"
    )
    p.add_argument(
        "--clip-fid", action="store_true", help="also Fréchet distance on CLIP image features"
    )
    p.add_argument(
        "--shapes", action="store_true", help="shapes faithfulness (held-out prompts by default)"
    )
    p.add_argument(
        "--resolution", type=int, default=256, help="evaluation side R (images resized + cropped)"
    )
    p.add_argument(
        "--sampling",
        help='JSON (or a JSON file) of per-stage overrides, e.g. {"prior": {"steps": 10}}',
    )
    p.add_argument(
        "--sample-size",
        type=int,
        default=None,
        help="the side the pipeline draws at, for one that draws at any size (Kandinsky 2.2; "
        "default: its resolution, 512); fixed-resolution pipelines refuse it",
    )
    p.add_argument(
        "--save-samples", action="store_true", help="also write OUT/samples/NNNNNN.png + .txt"
    )
    add_hub_args(p)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_autocast_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def _parse_sampling(text):
    if text is None:
        return None
    path = Path(text)
    try:
        value = json.loads(
            path.read_text() if not text.lstrip().startswith("{") and path.is_file() else text
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"--sampling is not valid JSON: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(
            '--sampling must be a JSON object of per-stage objects, e.g. {"decoder": {"steps": 10}}'
        )
    return value


def main(argv=None) -> int:
    """Returns 0; user errors raise ``ValueError``/``TypeError``/``OSError``, which the command
    runner prints on one line with exit status 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    from unclip.eval.evaluate import check_samples_metrics, evaluate, report_markdown

    # before anything loads: a one-line error with status 1
    check_samples_metrics(args.samples, args.reference, args.clip_model, args.shapes)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = evaluate(
        args.out,
        model=args.model,
        revision=args.revision,
        cache_dir=args.cache_dir,
        samples=args.samples,
        prompts_file=args.prompts,
        coco_captions=args.coco_captions,
        shapes=args.shapes,
        reference=args.reference,
        reference_cache=args.reference_cache,
        allow_small_reference=args.allow_small_reference,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        seed=args.seed,
        inception_weights=args.inception,
        inception_feature=args.inception_feature,
        clip_model=args.clip_model,
        clip_pretrained=args.clip_pretrained,
        clip_fid=args.clip_fid,
        resolution=args.resolution,
        sampling=_parse_sampling(args.sampling),
        sample_size=args.sample_size,
        save_samples=args.save_samples,
        device=device,
        progress=not args.no_progress,
        autocast_dtype=args.autocast,
    )
    print(report_markdown(report))
    print(f"wrote {Path(args.out) / 'report.json'}, report.md, grid.png")
    return 0


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip evaluate", main, sys.argv[1:]))
