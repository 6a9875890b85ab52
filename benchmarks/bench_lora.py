"""Teach the bundled shapes model a colour it has never seen, with LoRA, and measure what it learned
and what it forgot.

    python benchmarks/bench_lora.py                     # docs/lora.json + docs/lora.png
    python benchmarks/bench_lora.py --quick --out /tmp/lora   # smoke run: minutes, learns nothing

The new colour (default ``pink`` = 255, 105, 180) is added to the shapes world through its opt-in
``extra_colors`` (:mod:`unclip.shapes.world`); the detector reads it the same way. Steps:

1. write a training folder (32 px PNG + caption) from the extended world's train split: every scene
   that shows the new colour, and old-palette scenes as replay (``--new-fraction`` of the folder is
   new-colour scenes);
2. train two LoRA adapters through the ordinary commands, side by side, one thread each:
   ``unclip train-decoder configs/shapes/decoder.yaml`` and ``unclip train-prior
   configs/shapes/prior.yaml`` with ``train.init_weights`` = the bundled components, the bundled
   CLIP and ``train.lora``;
3. sample the bundled pipeline before (base), with the decoder adapter, and with both adapters, at
   the decoder's 32 px, each prompt with its own seed (the same in every condition), and score:
   - **new**: captions of new-colour scenes (extended world, seed 1000), scored with the extended
     detector: is the new-colour object there with its shape/size/position;
   - **held-out** (forgetting): the standard held-out prompts of ``docs/shapes_model.md`` with the
     standard detector;
   - **other unknown word**: the single-object new-colour prompts with the colour word replaced by
     another word the CLIP does not know (``--probe-word``): how often the new colour is drawn.
     The bundled CLIP keeps a closed vocabulary and reads every unknown word as the same zero
     embedding, so an adapter trained on one new word answers any unknown word (docs/lora.md).

Writes the JSON (settings, adapter sizes, training seconds, per-condition scores) and a picture:
the first new-colour prompts as real renders, then base, decoder adapter, both adapters, one row
each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, fp32_pipeline, machine, machine_line  # noqa: E402

from unclip.pipeline.folders import bundled_model_path  # noqa: E402
from unclip.shapes.detector import detect, evaluate_images  # noqa: E402
from unclip.shapes.evaluate import heldout_samples  # noqa: E402
from unclip.shapes.world import ShapesWorld  # noqa: E402
from unclip.utils.images import image_grid  # noqa: E402

#: the run's settings; ``--quick`` replaces them with QUICK's
FULL = dict(
    data=2400,
    decoder_steps=600,
    prior_steps=300,
    num=40,
    decoder_best_of=4,
    sampling_steps=25,
)
QUICK = dict(
    data=64,
    decoder_steps=8,
    prior_steps=8,
    num=2,
    decoder_best_of=1,
    sampling_steps=6,
)
#: the decoder adapter also adapts the projections of the CLIP image and text embeddings into the
#: time embedding and the image tokens: a colour is a global attribute, which the decoder reads
#: largely through them
DECODER_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_k_proj",
    "add_v_proj",
    "image_to_time",
    "text_to_time",
    "image_to_tokens",
]


def parse_color(text: str) -> dict:
    name, _, rgb = text.partition("=")
    try:
        values = tuple(int(v) for v in rgb.split(","))
    except ValueError:
        values = ()
    if not name or len(values) != 3:
        raise argparse.ArgumentTypeError(f"--color must look like pink=255,105,180, got {text!r}")
    return {name: values}


def has_color(truth: dict, name: str) -> bool:
    return any(o["color"] == name for o in truth["objects"])


def write_training_folder(folder: Path, n: int, colors: dict, new_fraction: float) -> dict:
    """``n`` training samples: new-colour scenes and (``1 - new_fraction`` of them) old-palette
    ones, from the extended world's train split (seed 0), written as PNG + caption."""
    (name,) = colors
    world = ShapesWorld(32, seed=0, split="train", two_object_prob=0.4, extra_colors=colors)
    want_new = round(n * new_fraction)
    new, old, i = [], [], 0
    while len(new) < want_new or len(old) < n - want_new:
        truth = world.truth(i)
        (new if has_color(truth, name) else old).append(i)
        i += 1
    keep = new[:want_new] + old[: n - want_new]
    folder.mkdir(parents=True, exist_ok=True)
    for j, index in enumerate(sorted(keep)):
        s = world[index]
        s.image.save(folder / f"{j:06d}.png")
        (folder / f"{j:06d}.txt").write_text(s.caption)
    return {"samples": len(keep), "new_color_samples": want_new, "world_indices_scanned": i}


