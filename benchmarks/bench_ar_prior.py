"""Diffusion prior vs autoregressive prior on the shapes world, trained for the same CPU time.

    python benchmarks/bench_ar_prior.py                 # 15 CPU minutes of training per prior
    python benchmarks/bench_ar_prior.py --budget 3600   # an hour each
    python benchmarks/bench_ar_prior.py --quick         # about a minute: checks the script runs

Both priors are trained by ``unclip train-prior``'s own function from ``configs/shapes/prior.yaml``
and ``configs/shapes/prior_ar.yaml``, conditioned on the bundled shapes model's CLIP
(``unclip/bundled/shapes/clip``), with the same data stream, batch size, learning rate and EMA.
"The same CPU budget" is CPU seconds of one single-threaded process per prior (no data workers),
everything included (the AR prior's PCA and bucket fit, the diffusion prior's embedding
statistics, data rendering, CLIP encoding, checkpoints). CPU time, not wall time: on a shared
machine the wall time of a run depends on what else runs, its CPU time much less. Two short
calibration runs of each (N and 2N steps) give its CPU seconds per step and its fixed start-up
cost, and the real run is given the number of steps that fills the budget (``train.max_steps``, so
both get a complete warmup-cosine schedule). The real runs' CPU and wall times are reported.

Evaluation, on shapes-world captions the training stream did not show (another ``shapes_seed``):
each prior samples one embedding per caption with its config's sampling settings (both best of 2;
the diffusion prior DDIM 25 steps, guidance 2; the AR prior guidance 2 on the logits, temperature 1,
dot-product token from the top half), one generator per caption, and we report the mean cosine of
the sample to the true CLIP image embedding of that caption's rendered image, the mean cosine to
the caption's text embedding, and seconds per embedding (median of 3 timed batches after a warm-up).
For scale: the mean cosine of the true embeddings to their mean, what a prior that ignores the
caption would reach.

End to end, with the same decoder: each trained prior replaces the bundled model's prior in the
bundled pipeline (its CLIP, decoder and settings, one decoder candidate so that reranking does not
hide a poor embedding), and the shapes evaluator scores the decoder's images of ``--e2e`` held-out
single-object and as many two-object prompts (the bundled model's own prior is scored the same way,
as a reference). ``--e2e-only --work DIR`` adds these scores to an existing result from the priors
trained in ``DIR``.

Writes ``benchmarks/results/bench_ar_prior.json`` (``bench_ar_prior_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import common
import torch
import torch.nn.functional as F

CONFIGS = {
    "diffusion": common.ROOT / "configs" / "shapes" / "prior.yaml",
    "ar": common.ROOT / "configs" / "shapes" / "prior_ar.yaml",
    # not a prior: bench_peers_quality.py trains the shapes decoder with the helpers below
    "decoder": common.ROOT / "configs" / "shapes" / "decoder.yaml",
}
CLIP_FOLDER = common.ROOT / "unclip" / "bundled" / "shapes" / "clip"
EVAL_SEED = 977  # a shapes_seed the training stream (shapes_seed 0) does not use


def stage_config(kind: str, out: Path, overrides: list[str]):
    from unclip.train.config import load_stage_config

    return load_stage_config(
        CONFIGS[kind],
        [
            f"clip.pretrained={CLIP_FOLDER}",
            f"train.output_dir={out}",
            "train.checkpoint_every=0",
            "train.log_every=1",
            "train.progress=false",
            *overrides,
        ],
    )


def train(kind: str, out: Path, overrides: list[str]) -> tuple[float, float, list[dict]]:
    """Train one prior (or the decoder); ``(CPU seconds, wall seconds, metrics records)``. The run
    is this process on one thread with no data workers, so the process's CPU time is all of it."""
    from unclip.train.decoder import train_decoder
    from unclip.train.prior import train_prior

    cfg = stage_config(kind, out, overrides)
    t0, c0 = time.perf_counter(), time.process_time()
    (train_decoder if kind == "decoder" else train_prior)(cfg, overwrite=True)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return cpu, wall, records


