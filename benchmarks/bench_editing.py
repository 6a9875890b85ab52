"""Score the edits of unclip/editing.py on the shapes world: the bundled model and its evaluator.

    python benchmarks/bench_editing.py            # docs/editing.json + docs/editing_*.jpg
    python benchmarks/bench_editing.py --quick --out /tmp/edit   # 2 scenes per table

Tables (docs/editing.md reads them):
- inversion: DDIM round-trip RMSE (in [-1, 1] units, at the decoder's resolution) vs steps;
- text diff "a red circle on the left" → "a blue circle on the left", per θ: the fraction of
  frames that are the target (a blue circle) with the source's position and background;
- inpainting: a two-object scene with its second object masked, the prompt naming a new object
  there: new scene fully correct by the evaluator, and the largest pixel change outside the mask;
- image-to-image: faithfulness to a new prompt (colour and shape changed) vs strength, and how
  often the source's position survives.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import common
import numpy as np
import torch
from PIL import Image

from unclip.shapes.captions import parse_caption
from unclip.shapes.detector import detect, score
from unclip.shapes.world import COLORS, SHAPES, render, sample_truth
from unclip.utils.images import image_grid, pil_to_tensor

RES = 128


def scenes(n: int, seed: int, want) -> list[dict]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        t = sample_truth(rng, "all", two_object_prob=1.0 if want == "pair" else 0.0)
        if want == "pair" or want(t["objects"][0]):
            out.append(t)
    return out


def inversion(pipe, n: int, steps_list, fixed_point: int) -> list[dict]:
    truths = scenes(n, 1, lambda o: True)
    x = torch.cat([pil_to_tensor(render(t, RES))[None] for t in truths])
    rows = []
    for steps in steps_list:
        t0 = time.perf_counter()
        inv = pipe.invert(x, steps=steps, fixed_point=fixed_point, progress=False)
        per = (inv.reconstruction - inv.image).pow(2).flatten(1).mean(1).sqrt()
        rows.append(
            {
                "steps": steps,
                "fixed_point": fixed_point,
                "rmse_mean": round(float(per.mean()), 4),
                "rmse_max": round(float(per.max()), 4),
                "psnr_db": round(float((20 * torch.log10(2 / per)).mean()), 2),
                "seconds_per_image": round((time.perf_counter() - t0) / n, 3),
            }
        )
        print("inversion", rows[-1], flush=True)
    return rows


def text_diff(pipe, n: int, frames: int, steps: int, fixed_point: int, pictures: Path):
    src, dst = "a red circle on the left", "a blue circle on the left"
    truths = scenes(
        n, 2, lambda o: (o["color"], o["shape"], o["position"]) == ("red", "circle", "left")
    )
    hits = np.zeros(frames)
    target_only = np.zeros(frames)
    rows, errors, thetas = [], [], None
    for i, t in enumerate(truths):
        out = pipe.text_diff(
            render(t, RES), src, dst, num_steps=frames, steps=steps, fixed_point=fixed_point,
            generator=torch.Generator().manual_seed(i), progress=False,
        )  # fmt: skip
        thetas, errors = out.info["theta"], errors + [out.info["inversion_error"]]
        for j, im in enumerate(out.images):
            s = score(im, parse_caption(dst))
            kept = detect(im)["background"] == t["background"]
            target_only[j] += s["color"] and s["shape"]
            hits[j] += s["color"] and s["shape"] and s["position"] and kept and s["objects"]
        if i < 4:
            rows.append([render(t, RES), *out.images])
    image_grid([im for r in rows for im in r], cols=frames + 1).save(
        pictures / "editing_text_diff.jpg", quality=85
    )
    res = {
        "source": src,
        "target": dst,
        "scenes": n,
        "steps": steps,
        "fixed_point": fixed_point,
        "theta": thetas,
        "target_kept_position_background": [round(float(h) / n, 3) for h in hits],
        "target_color_shape": [round(float(h) / n, 3) for h in target_only],
        "inversion_rmse_mean": round(float(np.mean(errors)), 4),
    }
    print("text diff", res, flush=True)
    return res


def _mask(obj: dict, margin: float = 0.06) -> np.ndarray:
    x0, y0, x1, y1 = obj["bbox"]
    m = np.zeros((RES, RES), bool)
    lo = lambda v: max(0, int((v - margin) * RES))  # noqa: E731
    hi = lambda v: min(RES, int(np.ceil((v + margin) * RES)))  # noqa: E731
    m[lo(y0) : hi(y1), lo(x0) : hi(x1)] = True
    return m


def inpainting(pipe, n: int, resamples, pictures: Path):
    truths = scenes(n, 3, "pair")
    rng = random.Random(4)
    res, pics = {}, []
    for r in resamples:
        ok = np.zeros(n, bool)
        outside = []
        seconds = 0.0
        for i, t in enumerate(truths):
            a, b = t["objects"]
            color = rng.choice([c for c in COLORS if c not in (a["color"], b["color"])])
            shape = rng.choice([s for s in SHAPES if s != b["shape"]])
            prompt = f"a {a['color']} {a['shape']} {t['relation']} a {color} {shape}"
            img, mask = render(t, RES), _mask(b)
            t0 = time.perf_counter()
            out = pipe.inpaint(
                img, mask, prompt, resample=r, generator=torch.Generator().manual_seed(i),
                progress=False,
            )  # fmt: skip
            seconds += time.perf_counter() - t0
            got = np.asarray(out.images[0]).astype(int)
            outside.append(int(np.abs(got - np.asarray(img).astype(int))[~mask].max()))
            ok[i] = score(out.images[0], parse_caption(prompt))["all"]
            if i < 4 and r == resamples[-1]:
                shown = np.asarray(img).copy()
                shown[mask] = shown[mask] // 3 + 170
                pics.append([img, Image.fromarray(shown), out.images[0]])
        res[f"resample_{r}"] = {
            "new_scene_fully_correct": round(float(ok.mean()), 3),
            "max_pixel_change_outside_mask": max(outside),
            "seconds_per_image": round(seconds / n, 2),
        }
        print("inpaint", r, res[f"resample_{r}"], flush=True)
    image_grid([im for row in pics for im in row], cols=3).save(
        pictures / "editing_inpaint.jpg", quality=85
    )
    return {"scenes": n, **res}


def img2img(pipe, n: int, strengths, pictures: Path):
    truths = scenes(n, 5, lambda o: True)
    rng = random.Random(6)
    prompts = []
    for t in truths:
        o = t["objects"][0]
        color = rng.choice([c for c in COLORS if c != o["color"]])
        shape = rng.choice([s for s in SHAPES if s != o["shape"]])
        prompts.append(f"a {color} {shape}")
    res, pics = {}, [[render(t, RES)] for t in truths[:4]]
    for st in strengths:
        faithful = kept = 0
        for i, (t, p) in enumerate(zip(truths, prompts)):
            out = pipe.img2img(
                render(t, RES), p, strength=st, generator=torch.Generator().manual_seed(i),
                progress=False,
            )  # fmt: skip
            s = score(out.images[0], parse_caption(p))
            faithful += s["all"]
            objs = detect(out.images[0])["objects"]
            kept += bool(objs) and objs[0]["position"] == t["objects"][0]["position"]
            if i < 4:
                pics[i].append(out.images[0])
        res[str(st)] = {
            "faithful": round(float(faithful) / n, 3),
            "position_kept": round(float(kept) / n, 3),
        }
        print("img2img", st, res[str(st)], flush=True)
    image_grid([im for row in pics for im in row], cols=len(strengths) + 1).save(
        pictures / "editing_img2img.jpg", quality=85
    )
    return {"scenes": n, "strength": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 scenes per table (a smoke run)")
    p.add_argument("--out", default="docs", help="folder for editing.json and the pictures")
    p.add_argument("--scenes", type=int, default=16, help="scenes per table")
    p.add_argument("--text-diff-steps", type=int, default=50, help="DDIM steps of the text diff")
    p.add_argument(
        "--fixed-point",
        type=int,
        default=2,
        help="fixed-point iterations of each inversion step (0: plain DDIM inversion, which the "
        "tables in docs/editing.md were measured with)",
    )
    p.add_argument(
        "--parts",
        default="inversion,text_diff,inpainting,img2img",
        help="tables to measure (comma-separated); others are kept from an existing editing.json",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    n = 2 if args.quick else args.scenes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe = common.fp32_pipeline()
    parts = args.parts.split(",")
    path = out / "editing.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report.update(model="bundled shapes model", resolution=RES)
    runs = {
        "inversion": lambda: inversion(
            pipe, n, [10, 25] if args.quick else [10, 25, 50, 100], args.fixed_point
        ),
        "text_diff": lambda: text_diff(
            pipe, n, 6, 25 if args.quick else args.text_diff_steps, args.fixed_point, out
        ),
        "inpainting": lambda: inpainting(pipe, n, [1, 4], out),
        "img2img": lambda: img2img(pipe, n, [0.2, 0.4, 0.6, 0.8, 1.0], out),
    }
    t0 = time.perf_counter()
    for part in parts:
        if part not in runs:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(runs)}")
        report[part] = runs[part]()
        path.write_text(json.dumps(report, indent=2))  # each table as soon as it is measured
    report["seconds_last_run"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path} in {report['seconds_last_run']} s")


if __name__ == "__main__":
    main()