def train_commands(out: Path, data: Path, s: dict, args) -> dict[str, list[str]]:
    bundled = bundled_model_path()
    common = [
        f"clip.pretrained={bundled / 'clip'}",
        "data.source=folder",
        f"data.path={data}",
        "train.progress=false",
        "train.checkpoint_every=0",
        "train.log_every=10",
        "train.warmup_steps=20",
        "train.ema_decay=0.99",
        f"train.lora.rank={args.rank}",
        f"train.seed={args.seed}",
    ]
    py = [sys.executable, "-m", "unclip.cli"]
    return {
        "decoder": [
            *py,
            "train-decoder",
            str(ROOT / "configs" / "shapes" / "decoder.yaml"),
            *common,
            f"train.init_weights={bundled / 'decoder'}",
            f"train.lora.target_modules=[{','.join(DECODER_TARGETS)}]",
            f"train.max_steps={s['decoder_steps']}",
            f"train.lr={args.lr}",
            f"train.output_dir={out / 'decoder'}",
        ],
        "prior": [
            *py,
            "train-prior",
            str(ROOT / "configs" / "shapes" / "prior.yaml"),
            *common,
            f"train.init_weights={bundled / 'prior'}",
            f"train.max_steps={s['prior_steps']}",
            f"train.lr={args.lr}",
            f"train.output_dir={out / 'prior'}",
        ],
    }