def steps_for_budget(kind: str, work: Path, budget: float, calib_steps: int, overrides) -> dict:
    """Calibrate in CPU seconds, which other jobs on a shared machine do not inflate: two short
    runs (``calib_steps`` and twice as many steps) give the CPU seconds per step (their
    difference) and the fixed cost (the rest); then the steps that fill ``budget``."""
    cpu = []
    for n in (calib_steps, 2 * calib_steps):
        cpu.append(
            train(kind, work / f"{kind}_calibration_{n}", [f"train.max_steps={n}", *overrides])[0]
        )
    step_s = max(1e-6, (cpu[1] - cpu[0]) / calib_steps)
    fixed = max(0.0, cpu[0] - step_s * calib_steps)
    steps = max(1, int((budget - fixed) / step_s))
    common.log(
        f"{kind}: {step_s:.3f} CPU s/step, {fixed:.1f} s fixed -> {steps} steps in {budget} CPU s"
    )
    return {"cpu_seconds_per_step": step_s, "fixed_cpu_seconds": fixed, "steps": steps}


def eval_set(n: int):
    """``(captions, true image embeddings [n, D], text encoding)`` of ``n`` held-back scenes."""
    from unclip.nets.clip import CLIP
    from unclip.train.data.loader import batches, make_stream
    from unclip.train.prior_batches import embed_batch

    cfg = stage_config("diffusion", Path(tempfile.gettempdir()) / "unused", [])
    cfg.data.shapes_seed = EVAL_SEED
    clip = CLIP.from_config(cfg.clip)
    stream = make_stream(cfg.data, resolution=clip.image_size, seed=0, rank=0, world_size=1)
    batch = next(iter(batches(stream, n)))
    with torch.no_grad():
        image_embed, text = embed_batch(clip, batch, "cpu")
    return clip, batch["caption"], image_embed.float(), text


def evaluate(
    kind: str, folder: Path, clip, captions, truth, text, repeats: int, weights=None
) -> dict:
    """Sample the prior exported in ``folder`` (with the state dict saved at ``weights`` if
    given) for ``captions`` and score the samples against ``truth`` and the captions."""
    from unclip.diffusion.config import DiffusionConfig
    from unclip.nets.priors import load_prior
    from unclip.sampling.settings import sampling_for
    from unclip.sampling.stages import sample_prior
    from unclip.utils.config import from_dict

    prior = load_prior(folder / "prior").eval()
    if weights is not None:
        prior.load_state_dict(torch.load(weights))
    meta = json.loads((folder / "prior" / "unclip_stage.json").read_text())
    settings = sampling_for("prior", meta["sampling"], ar=kind == "ar")
    diffusion = from_dict(DiffusionConfig, meta["diffusion"])
    null = clip.encode_text([""])
    n = len(captions)

    def run():
        gens = [torch.Generator().manual_seed(i) for i in range(n * settings.best_of)]
        return sample_prior(
            prior,
            text,
            null.repeat_interleave,
            settings,
            diffusion,
            generator=gens,
            progress=False,
        )[0]

    emb = run()  # warm-up, and the samples scored
    times = [common.timed(run)[0] for _ in range(repeats)]
    return {
        "cos_to_true_image_embed": float(F.cosine_similarity(emb, truth).mean()),
        "cos_to_text_embed": float(F.cosine_similarity(emb, text.text_embed).mean()),
        "seconds_per_embedding": common.median(times) / n,
        "sampling": meta["sampling"],
    }


