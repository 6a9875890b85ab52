"""Fine-tuning Kandinsky 2.2, side by side: unclip's training step against diffusers' own example
scripts run as published, on the same tiny random folders and the same images, at equal precision.

    pip install datasets tensorboard          # what diffusers' scripts need beyond unclip
    git clone https://github.com/huggingface/diffusers   # or any checkout of it
    OMP_NUM_THREADS=1 python benchmarks/bench_kandinsky_finetune.py \\
        --scripts diffusers/examples/kandinsky2_2/text_to_image

For each stage (``decoder``: ``train_text_to_image_decoder.py``, ``prior``:
``train_text_to_image_prior.py``) both trainers run twice, for ``--short`` and ``--long`` optimizer
steps, in rounds that alternate which goes first; a step's seconds are the difference of the two
runs' wall times over the difference in steps, which cancels what each pays once (imports,
loading the folders and the data, the final save). The ratio is the median over rounds of unclip's
step time over diffusers'. Both run in fp32 on the CPU (``--mixed_precision no``), batch
``--batch``, no gradient accumulation, no EMA, no condition dropout (the scripts have none), on 32
px shapes images (``data/`` holds them with ``metadata.jsonl`` for ``datasets``' imagefolder, and
with same-stem ``.txt`` captions for unclip), a constant learning rate of 1e-4 and Adam's betas
0.9 / 0.999 on both sides (the scripts' defaults). The mean training loss of each long run is
reported beside it: both optimise the same objective from the same weights, so the figures should
be alike, not equal (the data order and the noise draws differ).

Results go to ``benchmarks/results/bench_kandinsky_finetune.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny folder builders

from common import finish, log, machine, machine_line, median, rounds_order, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"decoder": "train_text_to_image_decoder.py", "prior": "train_text_to_image_prior.py"}
SIZE = 32


def build(root: Path, images: int) -> None:
    """The tiny folders (the decoder's model card names the prior, as the scripts' final save
    needs) and ``images`` shapes images in both dataset layouts."""
    from kandinsky_tiny import build_decoder, build_prior

    from unclip.shapes.world import ShapesWorld

    build_prior(root / "prior")
    build_decoder(root / "decoder")
    (root / "decoder" / "README.md").write_text(f"---\nprior:\n- {root / 'prior'}\n---\n")
    data = root / "data"
    data.mkdir()
    world = ShapesWorld(SIZE, seed=0, split="train")
    with open(data / "metadata.jsonl", "w") as meta:
        for i in range(images):
            s = world[i]
            s.image.save(data / f"{i:05d}.png")
            (data / f"{i:05d}.txt").write_text(s.caption)
            meta.write(json.dumps({"file_name": f"{i:05d}.png", "text": s.caption}) + "\n")


def theirs(stage: str, root: Path, scripts: Path, steps: int, batch: int, out: Path) -> list:
    args = [
        sys.executable,
        str(scripts / SCRIPTS[stage]),
        f"--pretrained_prior_model_name_or_path={root / 'prior'}",
        # the prior script's final save assembles the whole pipeline with this decoder too
        f"--pretrained_decoder_model_name_or_path={root / 'decoder'}",
        f"--train_data_dir={root / 'data'}",
        f"--resolution={SIZE}",
        f"--train_batch_size={batch}",
        f"--max_train_steps={steps}",
        "--gradient_accumulation_steps=1",
        "--learning_rate=1e-4",
        "--mixed_precision=no",
        "--seed=0",
        "--report_to=tensorboard",
        "--checkpointing_steps=100000",
        f"--output_dir={out}",
    ]
    return args


def ours(stage: str, root: Path, steps: int, batch: int, out: Path) -> list:
    cfg = {
        "kandinsky": {"stage": stage, "pretrained": str(root / stage)},
        "data": {"source": "folder", "path": str(root / "data"), "resolution": SIZE},
        "train": {
            "output_dir": str(out),
            "max_steps": steps,
            "grad_accum_steps": 1,
            # diffusers' scripts' defaults: a constant 1e-4 and Adam's betas 0.9 / 0.999
            "lr": 1e-4,
            "min_lr": 1e-4,
            "adam_betas": [0.9, 0.999],
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "mixed_precision": "no",
            "ema": False,
            "text_drop_prob": 0.0,
            "image_embed_drop_prob": 0.0,
            "checkpoint_every": 100000,
            "log_every": 1,
            "trackers": [],
            "progress": False,
        },
    }
    cfg["data"]["batch_size"] = batch
    if stage == "decoder":
        cfg["kandinsky"]["prior"] = str(root / "prior")
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    command = "train-decoder" if stage == "decoder" else "train-prior"
    return [sys.executable, "-m", "unclip.cli", command, str(path)]


def run(argv: list, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{proc.stderr[-3000:]}")
    return seconds


def their_losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(out.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[-1].parent))
    acc.Reload()
    return [e.value for e in acc.Scalars("train_loss")]


def our_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--scripts", required=True, help="diffusers' examples/kandinsky2_2/text_to_image"
    )
    p.add_argument("--stages", nargs="+", default=["decoder", "prior"], choices=list(SCRIPTS))
    p.add_argument("--short", type=int, default=3)
    p.add_argument("--long", type=int, default=23)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--images", type=int, default=64)
    args = p.parse_args()
    scripts = Path(args.scripts)
    missing = [s for s in SCRIPTS.values() if not (scripts / s).is_file()]
    if missing:
        raise SystemExit(f"--scripts {scripts}: no {', '.join(missing)} there")
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result: dict = {"machine": machine(), "settings": vars(args) | {"scripts": str(scripts)}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, args.images)
        for stage in args.stages:
            per_step: dict[str, list[float]] = {"unclip": [], "diffusers": []}
            loss: dict[str, list[float]] = {}
            for r in range(args.rounds):
                for who in rounds_order(["unclip", "diffusers"], r):
                    t = {}
                    for steps in (args.short, args.long):
                        out = root / f"{stage}-{who}-{r}-{steps}"
                        argv = (
                            ours(stage, root, steps, args.batch, out)
                            if who == "unclip"
                            else theirs(stage, root, scripts, steps, args.batch, out)
                        )
                        t[steps] = run(argv, env)
                        log(f"{stage} {who} round {r}: {steps} steps in {t[steps]:.1f} s")
                    per_step[who].append((t[args.long] - t[args.short]) / (args.long - args.short))
                    last = root / f"{stage}-{who}-{r}-{args.long}"
                    loss[who] = our_losses(last) if who == "unclip" else their_losses(last)
            ratio = median([a / b for a, b in zip(per_step["unclip"], per_step["diffusers"])])
            row = {
                "stage": stage,
                "unclip_s_per_step": median(per_step["unclip"]),
                "diffusers_s_per_step": median(per_step["diffusers"]),
                "ratio_unclip_over_diffusers": ratio,
                "unclip_mean_loss": sum(loss["unclip"]) / len(loss["unclip"]),
                "diffusers_mean_loss": sum(loss["diffusers"]) / len(loss["diffusers"]),
                "steps_logged": {k: len(v) for k, v in loss.items()},
                "per_round": per_step,
            }
            rows.append(row)
    result["stages"] = rows

    def report(res: dict) -> str:
        cols = [
            ("stage", "stage"),
            ("unclip s/step", "unclip_s_per_step"),
            ("diffusers s/step", "diffusers_s_per_step"),
            ("ratio (median of rounds)", "ratio_unclip_over_diffusers"),
            ("unclip mean loss", "unclip_mean_loss"),
            ("diffusers mean loss", "diffusers_mean_loss"),
        ]
        return machine_line(res["machine"]) + table(res["stages"], cols, "Kandinsky fine-tuning")

    return finish("bench_kandinsky_finetune", result, started, report)


if __name__ == "__main__":
    sys.exit(main())
