"""Training speed: samples/s per stage at tiny / small / mid sizes, FLOPs per sample, FLOP
utilisation against this machine's measured matmul peak, peak memory, and how step time grows with
batch and resolution.

    python benchmarks/bench_training.py            # full run (a few minutes)
    python benchmarks/bench_training.py --quick    # ~2 minutes: fewer sizes in the sweep, fewer
    steps

One training step = the stage's real loss function (``unclip.train.prior.prior_loss``,
``unclip.train.decoder.decoder_loss`` / ``upsampler_loss``: condition dropout, noising, frozen-CLIP
text encoding, low-res corruption) + backward + gradient clipping + AdamW (decay / no-decay groups
as in ``TrainingRun``) + EMA update, fp32. Decoder batches carry precomputed CLIP image embeddings
(as with ``unclip embed`` shards); prior batches carry image embeddings; captions are encoded by the
frozen CLIP inside the loss, as in training.

Each configuration runs in its own forked process (imports shared, no compute before the fork):
peak memory is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of that process — reported as the peak
and as the increase over the process's high-water mark after the model, optimizer and batch were
built (activations, gradients, AdamW/EMA state and allocator caching). FLOPs come from
``torch.utils.flop_counter.FlopCounterMode`` over one extra step (forward + backward; CPU SDPA
kernels added, which the stock counter misses); utilisation = achieved FLOP/s ÷ the fp32 matmul peak
(median TFLOP/s of 2048×2048 matmuls) measured in the same run at the same thread count.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
import traceback
import warnings

import common
import models
import torch

DEFAULT_BATCH = {"tiny": 8, "small": 8, "mid": 2}


# ------------------------------------------------------------------------------------------ child
def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _stage_config(stage: str, size: str, resolution: int | None):
    from unclip.train.config import load_stage_config

    s = models.SIZES[size]
    clip = models.clip_model(size)
    data = {
        "stage": stage,
        "clip": {"model_name": f"bench-{size}", "model_cfg": clip.model_cfg},
        "train": {"mixed_precision": "no", "text_drop_prob": 0.1, "image_embed_drop_prob": 0.1},
    }
    if stage == "prior":
        data["prior"] = dict(s["prior"])
        data["diffusion"] = {"prediction_type": "sample"}
    elif stage == "decoder":
        dec = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in s["decoder"].items()
            if k != "cross_attention_dim"
        }
        if resolution:
            dec["sample_size"] = resolution
        data["decoder"] = dec
        data["diffusion"] = {"prediction_type": "epsilon"}
    else:
        up = {k: list(v) if isinstance(v, tuple) else v for k, v in s["upsampler"].items()}
        if resolution:
            up["low_res_size"], up["sample_size"] = resolution // 2, resolution
        data["upsampler"] = up
        data["upsampler_train"] = {"corruption": "blur", "max_noise_level": 250}
        data["diffusion"] = {"prediction_type": "epsilon"}
    return load_stage_config(data), clip


def build(spec: dict):
    """Model, optimizer, EMA, one batch and the step function for ``spec``."""
    from diffusers.training_utils import EMAModel

    from unclip.diffusion.loop import training_scheduler
    from unclip.nets.decoder import UnCLIPDecoder
    from unclip.train.decoder import decoder_loss, upsampler_loss
    from unclip.train.loop import sample_generators
    from unclip.train.prior import prior_loss

    torch.manual_seed(0)
    stage, size, b = spec["stage"], spec["size"], spec["batch"]
    cfg, clip = _stage_config(stage, size, spec.get("resolution"))
    extra = {k: v for k, v in models.SIZES[size]["decoder"].items() if k == "cross_attention_dim"}
    if stage == "prior":
        model = cfg.prior.build(clip)
    elif stage == "decoder":
        model = UnCLIPDecoder.from_clip(clip, **vars(cfg.decoder), **extra)
    else:
        model = cfg.upsampler.build()
    model.train()
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=tuple(t.adam_betas),
        eps=t.adam_eps,
    )
    ema = EMAModel(params, decay=t.ema_decay, use_ema_warmup=t.ema_warmup, power=3 / 4)
    null = clip.encode_text([""])
    sched = training_scheduler(cfg.diffusion)
    gen = torch.Generator().manual_seed(1)
    captions = common.captions(b)
    embeds = torch.nn.functional.normalize(torch.randn(b, clip.embed_dim, generator=gen), dim=-1)
    if stage == "prior":
        batch = {"caption": captions, "image_embed": embeds}
        res = None
    elif stage == "decoder":
        res = cfg.decoder.sample_size
        batch = {
            "caption": captions,
            "image_embed": embeds,
            "image": torch.rand(b, 3, res, res, generator=gen) * 2 - 1,
        }
    else:
        res = cfg.upsampler.sample_size
        batch = {"caption": captions, "image": torch.rand(b, 3, res, res, generator=gen) * 2 - 1}
    counter = {"i": 0}
    dev = torch.device("cpu")

    def loss_fn():
        gens = sample_generators(0, 0, counter["i"] * b, b)
        counter["i"] += 1
        if stage == "prior":
            return prior_loss(model, batch, clip, null, gens, cfg, sched, dev)
        if stage == "decoder":
            return decoder_loss(model, batch, clip, null, gens, cfg, sched, dev)
        return upsampler_loss(model, batch, gens, cfg, sched, dev)

    def step():
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.step(params)
        return float(loss)

    return model, loss_fn, step, res


def child(spec: dict, queue) -> None:
    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(spec["threads"])
        if spec["stage"] == "peak":
            queue.put(
                {
                    "fp32": common.matmul_peak(torch.float32),
                    "bf16": common.matmul_peak(torch.bfloat16),
                    "conv_fp32": common.conv_peak(torch.float32),
                    "conv_bf16": common.conv_peak(torch.bfloat16),
                }
            )
            return
        rss_start = _maxrss_mb()
        adjacent_peak = common.matmul_peak(torch.float32, repeats=5)  # same process, same minute
        adjacent_conv = common.conv_peak(torch.float32, repeats=5)
        model, loss_fn, step, res = build(spec)
        rss_built = _maxrss_mb()
        for _ in range(spec["warmup"]):
            step()
        times, cpu0 = [], time.process_time()
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
        cpu_share = (time.process_time() - cpu0) / sum(times) / spec["threads"]
        rss_peak = _maxrss_mb()
        with common.flop_counter() as fc:  # one more step, forward + backward only
            loss_fn().backward()
        flops = fc.get_total_flops()
        med = common.median(times)
        b = spec["batch"]
        queue.put(
            {
                **spec,
                "resolution": res,
                "params_M": models.param_count(model) / 1e6,
                "step_s": times,
                "median_step_s": med,
                "samples_per_s": b / med,
                "flops_per_step": flops,
                "gflop_per_sample": flops / b / 1e9,
                "achieved_tflops": flops / med / 1e12,
                "rss_after_build_mb": rss_built,
                "rss_peak_mb": rss_peak,
                "rss_step_increase_mb": rss_peak - rss_built,
                "rss_process_start_mb": rss_start,
                "final_loss": loss,
                "cpu_share": cpu_share,
                "adjacent_fp32_peak_tflops": adjacent_peak["tflops"],
                "adjacent_fp32_conv_tflops": adjacent_conv["tflops"],
                "utilisation_adjacent_peak": flops / med / 1e12 / adjacent_peak["tflops"],
                "utilisation_adjacent_conv": flops / med / 1e12 / adjacent_conv["tflops"],
            }
        )
    except Exception:  # report, don't hang the parent
        queue.put({**spec, "error": traceback.format_exc()})


def run_child(spec: dict, target=None) -> dict:
    """``target(spec, queue)`` (default :func:`child`) in a forked process: what it put on the
    queue, or a ``RuntimeError`` with the child's traceback."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=target or child, args=(spec, queue))
    proc.start()
    out = queue.get()
    proc.join()
    if "error" in out:
        raise RuntimeError(f"benchmark configuration {spec} failed:\n{out['error']}")
    return out