def end_to_end(folder: Optional[Path], num: int) -> dict:
    """Faithfulness end to end: the prior exported in ``folder`` (None: the bundled model's own)
    in the bundled pipeline (its CLIP, decoder and settings; one decoder candidate, so the prior's
    embedding is not rescued by reranking), the decoder's images of ``num`` + ``num`` held-out
    prompts scored by the shapes evaluator."""
    from unclip.diffusion.config import DiffusionConfig
    from unclip.nets.priors import load_prior
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.shapes.evaluate import evaluate_pipeline
    from unclip.utils.config import from_dict

    pipe = common.fp32_pipeline()
    if folder is not None:
        meta = json.loads((folder / "prior" / "unclip_stage.json").read_text())
        diffusion = {**pipe.diffusion, "prior": from_dict(DiffusionConfig, meta["diffusion"])}
        sampling = {**pipe.sampling, "prior": meta["sampling"]}  # checked by the pipeline
        prior = load_prior(folder / "prior").eval()
        pipe = UnCLIPPipeline(
            pipe.clip, prior, pipe.decoder, pipe.upsamplers, diffusion=diffusion, sampling=sampling
        )
    t0 = time.perf_counter()
    rep = evaluate_pipeline(
        pipe, num, sampling={"decoder": {"best_of": 1}}, stages="decoder", batch_size=32
    )
    scores = rep["stages"]["decoder"]
    return {
        "e2e_single_all": scores["single"]["all"],
        "e2e_pair_all": scores["pair"]["all"],
        "e2e_all": scores["all"],
        "e2e_prompts": 2 * num,
        "e2e_seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=900.0, help="training CPU seconds per prior")
    p.add_argument("--eval", type=int, default=256, help="held-back captions to sample")
    p.add_argument("--work", type=Path, default=None, help="run folder (default: a temp folder)")
    p.add_argument("--quick", action="store_true", help="about a minute: checks the script runs")
    p.add_argument(
        "--e2e", type=int, default=48, help="held-out prompts of each kind for end-to-end scoring"
    )
    p.add_argument(
        "--e2e-only",
        action="store_true",
        help="add the end-to-end scores of the priors already trained in --work to the results",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    name = "bench_ar_prior_quick" if args.quick else "bench_ar_prior"
    if args.quick:
        args.e2e = 4
    if args.e2e_only:
        if args.work is None:
            p.error("--e2e-only needs the --work folder of the run that trained the priors")
        result = json.loads((common.ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        for kind in ("diffusion", "ar"):
            result["priors"][kind].update(end_to_end(args.work / kind / "final", args.e2e))
        result["bundled_prior_e2e"] = end_to_end(None, args.e2e)
        return common.finish(name, result, started, report)
    common_ov, ar_ov, calib_steps = [], [], 20
    if args.quick:
        # a few seconds of training each: the numbers mean nothing, the path is exercised
        args.budget, args.eval, calib_steps = 8.0, 16, 3
        common_ov, ar_ov = ["data.batch_size=16"], ["prior.ar.fit_samples=64"]
    overrides_for = {"diffusion": common_ov, "ar": common_ov + ar_ov}
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_ar_prior_")
        args.work = Path(tmp.name)
    clip, captions, truth, text = eval_set(args.eval)
    mean_cos = float(F.cosine_similarity(truth, truth.mean(0, keepdim=True)).mean())
    result = {
        "machine": common.machine(),
        "budget_seconds": args.budget,
        "quick": args.quick,
        "eval_captions": len(captions),
        "baseline_cos_true_to_mean_true": mean_cos,
        "priors": {},
    }
    for kind in ("diffusion", "ar"):
        ov = overrides_for[kind]
        plan = steps_for_budget(kind, args.work, args.budget, calib_steps, ov)
        out = args.work / kind
        cpu, wall, records = train(kind, out, [f"train.max_steps={plan['steps']}", *ov])
        losses = [r["loss"] for r in records if "loss" in r]
        k = max(1, len(losses) // 10)
        row = {
            **plan,
            "train_cpu_seconds": cpu,
            "train_wall_seconds": wall,
            "first_loss": sum(losses[:k]) / k,
            "last_loss": sum(losses[-k:]) / k,
            **evaluate(kind, out / "final", clip, captions, truth, text, 3),
            **end_to_end(out / "final", args.e2e),
        }
        result["priors"][kind] = row
    result["bundled_prior_e2e"] = end_to_end(None, args.e2e)
    if tmp is not None:
        tmp.cleanup()
    return common.finish(name, result, started, report)


def report(r):
    rows = [{"prior": k, **v} for k, v in r["priors"].items()]
    cols = [
        ("prior", "prior"),
        ("steps", "steps"),
        ("train CPU s", "train_cpu_seconds"),
        ("cos(sample, true image)", "cos_to_true_image_embed"),
        ("cos(sample, text)", "cos_to_text_embed"),
        ("s / embedding", "seconds_per_embedding"),
        ("first loss", "first_loss"),
        ("last loss", "last_loss"),
        ("e2e single", "e2e_single_all"),
        ("e2e pair", "e2e_pair_all"),
    ]
    if "bundled_prior_e2e" in r:
        rows.append({"prior": "bundled model's prior (reference)", **r["bundled_prior_e2e"]})
    head = (
        f"budget {r['budget_seconds']:.0f} CPU s per prior; {r['eval_captions']} captions; "
        f"cos(true, mean true) = {r['baseline_cos_true_to_mean_true']:.4f}\n"
        + common.machine_line(r["machine"])
    )
    return head + common.table(rows, cols, "diffusion vs AR prior on shapes")


if __name__ == "__main__":
    raise SystemExit(main())
