"""Loss per sample of a faster variant of a training step against the reference: does it learn as
much from each sample? The mid model's prior and 64 px decoder in bf16 autocast against fp32, and
its 64 -> 128 px upsampler with mid-block attention heads of 32 channels against diffusers' 8
(benchmarks/models.py, as bench_peers.py builds them in unclip's real ``TrainLoop``), trained on
the same shapes-world samples.

    python benchmarks/bench_mixed_precision.py            # about 40 minutes on one core
    python benchmarks/bench_mixed_precision.py --stages upsampler --out bench_upsampler_heads
    python benchmarks/bench_mixed_precision.py --quick    # a few steps: runs the path

Per stage, three runs from the same initial weights (the upsampler's head width only splits the
same projections differently), one thread each, one after the other:

* the reference: ``train.mixed_precision: "no"`` (``fp32``); for the upsampler, heads of 8
  channels (``heads_8``);
* the variant: ``"bf16"`` (what ``auto`` picks on a CPU that runs it natively; elsewhere bf16 is
  emulated, slower, and not what ``auto`` picks, but its numerics are the same); for the
  upsampler, heads of 32 (``heads_32``, fp32);
* the reference on the same samples in another order, the run-to-run spread that a difference
  between the first two is measured against.

The samples are shapes-world scenes at the decoder's 64 px with their captions, conditioned on the
CLIP image embedding of the scene (the benchmark's random CLIP: a fixed function of the image,
which is all the prior and decoder need to learn to produce). Each sample's noise and timestep come
from the loop's per-sample generators, so ``fp32`` and ``bf16`` see the same samples with the same
noise at every step and their losses are paired step by step. Reported: the mean training loss
over the last third of the steps, the median of the per-step ratio bf16 / fp32 over those steps,
and the loss of the final weights on held-out scenes, all evaluated in fp32 with fixed noise (so
the arithmetic of the evaluation is the same for every run), and seconds per step.

Writes ``benchmarks/results/bench_mixed_precision.json``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import common
import models
import peers_models
import torch
import torch.nn.functional as F

from unclip.shapes.world import ShapesWorld
from unclip.utils.images import pil_to_tensor

#: per stage: batch, steps, learning rate (warmup 10 % of the steps, then cosine to 1e-6)
PLAN = {"prior": (32, 300, 3e-4), "decoder": (4, 150, 2e-4), "upsampler": (2, 150, 2e-4)}
QUICK = {"prior": (8, 6, 3e-4), "decoder": (2, 3, 2e-4), "upsampler": (2, 3, 2e-4)}
HELD_OUT = 64  # scenes
#: per stage: (name, build_unclip spec overrides) of the reference and the variant
PRECISION = [("fp32", {"mixed_precision": "no"}), ("bf16", {"mixed_precision": "bf16"})]
VARIANTS = {
    "prior": PRECISION,
    "decoder": PRECISION,
    "upsampler": [
        ("heads_8", {"unclip_upsampler": {"attention_head_dim": 8}}),
        ("heads_32", {"unclip_upsampler": {"attention_head_dim": 32}}),
    ],
}
#: the resolution of each stage's training images
RES = {"prior": 64, "decoder": 64, "upsampler": 128}


def shapes_batches(clip, n: int, batch: int, split: str, res: int = 64) -> list[dict]:
    """``n`` batches of shapes-world scenes: images in [-1, 1] at ``res``, captions, and the CLIP
    image embeddings of the scenes."""
    world = ShapesWorld(res, seed=0, split=split)
    out = []
    for b in range(n):
        samples = [world[b * batch + i] for i in range(batch)]
        images = torch.stack([pil_to_tensor(s.image) for s in samples])
        with torch.no_grad():
            small = F.interpolate(images, size=clip.image_size, mode="bilinear", antialias=True)
            embeds = clip.encode_image(small)
        out.append(
            {"caption": [s.caption for s in samples], "image": images, "image_embed": embeds}
        )
    return out


def run(
    stage: str, overrides: dict, batches: list[dict], held_out: list[dict], lr: float, work
) -> dict:
    steps = len(batches)
    spec = {
        **peers_models.SETUPS["full"],
        "batch": len(batches[0]["caption"]),
        "train": {"lr": lr, "warmup_steps": max(1, steps // 10), "max_steps": steps},
        **overrides,
    }
    built = peers_models.build_unclip(stage, spec, work)
    loop, task = built["loop"], built["task"]
    keep = ("caption", "image_embed") if stage == "prior" else ("caption", "image", "image_embed")
    losses, seconds = [], []
    for b in batches:
        t0 = time.perf_counter()
        losses.append(loop.run_step(task, [{k: b[k] for k in keep}]))
        seconds.append(time.perf_counter() - t0)
    # held-out loss in fp32 for every run: the model without Accelerate's autocast wrapper, the
    # same per-sample generators (seeded by the held-out index) for every run
    model = loop.accelerator.unwrap_model(loop.model, keep_fp32_wrapper=False)
    model.eval()
    held = []
    with torch.no_grad():
        for i, b in enumerate(held_out):
            n = len(b["caption"])
            gens = [torch.Generator().manual_seed(10_000 + i * n + j) for j in range(n)]
            held.append(float(task.loss(model, {k: b[k] for k in keep}, gens)))
    return {
        "losses": losses,
        "seconds_per_step": common.median(seconds[1:] or seconds),
        "held_out_loss": sum(held) / len(held),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", nargs="+", choices=list(PLAN), default=list(PLAN))
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--out",
        default=None,
        help="results/<OUT>.json (default bench_mixed_precision, _quick with --quick); e.g. one "
        "file per stage when the stages run side by side",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    result = {"machine": common.machine(), "stages": {}}
    plan = QUICK if args.quick else PLAN
    for stage in args.stages:
        batch, steps, lr = plan[stage]
        torch.manual_seed(0)  # the CLIP build_unclip builds: the one the runs condition on
        clip = models.clip_model(peers_models.SETUPS["full"]["size"])
        common.log(f"[{stage}] {steps} steps x batch {batch}: rendering and embedding the scenes")
        batches = shapes_batches(clip, steps, batch, "train", RES[stage])
        held_out = shapes_batches(clip, max(1, HELD_OUT // batch), batch, "heldout", RES[stage])
        other = batches[:]
        random.Random(1).shuffle(other)
        runs = {}
        (ref, ref_spec), (var, var_spec) = VARIANTS[stage]
        for name, overrides, data in (
            (ref, ref_spec, batches),
            (var, var_spec, batches),
            (f"{ref}, other order", ref_spec, other),
        ):
            with tempfile.TemporaryDirectory() as work:
                runs[name] = run(stage, overrides, data, held_out, lr, work)
            common.log(
                f"[{stage}] {name}: held-out loss {runs[name]['held_out_loss']:.5f}, "
                f"{runs[name]['seconds_per_step']:.3f} s/step"
            )
        last = slice(2 * steps // 3, None)
        mean_last = {k: sum(r["losses"][last]) / len(r["losses"][last]) for k, r in runs.items()}
        paired = [b / a for a, b in zip(runs[ref]["losses"][last], runs[var]["losses"][last])]
        result["stages"][stage] = {
            "batch": batch,
            "steps": steps,
            "lr": lr,
            "variants": {ref: ref_spec, var: var_spec},
            "mean_train_loss_last_third": mean_last,
            f"median_paired_ratio_{var}_over_{ref}_last_third": common.median(paired),
            "held_out_loss": {k: r["held_out_loss"] for k, r in runs.items()},
            "seconds_per_step": {k: r["seconds_per_step"] for k, r in runs.items()},
            "runs": runs,
        }
    name = args.out or ("bench_mixed_precision_quick" if args.quick else "bench_mixed_precision")
    return common.finish(name, result, started, report)


def report(r: dict) -> str:
    rows = []
    for stage, s in r["stages"].items():
        for k in s["held_out_loss"]:
            rows.append(
                {
                    "stage": stage,
                    "run": k,
                    "train": f"{s['mean_train_loss_last_third'][k]:.5f}",
                    "held": f"{s['held_out_loss'][k]:.5f}",
                    "sps": f"{s['seconds_per_step'][k]:.3f}",
                }
            )
    out = [
        f"machine: {common.machine_line(r['machine'])}",
        common.table(
            rows,
            [
                ("stage", "stage"),
                ("run", "run"),
                ("train loss, last third", "train"),
                ("held-out loss (fp32 eval)", "held"),
                ("s/step", "sps"),
            ],
            "loss per sample: variant vs reference, same samples, same noise",
        ),
    ]
    for stage, s in r["stages"].items():
        ref, var = list(s.get("variants", {"fp32": {}, "bf16": {}}))
        out.append(
            f"{stage}: median per-step loss ratio {var} / {ref} (last third) "
            f"{s[f'median_paired_ratio_{var}_over_{ref}_last_third']:.4f}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