# ------------------------------------------------------------------------------------------ parent
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller sweep and fewer steps (about 2 minutes)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per configuration (median; >= 3)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine 2 threads lose to contention)",
    )
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 5)
    if steps < 3:
        parser.error("--steps must be >= 3")
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    result = {
        "machine": common.machine(),
        "args": vars(args),
        "steps_timed": steps,
        "warmup_steps": 1,
    }
    result["machine"]["threads"] = args.threads
    common.log("machine:", common.machine_line(result["machine"]))

    def spec(group, stage, size, batch=None, resolution=None):
        return {
            "group": group,
            "stage": stage,
            "size": size,
            "batch": batch or DEFAULT_BATCH[size],
            "resolution": resolution,
            "steps": steps,
            "warmup": 1,
            "threads": args.threads,
        }

    peaks = [run_child({"stage": "peak", "threads": args.threads})]
    specs = [
        spec("main", st, sz)
        for sz in ("tiny", "small", "mid")
        for st in ("prior", "decoder", "upsampler")
    ]
    batches = (1, 4, 16) if args.quick else (1, 2, 4, 16)  # + the main table's batch 8
    resolutions = (16, 64) if args.quick else (16, 48, 64)  # + 32 px from the batch sweep
    specs += [spec("batch", "decoder", "small", batch=bb) for bb in batches]
    specs += [spec("resolution", "decoder", "small", batch=4, resolution=r) for r in resolutions]
    rows = []
    for s in specs:
        common.log(
            f"[training] {s['stage']} {s['size']} batch {s['batch']} res "
            f"{s['resolution'] or 'native'}"
        )
        rows.append(run_child(s))
    peaks.append(run_child({"stage": "peak", "threads": args.threads}))
    peak = {
        d: common.median([p[d]["tflops"] for p in peaks])
        for d in ("fp32", "bf16", "conv_fp32", "conv_bf16")
    }
    result["matmul_peak_tflops"] = {**peak, "measurements": peaks}
    for r in rows:
        r["utilisation_fp32_peak"] = r["achieved_tflops"] / peak["fp32"]
    result["matmul_peak_tflops"]["fp32_adjacent_median"] = common.median(
        [r["adjacent_fp32_peak_tflops"] for r in rows]
    )
    result["matmul_peak_tflops"]["conv_fp32_adjacent_median"] = common.median(
        [r["adjacent_fp32_conv_tflops"] for r in rows]
    )
    result["per_stage"] = [r for r in rows if r["group"] == "main"]
    small_decoder = [r for r in rows if r["stage"] == "decoder" and r["size"] == "small"]
    result["batch_sweep"] = sorted(
        [r for r in small_decoder if r["group"] in ("main", "batch")], key=lambda r: r["batch"]
    )
    result["resolution_sweep"] = sorted(
        [
            r
            for r in small_decoder
            if r["group"] == "resolution" or (r["group"] == "batch" and r["batch"] == 4)
        ],
        key=lambda r: r["resolution"],
    )
    return common.finish("bench_training", result, started, report)


