"""Time to quality: this library's trainers vs DALLE2-pytorch's, prior and decoder, shapes world.

    python benchmarks/bench_peers_quality.py --peers-python /work/venv-peers/bin/python
    python benchmarks/bench_peers_quality.py --stage prior --budget 1200 ...  # CPU s per trainer
    python benchmarks/bench_peers_quality.py --quick ...   # a few minutes: runs every path

``bench_peers.py`` compares one training step; this compares what CPU time buys, as curves: each
trainer keeps its EMA weights at 1/8, 1/4, 1/2 and all of its steps (``peers_marks.py``; the CPU
time spent keeping them is not counted), and after training each kept model is scored. The time
to quality of a trainer is the CPU time at which its curve first reaches a threshold (by default
the best score both curves reach), interpolated linearly between the two marks around it. The
marks lie on one run's warmup-cosine schedule, so an early mark is a model still at a high
learning rate, not what a run of that length would end with (the same for both trainers).

The decoder half is ``peers_decoder.py`` (its docstring: the models, options and scoring). For
the prior, both trainers
train a diffusion prior of the same size (the shapes recipe's, ``configs/shapes/prior.yaml``: a
4-layer transformer of width 128 over the bundled shapes CLIP's 64-d embeddings; DALLE2's
``DiffusionPriorNetwork`` sized to the same parameter count, reported) on the same rows: ``--rows``
samples of the shapes world, their CLIP image embeddings precomputed once by ``unclip embed``.
Same recipe where both libraries have the knob: batch 64, AdamW at 5e-4 with weight decay 0.06,
25 warmup steps then cosine decay over the run, gradient clipping at 1.0, EMA 0.999, caption
dropout 0.1, x_0 prediction, 1000-step cosine noise schedule. Each library keeps the rest of its
own design (unclip: PriorTransformer, embedding statistics normalisation, its caption encoding in
the step — with its caption cache, the default; DALLE2: its network, embedding scaling by sqrt(d),
and the caption encodings handed to it precomputed, as its trainer takes them).

"The same budget" is CPU seconds of one single-threaded process per trainer, measured by the
process itself: unclip's whole ``train_prior`` call (statistics, data, caption encoding, export);
DALLE2's training steps (its data is already tensors). Each calibrates its seconds per step on a
short run and then trains the number of steps that fills the budget, so both finish a complete
warmup-cosine schedule. The two trainers run at the same time, one core each.

Scored on held-out shapes captions (another ``shapes_seed``), with the true CLIP image embedding of
each caption's rendered scene: each prior samples with its library's sampler (DDIM 25 steps,
guidance 2, best of 2 by similarity to the caption; DALLE2: its ``p_sample_loop`` with
``timesteps=25`` and ``cond_scale=2``, its default eta) and we report the mean cosine of the sample
to the true image embedding and to the caption's text embedding. For scale: the mean cosine of the
true embeddings to their mean, what a prior that ignores the caption reaches.

Writes ``benchmarks/results/bench_peers_quality.json`` (``_quick`` with ``--quick``) and, where
matplotlib is installed, a ``.png`` of both curves per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import peers_decoder
import torch
import torch.nn.functional as F
from peers_marks import (
    CpuClock,
    dalle2_trainer_settings,
    epoch_batches,
    mark_steps,
    parse_marks,
    plot,
    steps_in_budget,
    threshold_summary,
    train_with_marks,
    unclip_marks,
)

RECIPE = {
    "batch_size": 64,
    "lr": 5e-4,
    "weight_decay": 0.06,
    "warmup_steps": 25,
    "max_grad_norm": 1.0,
    "ema_decay": 0.999,
    "text_drop_prob": 0.1,
}
CALIBRATION_STEPS = 20
# DALLE2-pytorch network of about the parameter count of configs/shapes/prior.yaml's prior
DALLE2_NET = dict(depth=6, dim_head=32, heads=8, ff_mult=8)


# ----------------------------------------------------------------------------------------- data
def prepare(work: Path, rows: int, n_eval: int) -> dict:
    """The training rows (``unclip embed`` of the shapes world, float32), every caption's CLIP
    encoding for DALLE2 (token states zeroed beyond the caption, as DALLE2 reads padding), and the
    held-out evaluation set."""
    import numpy as np
    from bench_ar_prior import CLIP_FOLDER, eval_set

    from unclip.train.embed import EmbedJob, embed

    emb = work / "emb"
    embed(
        EmbedJob(
            source="shapes",
            clip_config=str(CLIP_FOLDER),
            out=str(emb),
            num=rows,
            dtype="float32",
            resolution=32,
            shard_size=max(1000, rows // 4),
            progress=False,
        )
    )
    clip, captions, truth, text = eval_set(n_eval)
    meta = [
        json.loads(line)
        for f in sorted((emb / "metadata").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    images = torch.cat(
        [torch.from_numpy(np.load(f)) for f in sorted((emb / "img_emb").glob("*.npy"))]
    )
    train_captions = [m["caption"] for m in meta]
    unique = sorted(set(train_captions))
    index = {c: i for i, c in enumerate(unique)}
    with torch.no_grad():
        enc = [clip.encode_text(unique[i : i + 256]) for i in range(0, len(unique), 256)]
    torch.save(
        {
            "image_embed": images.float(),
            "caption_index": torch.tensor([index[c] for c in train_captions]),
            "text_embed": torch.cat([e.text_embed for e in enc]),
            "text_tokens": torch.cat([e.text_tokens * e.text_mask[..., None] for e in enc]),
            "eval_text_embed": text.text_embed,
            "eval_text_tokens": text.text_tokens * text.text_mask[..., None],
            "eval_truth": truth,
        },
        work / "dalle2_data.pt",
    )
    return summary(work)


def summary(work: Path) -> dict:
    """What the prior's data was, read back from the tensors :func:`prepare` saved."""
    data = torch.load(work / "dalle2_data.pt")
    truth = data["eval_truth"]
    return {
        "rows": len(data["image_embed"]),
        "distinct_captions": len(data["text_embed"]),
        "eval_captions": len(truth),
        "baseline_cos_true_to_mean_true": float(
            F.cosine_similarity(truth, truth.mean(0, keepdim=True)).mean()
        ),
    }