def train_side_by_side(commands: dict[str, list[str]], logs: Path) -> dict[str, float]:
    """Run the training commands at once, one thread each; returns each one's wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs.mkdir(parents=True, exist_ok=True)
    started, procs = time.perf_counter(), {}
    for name, cmd in commands.items():
        log = open(logs / f"train_{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    seconds: dict[str, float] = {}
    while len(seconds) < len(procs):
        for name, (proc, log) in procs.items():
            if name in seconds or proc.poll() is None:
                continue
            seconds[name] = round(time.perf_counter() - started, 1)
            log.close()
            if proc.returncode != 0:
                raise SystemExit(f"training the {name} adapter failed; see {logs}/train_{name}.log")
        time.sleep(1.0)
    return seconds


@torch.no_grad()
def sample(pipe, captions: list[str], s: dict, seed: int) -> list:
    """32 px decoder images for ``captions``; caption ``i`` uses seed ``seed + i``."""
    sampling = {
        "prior": {"steps": s["sampling_steps"]},
        "decoder": {"steps": s["sampling_steps"], "best_of": s["decoder_best_of"]},
    }
    images = []
    for start in range(0, len(captions), 25):
        chunk = captions[start : start + 25]
        out = pipe(
            chunk,
            generator=[torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))],
            sampling=sampling,
            last_stage="decoder",
            output_type="uint8",
            progress=False,
        )
        images.extend(out.images)
    return images


def summary(report: dict) -> dict:
    out = {"all": round(report["all"], 4)}
    for kind in ("single", "pair"):
        out[kind] = {k: round(v, 4) for k, v in report[kind].items() if not k.endswith("_count")}
    return out


def evaluate(pipe, prompts: dict, colors: dict, s: dict, seed: int) -> tuple[dict, list]:
    (name,) = colors
    t0 = time.perf_counter()
    new_images = sample(pipe, prompts["new"], s, seed)
    held_images = sample(pipe, prompts["heldout"], s, seed)
    probe_images = sample(pipe, prompts["probe"], s, seed)
    drawn = [
        any(o["color"] == name for o in detect(im, extra_colors=colors)["objects"])
        for im in probe_images
    ]
    result = {
        "new": summary(evaluate_images(new_images, prompts["new"], extra_colors=colors)),
        "heldout": summary(evaluate_images(held_images, prompts["heldout"])),
        "probe_new_color_drawn": round(sum(drawn) / len(drawn), 4),
        "sampling_seconds": round(time.perf_counter() - t0, 1),
    }
    return result, new_images


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def picture(path: Path, real: list, rows: list[list], cols: int) -> None:
    from PIL import Image

    tiles = []
    for row in [real, *rows]:
        tiles += [Image.fromarray(im).resize((96, 96), Image.NEAREST) for im in row[:cols]]
    image_grid(tiles, cols=cols).save(path, optimize=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run of the whole path (minutes)")
    p.add_argument("--out", default=None, help="output folder (default: docs/ for the full run)")
    p.add_argument("--work", default=None, help="data and training runs (default: OUT/lora_work)")
    p.add_argument("--color", type=parse_color, default={"pink": (255, 105, 180)})
    p.add_argument("--probe-word", default="brown")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--new-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    for key, value in FULL.items():
        p.add_argument(
            f"--{key.replace('_', '-')}", type=int, default=None, help=f"(full: {value})"
        )
    args = p.parse_args(argv)
    s = dict(QUICK if args.quick else FULL)
    s.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    out = Path(args.out) if args.out else (ROOT / "docs" if not args.quick else None)
    if out is None:
        p.error("--quick needs --out (the full run writes docs/lora.json)")
    work = Path(args.work) if args.work else out / "lora_work"
    colors = args.color
    (name,) = colors
    started = time.perf_counter()
    info = machine()
    print(machine_line(info))

    data_info = write_training_folder(work / "data", s["data"], colors, args.new_fraction)
    train_seconds = train_side_by_side(train_commands(work, work / "data", s, args), work / "logs")
    adapters = {stage: work / stage / "final" / f"{stage}_lora" for stage in ("decoder", "prior")}

    new_world = ShapesWorld(32, seed=1000, split="train", extra_colors=colors)
    new = {"single": [], "pair": []}
    i = 0
    while min(len(v) for v in new.values()) < s["num"]:
        sample_ = new_world[i]
        kind = "pair" if sample_.truth["relation"] else "single"
        if has_color(sample_.truth, name) and len(new[kind]) < s["num"]:
            new[kind].append(sample_)
        i += 1
    new_samples = new["single"] + new["pair"]
    prompts = {
        "new": [x.caption for x in new_samples],
        "heldout": [x.caption for x in heldout_samples(s["num"], 1000, 32)],
        "probe": [x.caption.replace(name, args.probe_word) for x in new["single"]],
    }

    pipe = fp32_pipeline()
    results, rows = {}, []
    conditions = [("base", []), ("decoder LoRA", ["decoder"]), ("prior + decoder LoRA", ["prior"])]
    for label, load in conditions:
        for stage in load:
            pipe.load_lora(adapters[stage])
        results[label], images = evaluate(pipe, prompts, colors, s, args.seed)
        rows.append(images)
        print(label, json.dumps(results[label]))

    component = {st: folder_bytes(bundled_model_path() / st) for st in ("decoder", "prior")}
    sizes = {
        st: {
            "adapter_bytes": folder_bytes(adapters[st]),
            "bundled_component_bytes_fp16": component[st],
            "trained_parameters": _lora_parameters(adapters[st]),
        }
        for st in adapters
    }
    result = {
        "what": f"LoRA teaches the bundled shapes model the colour {name} {colors[name]}",
        "settings": {**s, "rank": args.rank, "lr": args.lr, "new_fraction": args.new_fraction},
        "quick": args.quick,
        "decoder_target_modules": DECODER_TARGETS,
        "data": data_info,
        "train_wall_seconds_side_by_side": train_seconds,
        "adapters": sizes,
        "prompts": {k: len(v) for k, v in prompts.items()},
        "probe_word": args.probe_word,
        "results": results,
        "machine": info,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    real = [np.asarray(x.image) for x in new_samples]
    picture(out / "lora.png", real, rows, cols=min(8, len(new_samples)))
    (out / "lora.txt").write_text("\n".join(prompts["new"][:8]) + "\n")
    print(report(result))
    print(f"\nwrote {out / 'lora.json'} and {out / 'lora.png'} ({result['wall_seconds']:.0f} s)")
    return 0


def _lora_parameters(folder: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(folder / "adapter_model.safetensors")).values())


def report(result: dict) -> str:
    lines = [
        "| condition | new single: colour | new single: all | new pair: colours | new pair: all | "
        "held-out single: all | held-out pair: all | unknown word drawn in the new colour |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in result["results"].items():
        new, held = r["new"], r["heldout"]
        cells = [
            new["single"]["color"],
            new["single"]["all"],
            new["pair"]["colors"],
            new["pair"]["all"],
            held["single"]["all"],
            held["pair"]["all"],
            r["probe_new_color_drawn"],
        ]
        lines.append(f"| {label} | " + " | ".join(f"{100 * c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