def report(r: dict) -> str:
    p = r["matmul_peak_tflops"]
    out = [
        f"machine: {common.machine_line(r['machine'])}",
        f"matmul peak (2048², median, {r['machine']['threads']} thread(s)): fp32 "
        f"{p['fp32'] * 1e3:.1f} GFLOP/s, bf16 {p['bf16'] * 1e3:.1f} GFLOP/s (bf16/fp32 = "
        f"{p['bf16'] / p['fp32']:.2f}); fp32 measured next to each configuration: median "
        f"{p['fp32_adjacent_median'] * 1e3:.1f} GFLOP/s",
        f"conv peak (3×3, 256 ch, oneDNN): fp32 {p['conv_fp32'] * 1e3:.1f} GFLOP/s, bf16 "
        f"{p['conv_bf16'] * 1e3:.1f} GFLOP/s; fp32 next to each configuration: median "
        f"{p['conv_fp32_adjacent_median'] * 1e3:.1f} GFLOP/s",
        "utilisation columns use the fp32 peaks measured in the same process just before the "
        "configuration",
    ]
    cols = [
        ("stage", "stage"),
        ("size", "size"),
        ("res", "resolution"),
        ("batch", "batch"),
        ("params M", "params_M"),
        ("step s (median)", "median_step_s"),
        ("samples/s", "samples_per_s"),
        ("GFLOP/sample", "gflop_per_sample"),
        ("GFLOP/s", "gflops"),
        ("util. of fp32 matmul peak", "utilisation_adjacent_peak"),
        ("util. of fp32 conv peak", "utilisation_adjacent_conv"),
        ("CPU share", "cpu_share"),
        ("peak RSS MB", "rss_peak_mb"),
        ("RSS increase in steps MB", "rss_step_increase_mb"),
    ]
    for key, title in (
        ("per_stage", f"training step per stage (fp32, median of {r['steps_timed']} steps)"),
        ("batch_sweep", "batch sweep: small decoder (32 px)"),
        ("resolution_sweep", "resolution sweep: small decoder architecture, batch 4"),
    ):
        rows = [
            {**x, "gflops": x["achieved_tflops"] * 1e3, "resolution": x["resolution"] or "-"}
            for x in r[key]
        ]
        extra = []
        if key != "per_stage":  # growth relative to the sweep's first row
            first = r[key][0]
            for x in rows:
                x["rel_time"] = x["median_step_s"] / first["median_step_s"]
                x["rel_flops"] = x["flops_per_step"] / first["flops_per_step"]
            extra = [("step time ×", "rel_time"), ("FLOPs/step ×", "rel_flops")]
        out.append(common.table(rows, cols[:6] + extra + cols[6:], title))
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
