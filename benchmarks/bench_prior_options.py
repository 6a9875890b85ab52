"""Loss per second of training for the shapes prior: {AdamW, SOAP, KL-Shampoo} x {diffusers'
blocks, NormFormer + SwiGLU blocks}, each trained for the same time budget on this CPU.

    python benchmarks/bench_prior_options.py                 # 10 minutes per variant (1 hour)
    python benchmarks/bench_prior_options.py --quick         # 5 s per variant (about a minute)
    python benchmarks/bench_prior_options.py --budget 300 --optimizers adamw soap

Each variant is ``configs/shapes/prior.yaml`` (4 blocks of width 128, batch 64, on the shapes world
rendered on the fly, with the bundled model's CLIP) trained through the project's own loop
(``TrainLoop.run_step`` with ``PriorTask``: the real loss, clipping, schedule and optimizer) from
the same seed and the same data order, with the optimizer (``train.optimizer``) and the blocks
(``prior.normformer`` + ``prior.ff_activation=swiglu``) changed. Every ``--eval-every`` seconds of
training the raw (non-EMA) weights are scored on a fixed validation set: the x_0-prediction loss
over ``--eval-batches`` held-out batches (another data seed) with fixed timesteps, noise and
caption dropout, so the curves differ only by the weights. Evaluation time is not counted.
At the end of the budget, final faithfulness: the raw weights sample one embedding per validation
caption with the recipe's sampling settings (DDIM, guidance, best of N; fixed generators) and we
report the mean cosine to the true CLIP image embedding of the caption's image.

The learning rate is the recipe's for every optimizer (``--lr`` changes it for all) and stays at
its post-warmup value (the cosine horizon is far beyond the budget): the comparison is at one
learning rate, not each optimizer's tuned one. Time is wall-clock seconds of the training steps
(data, CLIP encoding, forward, backward, optimizer); each point also records the training thread's
CPU seconds, which other jobs on a shared machine do not inflate (``--clock cpu`` budgets and plots
by those instead). The variants run one after another; the load average before and after each is
recorded.

Writes ``benchmarks/results/bench_prior_options[_quick].json`` (per variant: the validation curve
``[[seconds, cpu_seconds, step, loss], ...]``, the training losses per step, steps/s, parameter
count) and a PNG of the validation curves beside it (matplotlib when installed, else a plain
Pillow chart).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import common
import torch

OPTIMIZERS = ("adamw", "soap", "kl_shampoo")
BLOCKS = {
    "baseline": [],
    "normformer_swiglu": ["prior.normformer=true", "prior.ff_activation=swiglu"],
}
CONFIG = common.ROOT / "configs" / "shapes" / "prior.yaml"
CLIP_WEIGHTS = common.ROOT / "unclip" / "bundled" / "shapes" / "clip" / "model.safetensors"
EVAL_SEED = 10_007  # the validation batches' data seed and their generators' seed


def _config(overrides: list[str], out: str, lr):
    from unclip.train.config import load_stage_config

    extra = [f"train.lr={lr}"] if lr is not None else []
    return load_stage_config(
        CONFIG,
        [
            f"clip.pretrained={CLIP_WEIGHTS}",
            f"train.output_dir={out}",
            "train.max_steps=1000000",  # the cosine schedule stays at lr within any budget
            "train.checkpoint_every=0",
            "train.ema=false",
            "train.log_every=1000000",
            *extra,
            *overrides,
        ],
    )


def _validation_loss(model, task, batches, cfg) -> float:
    from unclip.train.loop import sample_generators
    from unclip.train.prior import prior_loss

    model.eval()
    total = 0.0
    with torch.no_grad():
        for i, batch in enumerate(batches):
            b = len(batch["caption"])
            gens = sample_generators(EVAL_SEED, 0, i * b, b)
            total += float(
                prior_loss(
                    model, batch, task.clip, task.null, gens, cfg, task.noise_sched, task.device
                )
            )
    model.train()
    return total / len(batches)


def run_variant(name: str, overrides: list[str], args, shared: dict) -> dict:
    from unclip.nets.clip import CLIP
    from unclip.train.data.loader import make_batches
    from unclip.train.loop import TrainLoop
    from unclip.train.prior import PriorTask, build_prior_model

    with tempfile.TemporaryDirectory(prefix="unclip-bench-") as tmp:
        cfg = _config(overrides, tmp, args.lr)
        loop = TrainLoop(cfg, overwrite=True)
        torch.manual_seed(cfg.train.seed)
        clip = CLIP.from_config(cfg.clip)
        model = build_prior_model(cfg, clip)
        model.set_embedding_stats(*shared["stats"])
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        model = loop.prepare(model)
        model.train()
        task = PriorTask(cfg, clip, loop.device)
        data = iter(
            make_batches(
                cfg.data,
                resolution=clip.image_size,
                seed=cfg.train.seed,
                rank=0,
                world_size=1,
                start=0,
            )
        )
        if "eval" not in shared:
            shared["eval"] = _eval_batches(cfg, clip, args.eval_batches)
        load_before = os.getloadavg()[0]
        curve = [[0.0, 0.0, 0, _validation_loss(model, task, shared["eval"], cfg)]]
        wall = cpu = 0.0
        losses = []
        next_eval = args.eval_every
        spent = 0.0
        while spent < args.budget:
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = loop.run_step(task, loop.next_micro_batches(data))
            loop.state.step += 1
            wall += time.perf_counter() - t0
            cpu += time.thread_time() - c0
            spent = cpu if args.clock == "cpu" else wall
            losses.append(loss)
            if spent >= next_eval or spent >= args.budget:
                val = _validation_loss(model, task, shared["eval"], cfg)
                curve.append([round(wall, 3), round(cpu, 3), loop.state.step, val])
                next_eval += args.eval_every
        faithful = _faithfulness(loop.unwrapped, task, shared, cfg)
        loop.finish()
    row = {
        "variant": name,
        "overrides": overrides,
        "params": n_params,
        "steps": loop.state.step,
        "steps_per_s": loop.state.step / wall,
        "final_loss": curve[-1][3],
        **faithful,
        "curve": curve,
        "train_losses": losses,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    common.log(
        f"{name}: {row['steps']} steps in {wall:.1f} s wall / {cpu:.1f} s CPU, "
        f"validation loss {curve[0][3]:.4f} -> {row['final_loss']:.4f}, "
        f"sampled cosine to the true image embedding {row['cos_to_true_image_embed']:.4f}"
    )
    return row


def _faithfulness(model, task, shared, cfg) -> dict:
    """Final faithfulness of the raw weights: one embedding sampled per held-out caption with the
    recipe's sampling settings (DDIM, guidance, best of N), one generator per candidate, and its
    mean cosine to the true CLIP image embedding (and to the caption's text embedding)."""
    from unclip.sampling.stages import sample_prior
    from unclip.train.prior_batches import embed_batch

    model.eval()
    truth, samples, text_embeds = [], [], []
    with torch.no_grad():
        for i, batch in enumerate(shared["eval"]):
            image_embed, text = embed_batch(task.clip, batch, task.device)
            n = len(batch["caption"]) * cfg.sampling.best_of
            gens = [torch.Generator().manual_seed(EVAL_SEED + i * n + j) for j in range(n)]
            best, _ = sample_prior(
                model,
                text,
                task.null.repeat_interleave,
                cfg.sampling,
                cfg.diffusion,
                generator=gens,
                progress=False,
            )
            truth.append(image_embed.float())
            samples.append(best.float())
            text_embeds.append(text.text_embed.float())
    model.train()
    truth, samples, text_embeds = torch.cat(truth), torch.cat(samples), torch.cat(text_embeds)
    cos = torch.nn.functional.cosine_similarity
    return {
        "cos_to_true_image_embed": float(cos(samples, truth).mean()),
        "cos_to_text_embed": float(cos(samples, text_embeds).mean()),
        "faithfulness_captions": len(truth),
    }


def _eval_batches(cfg, clip, n: int) -> list[dict]:
    """``n`` fixed batches from another data seed, made once and shared by every variant."""
    from unclip.train.data.loader import make_batches

    it = iter(
        make_batches(
            cfg.data, resolution=clip.image_size, seed=EVAL_SEED, rank=0, world_size=1, start=0
        )
    )
    return [next(it) for _ in range(n)]


def plot(result: dict, path: Path) -> str:
    """The validation curves as a PNG; returns which library drew it."""
    series = [
        (
            r["variant"],
            [p[0 if result["args"]["clock"] == "wall" else 1] for p in r["curve"]],
            [p[3] for p in r["curve"]],
        )
        for r in result["rows"]
    ]
    xlabel = f"training seconds ({result['args']['clock']})"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pillow(series, xlabel, path)
        return "pillow"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, xs, ys in series:
        color = [c / 255 for c in _color(name)]
        ax.plot(xs, ys, "--" if "normformer" in name else "-", color=color, marker=".", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (x_0 MSE)")
    ax.set_title("shapes prior: loss per training second")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


#: one colour per optimizer (the NormFormer + SwiGLU variant is drawn dashed / thinner)
COLORS = {"adamw": (31, 119, 180), "soap": (255, 127, 14), "kl_shampoo": (44, 160, 44)}


def _color(variant: str) -> tuple:
    return COLORS[variant.split("/")[0]]


def _plot_pillow(series, xlabel: str, path: Path) -> None:
    from PIL import Image, ImageDraw

    w, h, left, right, top, bottom = 840, 540, 70, 230, 30, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    xmax = max(max(xs) for _, xs, _ in series) or 1.0
    ys_all = [y for _, _, ys in series for y in ys]
    ymin, ymax = min(ys_all), max(ys_all)
    ymax = ymax if ymax > ymin else ymin + 1.0

    def px(x, y):
        return (
            left + (w - left - right) * x / xmax,
            top + (h - top - bottom) * (1 - (y - ymin) / (ymax - ymin)),
        )

    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for i in range(5):
        y = ymin + (ymax - ymin) * i / 4
        d.text((5, px(0, y)[1] - 6), f"{y:.3f}", fill="black")
        x = xmax * i / 4
        d.text((px(x, ymin)[0] - 10, h - bottom + 5), f"{x:.3g}", fill="black")
    d.text((left, h - 20), xlabel, fill="black")
    d.text((left, 8), "shapes prior: validation loss (x_0 MSE) per training second", fill="black")
    for i, (name, xs, ys) in enumerate(series):
        color = _color(name)
        d.line(
            [px(x, y) for x, y in zip(xs, ys)], fill=color, width=2 if "normformer" in name else 3
        )
        ly = top + 18 * i
        d.line([(w - right + 10, ly + 6), (w - right + 30, ly + 6)], fill=color, width=3)
        d.text((w - right + 35, ly), name, fill="black")
    img.save(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s per variant (about a minute)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per variant")
    parser.add_argument("--eval-every", type=float, default=None, help="seconds between evals")
    parser.add_argument("--eval-batches", type=int, default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--lr", type=float, default=None, help="default: the recipe's")
    parser.add_argument("--optimizers", nargs="*", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--blocks", nargs="*", choices=list(BLOCKS), default=list(BLOCKS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.budget = args.budget or (5.0 if args.quick else 600.0)
    args.eval_every = args.eval_every or (2.5 if args.quick else 30.0)
    args.eval_batches = args.eval_batches or (1 if args.quick else 8)
    if "soap" in args.optimizers or "kl_shampoo" in args.optimizers:
        try:
            import heavyball  # noqa: F401
        except ImportError:
            parser.error("soap and kl_shampoo need heavyball: pip install -e '.[optim]'")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {"machine": common.machine(), "args": vars(args), "rows": []}
    common.log("machine:", common.machine_line(result["machine"]))

    from unclip.nets.clip import CLIP
    from unclip.train.prior import embedding_stats

    with tempfile.TemporaryDirectory(prefix="unclip-bench-") as tmp:
        cfg = _config([], tmp, args.lr)
        stats = embedding_stats(cfg, CLIP.from_config(cfg.clip), torch.device("cpu"))
    shared = {"stats": stats}
    for opt in args.optimizers:
        for blocks in args.blocks:
            name = f"{opt}/{blocks}"
            overrides = [f"train.optimizer={opt}", *BLOCKS[blocks]]
            result["rows"].append(run_variant(name, overrides, args, shared))

    name = "bench_prior_options" + ("_quick" if args.quick else "")
    png = common.RESULTS / f"{name}.png"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    result["plot"] = {"path": str(png.relative_to(common.ROOT)), "drawn_by": plot(result, png)}

    def report(r):
        return (
            common.table(
                r["rows"],
                [
                    ("variant", "variant"),
                    ("parameters", "params"),
                    ("steps", "steps"),
                    ("steps/s", "steps_per_s"),
                    ("final validation loss", "final_loss"),
                    ("cos(sample, true image embed)", "cos_to_true_image_embed"),
                ],
                title=f"shapes prior, {args.budget:.0f} s per variant ({args.clock} clock)",
            )
            + f"\nplot: {png}"
        )

    return common.finish(name, result, started, report)


if __name__ == "__main__":
    raise SystemExit(main())
