"""``unclip edit``: edit images with a pipeline (default: the bundled shapes model).

    unclip edit invert photo.png --steps 20 --out inv/
    unclip edit text-diff photo.png --source "a red circle on the left" \\
        --target "a blue circle on the left" --frames 5 --out diff/
    unclip edit interpolate a.png b.png --frames 5 --out interp/
    unclip edit inpaint photo.png mask.png "a green triangle to the right of a red circle" \\
        --num-images 4 --out inpaint/
    unclip edit img2img photo.png "a blue square" --strength 0.6 --num-images 4 --out i2i/

Each writes one PNG per image, ``grid.png`` and ``edit.json`` (the command, inputs, settings, seed,
per-image values such as θ or strength, the inversion's round-trip error, seconds). Masks: the
image's size, white = regenerate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from unclip.cli.errors import seed_type
from unclip.cli.generate import add_autocast_arg, add_sampling_args, sampling_overrides

__all__ = ["main", "build_parser"]


def _common(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="pipeline folder, diffusers/Karlo unCLIP folder, or 'shapes' (bundled, default)",
    )
    p.add_argument("--seed", type=seed_type, default=0, help="random seed")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_autocast_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    if sampling:
        add_sampling_args(p)


def _ddim(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=50, help="DDIM steps of inversion and decoding")
    p.add_argument(
        "--guidance-scale",
        type=float,
        default=1.0,
        help="decoder guidance of inversion and decoding (1 inverts best)",
    )
    p.add_argument(
        "--fixed-point",
        type=int,
        default=2,
        help="fixed-point iterations refining each inversion step (0: plain DDIM inversion)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unclip edit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="edit", required=True, metavar="EDIT")

    q = sub.add_parser("invert", help="DDIM-invert an image and report the round-trip error")
    q.add_argument("image")
    q.add_argument("--caption", default=None, help="decoder caption (default: the empty one)")
    _ddim(q)
    _common(q, sampling=False)

    q = sub.add_parser("text-diff", help="move an image along a caption difference (paper §3.3)")
    q.add_argument("image")
    q.add_argument("--source", required=True, help="a caption of the image as it is")
    q.add_argument("--target", required=True, help="the caption it should move towards")
    q.add_argument("--frames", type=int, default=5, help="θ values from 0 to --max-theta")
    q.add_argument("--max-theta", type=float, default=0.5)
    q.add_argument("--caption", default=None, help="decoder caption (default: the empty one)")
    _ddim(q)
    _common(q)

    q = sub.add_parser("interpolate", help="interpolate two images keeping their inverted latents")
    q.add_argument("start")
    q.add_argument("end")
    q.add_argument("--frames", type=int, default=5)
    q.add_argument("--caption", default=None, help="decoder caption (default: the empty one)")
    _ddim(q)
    _common(q)

    q = sub.add_parser("inpaint", help="regenerate the masked region to a prompt")
    q.add_argument("image")
    q.add_argument("mask", help="the image's size, white = regenerate")
    q.add_argument("prompt", help="a caption of the whole edited image")
    q.add_argument("--num-images", type=int, default=1)
    q.add_argument("--resample", type=int, default=4, help="RePaint passes per decoder step")
    q.add_argument("--negative", default=None, metavar="TEXT", help="a negative prompt")
    _common(q)

    q = sub.add_parser("img2img", help="noise an image to a level and denoise it to a prompt")
    q.add_argument("image")
    q.add_argument("prompt")
    q.add_argument("--strength", type=float, default=0.6, help="in (0, 1]: how much may change")
    q.add_argument("--num-images", type=int, default=1)
    q.add_argument("--negative", default=None, metavar="TEXT", help="a negative prompt")
    _common(q)
    return p


def _save(images, folder: Path, record: dict) -> dict:
    from unclip.utils.files import write_file
    from unclip.utils.images import image_grid, save_image

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i, im in enumerate(images):
        f = folder / f"{i:03d}.png"
        save_image(im, f)
        files.append(f.name)
    grid = image_grid(images, cols=len(images) if len(images) <= 8 else None)
    save_image(grid, folder / "grid.png")
    record = {**record, "files": files, "grid": "grid.png"}
    text = json.dumps(record, indent=2)
    write_file(folder / "edit.json", lambda tmp: tmp.write_text(text))
    return record


def run(args: argparse.Namespace, argv) -> dict:
    import torch

    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.utils.config import to_dict
    from unclip.utils.devices import check_device
    from unclip.utils.files import check_output_folder
    from unclip.utils.images import to_output
    from unclip.utils.limits import check_fits
    from unclip.utils.precision import dtype_name

    folder = check_output_folder(args.out)  # before loading a model
    device = check_device(args.device)
    for name in ("num_images", "frames", "steps"):
        if getattr(args, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "fixed_point", 0) < 0:
        raise ValueError("--fixed-point must be >= 0 (0: plain DDIM inversion)")
    pipe = UnCLIPPipeline.from_pretrained(args.model, autocast_dtype=args.autocast).to(device)
    if hasattr(args, "frames"):  # every frame is decoded and kept until the grid is written
        size = pipe.resolution
        what = f"4 float32 {size}px images per frame"
        check_fits("--frames", args.frames, 4 * 3 * size * size * 4, what)
    gen = torch.Generator().manual_seed(args.seed)
    progress = not args.no_progress
    sampling = sampling_overrides(args) if hasattr(args, "prior_steps") else None
    ddim_decode = args.edit in ("text-diff", "interpolate")
    if ddim_decode and sampling and set(sampling) - {"upsampler"}:
        raise ValueError(
            f"unclip edit {args.edit} decodes from the inverted latents with DDIM: set the "
            "decoder with --steps and --guidance-scale (only --upsampler-* settings apply)"
        )
    if sampling is not None:
        pipe.sampling_settings(sampling)  # a bad override fails before any compute
    record = {
        "edit": args.edit,
        "model": str(args.model or "shapes"),
        "seed": args.seed,
        "autocast_dtype": dtype_name(pipe.autocast_dtype),  # as resolved on this machine
        "command": ["unclip", "edit", *argv],
    }
    t0 = time.perf_counter()
    # the decoder's DDIM of the inversion-based edits: the inversion and the decode from it
    ddim = {}
    if args.edit in ("invert", "text-diff", "interpolate"):
        ddim = {k: getattr(args, k) for k in ("steps", "guidance_scale", "caption", "fixed_point")}
    if args.edit == "invert":
        inv = pipe.invert(args.image, progress=progress, **ddim)
        images = to_output(torch.cat([inv.image, inv.reconstruction]), "pil")
        record.update(
            image=args.image,
            caption=args.caption,
            steps=inv.steps,
            guidance_scale=inv.guidance_scale,
            fixed_point=inv.fixed_point,
            inversion_error=inv.error,
            images=["input at the decoder's resolution", "reconstruction"],
        )
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({"latents": inv.latents.cpu().contiguous()}, str(folder / "latents.safetensors"))
        record["latents"] = "latents.safetensors"
    else:
        common = {"sampling": sampling, "progress": progress}
        if args.edit == "text-diff":
            out = pipe.text_diff(
                args.image,
                args.source,
                args.target,
                args.frames,
                args.max_theta,
                generator=gen,
                **ddim,
                **common,
            )
            record.update(image=args.image, source=args.source, target=args.target)
        elif args.edit == "interpolate":
            out = pipe.interpolate_inverted(
                args.start, args.end, args.frames, generator=gen, **ddim, **common
            )
            record.update(start=args.start, end=args.end)
        elif args.edit == "inpaint":
            out = pipe.inpaint(
                args.image,
                args.mask,
                args.prompt,
                args.num_images,
                args.resample,
                gen,
                negative_prompt=args.negative,
                **common,
            )
            record.update(image=args.image, mask=args.mask, prompt=args.prompt)
        else:
            out = pipe.img2img(
                args.image,
                args.prompt,
                args.strength,
                args.num_images,
                gen,
                negative_prompt=args.negative,
                **common,
            )
            record.update(image=args.image, prompt=args.prompt)
        images = out.images
        record.update(out.info)
        record["sampling"] = {k: to_dict(v) for k, v in pipe.sampling_settings(sampling).items()}
        if ddim_decode:  # the decoder ran the inversion's DDIM, not its own settings
            record["sampling"]["decoder"] = {
                "scheduler": "ddim",
                "steps": args.steps,
                "guidance_scale": args.guidance_scale,
                "best_of": 1,
            }
            record["sampling"].pop("prior", None)
            record.update(fixed_point=ddim["fixed_point"], caption=ddim["caption"])
    record["resolution"] = images[-1].size[0]
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return _save(images, folder, record)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    record = run(args, argv)
    extra = ""
    if record.get("inversion_error") is not None and args.edit in ("invert", "text-diff"):
        extra = f"; inversion round-trip RMSE {record['inversion_error']:.4f}"
    n = len(record["files"])
    print(f"wrote {n} image{'' if n == 1 else 's'} + grid.png + edit.json to {args.out}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