def _thin(curve: list) -> list:
    """About 200 points of a loss curve (the results file stays small)."""
    return curve[:: max(1, len(curve) // 200)]


# --------------------------------------------------------------------------------------- unclip
def run_unclip(work: Path, budget: float, calib: int) -> dict:
    from bench_ar_prior import eval_set, evaluate, steps_for_budget, train

    overrides = [
        "data.source=embeddings",
        f"data.path={work / 'emb'}",
        f"data.batch_size={RECIPE['batch_size']}",
        f"train.lr={RECIPE['lr']}",
        f"train.weight_decay={RECIPE['weight_decay']}",
        f"train.warmup_steps={RECIPE['warmup_steps']}",
        f"train.max_grad_norm={RECIPE['max_grad_norm']}",
        f"train.ema_decay={RECIPE['ema_decay']}",
        f"train.text_drop_prob={RECIPE['text_drop_prob']}",
    ]
    plan = steps_for_budget("diffusion", work / "unclip", budget, calib, overrides)
    out = work / "unclip" / "run"
    clock, marks = CpuClock(), []
    with unclip_marks(mark_steps(plan["steps"]), work / "unclip" / "marks", clock, marks):
        clock.start()
        cpu, wall, records = train(
            "diffusion", out, [f"train.max_steps={plan['steps']}", *overrides]
        )
    clip, captions, truth, text = eval_set(int(os.environ["BENCH_EVAL"]))
    from unclip.nets.priors import load_prior

    params = sum(
        p.numel()
        for n, p in load_prior(out / "final" / "prior").named_parameters()
        if "clip_mean" not in n and "clip_std" not in n
    )
    curve = [
        {
            "step": m["step"],
            "cpu_seconds": m["cpu_seconds"],
            **evaluate("diffusion", out / "final", clip, captions, truth, text, 1, m["path"]),
        }
        for m in marks
    ]
    return {
        **plan,
        "params": params,
        "train_cpu_seconds": cpu,
        "train_wall_seconds": wall,
        "loss_curve": _thin([(r["step"], r["loss"]) for r in records if "loss" in r]),
        "curve": curve,
        **{k: v for k, v in curve[-1].items() if k not in ("step", "cpu_seconds")},
    }


# --------------------------------------------------------------------------------------- DALLE2
def run_dalle2(work: Path, budget: float, calib: int) -> dict:
    from dalle2_pytorch import DiffusionPrior, DiffusionPriorNetwork, DiffusionPriorTrainer

    data = torch.load(work / "dalle2_data.pt")
    d = data["image_embed"].shape[1]
    ctx = data["text_tokens"].shape[1]

    def build(steps: int):
        random.seed(0)
        torch.manual_seed(0)
        net = DiffusionPriorNetwork(dim=d, max_text_len=ctx, **DALLE2_NET)
        prior = DiffusionPrior(
            net=net,
            image_embed_dim=d,
            timesteps=1000,
            text_cond_drop_prob=RECIPE["text_drop_prob"],
            image_cond_drop_prob=0.0,
            condition_on_text_encodings=True,
            predict_x_start=True,
        )
        trainer = DiffusionPriorTrainer(prior, **dalle2_trainer_settings(RECIPE, steps))
        return prior, trainer

    order = torch.Generator().manual_seed(0)

    def train(trainer, steps, marks=(), folder=None):
        indices = epoch_batches(len(data["image_embed"]), RECIPE["batch_size"], order)

        def step():
            idx = next(indices)
            cap = data["caption_index"][idx]
            loss = trainer(
                text_embed=data["text_embed"][cap],
                image_embed=data["image_embed"][idx].clone(),
                text_encodings=data["text_tokens"][cap],
            )
            trainer.update()
            return loss

        ema = trainer.ema_diffusion_prior.ema_model.state_dict
        return train_with_marks(step, ema, steps, marks, folder)

    step_s, fixed, steps = steps_in_budget(
        lambda n: train(build(10 * calib)[1], n)[0], budget, calib
    )
    prior, trainer = build(steps)
    t0 = time.perf_counter()
    cpu_s, losses, marks = train(trainer, steps, set(mark_steps(steps)), work / "d2_marks")
    wall = time.perf_counter() - t0
    ema = trainer.ema_diffusion_prior.ema_model.eval()
    curve = []
    for m in marks:
        ema.load_state_dict(torch.load(m["path"]))
        curve.append(
            {"step": m["step"], "cpu_seconds": m["cpu_seconds"], **score_dalle2(ema, data)}
        )
    return {
        "cpu_seconds_per_step": step_s,
        "fixed_cpu_seconds": fixed,
        "steps": steps,
        "params": sum(p.numel() for p in prior.net.parameters()),
        "train_cpu_seconds": cpu_s,
        "train_wall_seconds": wall,
        "loss_curve": _thin(losses),
        "curve": curve,
        **{k: v for k, v in curve[-1].items() if k not in ("step", "cpu_seconds")},
    }


def score_dalle2(ema, data: dict) -> dict:
    """DALLE2's prior (EMA weights) sampled for the held-out captions, scored as unclip's is."""
    text_embed, tokens, truth = (
        data["eval_text_embed"],
        data["eval_text_tokens"],
        data["eval_truth"],
    )
    d = truth.shape[1]
    n, best_of = len(truth), 2
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        cond = {
            "text_embed": text_embed.repeat_interleave(best_of, 0),
            "text_encodings": tokens.repeat_interleave(best_of, 0),
        }
        emb = ema.p_sample_loop((n * best_of, d), text_cond=cond, cond_scale=2.0, timesteps=25)
    seconds = time.perf_counter() - t0
    emb = F.normalize(emb.view(n, best_of, d), dim=-1)
    pick = (emb @ F.normalize(text_embed, dim=-1)[..., None]).squeeze(-1).argmax(1)
    emb = emb[torch.arange(n), pick]
    return {
        "cos_to_true_image_embed": float(F.cosine_similarity(emb, truth).mean()),
        "cos_to_text_embed": float(F.cosine_similarity(emb, text_embed).mean()),
        "seconds_per_embedding": seconds / n,
        "sampling": {"timesteps": 25, "cond_scale": 2.0, "best_of": best_of},
    }


WORKERS = {
    ("prior", "unclip"): run_unclip,
    ("prior", "dalle2"): run_dalle2,
    ("decoder", "unclip"): peers_decoder.run_unclip,
    ("decoder", "dalle2"): peers_decoder.run_dalle2,
    ("decoder-rescore", "unclip"): lambda work, *_: peers_decoder.rescore(work, "unclip"),
    ("decoder-rescore", "dalle2"): lambda work, *_: peers_decoder.rescore(work, "dalle2"),
}
LIBS = ("unclip", "dalle2")
# what each stage's curve is scored by, and its name in the tables
QUALITY = {
    "prior": ("cos_to_true_image_embed", "cos to true image embed"),
    "decoder": ("single_all", "single-object all right"),
}


def worker(stage: str, lib: str, work: Path, budget: float, calib: int) -> int:
    torch.set_num_threads(1)
    row = WORKERS[stage, lib](work, budget, calib)
    (work / f"{stage}_{lib}.json").write_text(json.dumps(row))
    return 0


def run_pair(stage: str, args, work: Path, budget: float, calib: int) -> dict:
    """Both trainers of ``stage`` at the same time, one core each; their result rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BENCH_EVAL=str(args.eval))
    if args.marks:
        env["BENCH_MARKS"] = args.marks
    env["PYTHONPATH"] = os.pathsep.join(
        [str(common.ROOT), str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    procs = {}
    for lib, python in zip(LIBS, (sys.executable, args.peers_python)):
        log = (work / f"{stage}_{lib}.log").open("w")
        cmd = [python, __file__, "--worker", stage, lib, str(work), str(budget), str(calib)]
        procs[lib] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=common.ROOT)
        common.log(f"{stage} with {lib}, {budget:.0f} CPU s (log: {log.name})")
    rows = {}
    for lib, proc in procs.items():
        if proc.wait() != 0:
            tail = (work / f"{stage}_{lib}.log").read_text().splitlines()[-30:]
            raise RuntimeError(f"the {lib} {stage} trainer failed:\n" + "\n".join(tail))
        rows[lib] = json.loads((work / f"{stage}_{lib}.json").read_text())
    return rows


# --------------------------------------------------------------------------------------- parent
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("prior", "decoder", "both"), default="both")
    p.add_argument("--budget", type=float, default=300.0, help="prior: CPU seconds per trainer")
    p.add_argument("--rows", type=int, default=65536, help="prior: shapes-world training rows")
    p.add_argument("--eval", type=int, default=256, help="prior: held-out captions to sample")
    p.add_argument(
        "--decoder-budget", type=float, default=900.0, help="decoder: CPU seconds per trainer"
    )
    p.add_argument(
        "--decoder-rows", type=int, default=12288, help="decoder: scenes handed to DALLE2"
    )
    p.add_argument(
        "--decoder-eval", type=int, default=96, help="decoder: held-out single-object prompts"
    )
    p.add_argument("--prior-threshold", type=float, default=None, help="default: both reach it")
    p.add_argument("--decoder-threshold", type=float, default=None, help="default: both reach it")
    p.add_argument("--work", type=Path, default=None, help="run folder (default: a temp folder)")
    p.add_argument("--quick", action="store_true", help="a few seconds of training each")
    p.add_argument(
        "--marks",
        default=None,
        help="fractions of each run at which weights are kept and scored, e.g. "
        "1/64,1/32,1/16,1/8,1/4,1/2,1 (default 1/8,1/4,1/2,1)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results name under benchmarks/results/ (default bench_peers_quality[_quick])",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take a stage's finished trainer results from --work (same budgets) instead of "
        "training again",
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="with --reuse: score the decoders' kept weights again",
    )
    p.add_argument(
        "--peers-python",
        default=os.environ.get("UNCLIP_PEERS_PYTHON", sys.executable),
        help="interpreter of the environment with dalle2_pytorch (env UNCLIP_PEERS_PYTHON)",
    )
    p.add_argument(
        "--worker",
        nargs=5,
        metavar=("STAGE", "LIB", "WORK", "BUDGET", "CALIB"),
        help=argparse.SUPPRESS,
    )
    args = p.parse_args(argv)
    if args.worker:
        stage, lib, work, budget, calib = args.worker
        return worker(stage, lib, Path(work), float(budget), int(calib))
    from bench_peers import skip_message

    probe = subprocess.run(
        [args.peers_python, "-c", "import dalle2_pytorch; print(dalle2_pytorch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        print(skip_message(args.peers_python, (probe.stderr.strip().splitlines() or ["?"])[-1]))
        return 0
    torch.set_num_threads(1)
    started = time.perf_counter()
    name = args.out or ("bench_peers_quality_quick" if args.quick else "bench_peers_quality")
    if args.marks:
        parse_marks(args.marks)  # a bad spec fails here, not in both workers
    calib = dcalib = CALIBRATION_STEPS
    if args.quick:
        args.budget, args.rows, args.eval, calib = 10.0, 2048, 32, 3
        args.decoder_budget, args.decoder_rows, args.decoder_eval, dcalib = 20.0, 512, 8, 3
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_peers_quality_")
        args.work = Path(tmp.name)
    result = {"machine": common.machine(), "dalle2_pytorch": probe.stdout.strip(), "stages": {}}
    stages = ("prior", "decoder") if args.stage == "both" else (args.stage,)
    for stage in stages:
        work = args.work / stage
        work.mkdir(parents=True, exist_ok=True)
        reuse = args.reuse and all((work / f"{stage}_{lib}.json").is_file() for lib in LIBS)
        if stage == "prior":
            if not reuse:
                common.log(f"embedding {args.rows} shapes-world rows")
            r = {
                "budget_cpu_seconds": args.budget,
                "recipe": RECIPE,
                "dalle2_network": DALLE2_NET,
                **(summary(work) if reuse else prepare(work, args.rows, args.eval)),
            }
            budget, steps, threshold = args.budget, calib, args.prior_threshold
        else:
            if not reuse:
                common.log(f"rendering {args.decoder_rows} shapes-world scenes for DALLE2")
            r = {
                "budget_cpu_seconds": args.decoder_budget,
                "recipe": peers_decoder.RECIPE,
                "dalle2_unet": peers_decoder.DALLE2_UNET,
                "dalle2_decoder": peers_decoder.DALLE2_DECODER,
                "sampling": peers_decoder.SAMPLING,
                **(
                    peers_decoder.summary(work)
                    if reuse
                    else peers_decoder.prepare(work, args.decoder_rows, args.decoder_eval)
                ),
            }
            budget, steps, threshold = args.decoder_budget, dcalib, args.decoder_threshold
        if reuse:
            common.log(f"{stage}: the trainers' results already in {work}")
            r["trainers"] = {
                lib: json.loads((work / f"{stage}_{lib}.json").read_text()) for lib in LIBS
            }
            if stage == "decoder" and args.rescore:
                r["trainers"] = run_pair("decoder-rescore", args, work, budget, steps)
        else:
            r["trainers"] = run_pair(stage, args, work, budget, steps)
        curves = {lib: row["curve"] for lib, row in r["trainers"].items()}
        r["time_to_threshold"] = threshold_summary(curves, QUALITY[stage][0], threshold)
        if stage == "decoder":  # the graded figure, for curves that stay at 0 whole-image right
            r["time_to_threshold_parts"] = threshold_summary(curves, "single_parts")
        result["stages"][stage] = r
    if tmp is not None:
        tmp.cleanup()
    result["plot"] = plot(result, common.RESULTS / f"{name}.png")
    return common.finish(name, result, started, report)


def report(r: dict) -> str:
    out = []
    for stage, s in r["stages"].items():
        key, label = QUALITY[stage]
        rows = []
        for lib, t in s["trainers"].items():
            marks = {f"m{i}": f"{p[key]:.3f} @ {p['cpu_seconds'] / 60:.1f}" for i, p in
                     enumerate(t["curve"])}  # fmt: skip
            rows.append({"trainer": lib, **t, **marks})
        cols = [
            ("trainer", "trainer"),
            ("params", "params"),
            ("CPU s per step", "cpu_seconds_per_step"),
            ("steps", "steps"),
            ("training CPU s", "train_cpu_seconds"),
        ] + [(f"{label} @ CPU min, mark {i + 1}", f"m{i}") for i in range(len(rows[0]["curve"]))]
        tt = s["time_to_threshold"]
        title = (
            f"{stage}, {s['budget_cpu_seconds']:.0f} CPU s each; CPU minutes to {label} "
            f"{tt['threshold']:.3f}: unclip {_fmt(tt['unclip'])}, DALLE2 {_fmt(tt['dalle2'])}; "
            f"DALLE2 / unclip {tt['ratio_dalle2_over_unclip'] or float('nan'):.2f}, "
            f"{tt['ratio_is']}"
        )
        out.append(common.table(rows, cols, title))
    return "\n\n".join(out)


def _fmt(t: dict) -> str:
    return "never" if t["cpu_minutes"] is None else f"{t['cpu_minutes']:.2f} ({t['how']})"


if __name__ == "__main__":
    sys.exit(main())
