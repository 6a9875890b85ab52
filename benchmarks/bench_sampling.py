"""Sampling speed: seconds per image per stage and end to end, unclip vs diffusers on the same
weights, and the measured effect of each speed option.

    python benchmarks/bench_sampling.py            # full run (a few minutes)
    python benchmarks/bench_sampling.py --quick    # ~2 minutes: fewer steps

Sections (all in one process, so every ratio is measured side by side in the same run):

1. bundled model (``unclip/bundled/shapes``) if installed: unclip per stage at its default settings.
2. mid-size random pipeline (benchmarks/models.py) vs diffusers' ``UnCLIPPipeline`` loaded from
   :func:`unclip.interop.diffusers.export_diffusers` of the same weights: same prompts, same seed,
   diffusers' default steps and guidance; stage boundaries come from forward pre-hooks (first
   decoder call, first super-res call), identically for both. Equal outputs: max abs difference per
   stage.
3. speed options on the mid pipeline, stage by stage, default vs alternative: SDPA vs the classic
   attention processors, guided/unguided passes batched vs two passes, conditioning once vs per
   step, channels-last, bf16 autocast, bf16 weights, 2 threads vs 1 (``sampling_options.py``).

Timing: variants run in rounds (A B C, then C B A, ...) after one untimed warm-up round; medians
over ``--repeats`` rounds (default 5, 3 with ``--quick``). Ratios are medians of the per-round
ratios (each round's variants ran back to back, so a shift in the shared machine's load cancels);
the ratio of the medians is in the JSON too. ``torch.compile`` is measured separately
(benchmarks/bench_compile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import tempfile
import time
import warnings
from pathlib import Path

import common
import models
import torch
import torch.nn.functional as F
from sampling_options import PROMPTS, bench_end_to_end_bf16, bench_options, with_autocast
from sampling_report import report

from unclip.pipeline.folders import bundled_model_path
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.utils.precision import dtype_name


def quiet():
    warnings.filterwarnings("ignore")
    for name in ("diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------ stage
# timing
class StageClock:
    """Per-stage wall time of one pipeline call from forward pre-hooks on the first network of each
    stage.

    ``boundaries``: ``[(stage_name, module)]`` for every stage after the first; a stage ends when
    the next stage's network is called for the first time. The first stage (``first``) starts at the
    call.
    """

    def __init__(self, first: str, boundaries: list[tuple[str, torch.nn.Module]]):
        self.first, self.names = first, [first] + [n for n, _ in boundaries]
        self.marks: dict[str, float] = {}
        self.handles = [
            module.register_forward_pre_hook(lambda m, a, name=name: self._mark(name))
            for name, module in boundaries
        ]

    def remove(self):
        for h in self.handles:
            h.remove()

    def _mark(self, name):
        self.marks.setdefault(name, (time.perf_counter(), time.process_time()))

    def __call__(self, fn):
        """``(times, fn())``: wall seconds per stage and ``total``, and the process's CPU seconds
        as ``"<stage> (CPU s)"`` (steadier than wall time when other jobs share the cores)."""
        self.marks = {}
        t0 = (time.perf_counter(), time.process_time())
        out = fn()
        end = (time.perf_counter(), time.process_time())
        times, cpu, start = {}, {}, t0
        for a, b in zip(self.names, self.names[1:] + [None]):
            stop = self.marks[b] if b is not None else end
            times[a], cpu[f"{a} (CPU s)"] = stop[0] - start[0], stop[1] - start[1]
            start = stop
        times["total"], cpu["total (CPU s)"] = end[0] - t0[0], end[1] - t0[1]
        return {**times, **cpu}, out


def unclip_clock(pipe: UnCLIPPipeline) -> StageClock:
    first = "prior" if pipe.prior is not None else "decoder"
    bounds = ([("decoder", pipe.decoder)] if pipe.prior is not None else []) + list(
        zip(pipe.upsampler_names, pipe.upsamplers)
    )
    return StageClock(first, bounds)


def run_rounds(fns: dict, repeats: int) -> dict[str, list]:
    """``fns[name]() -> {stage: seconds}``; one warm-up round, then ``repeats`` rounds in
    alternating order."""
    for fn in fns.values():
        fn()
    out = {k: [] for k in fns}
    for i in range(repeats):
        for k in common.rounds_order(list(fns), i):
            out[k].append(fns[k]())
    return out


def medians(runs: list[dict]) -> dict[str, float]:
    return {k: common.median([r[k] for r in runs]) for k in runs[0]}


# ------------------------------------------------------------------------------------------ 1.
# bundled
def bench_bundled(args) -> dict:
    """The bundled (or ``--model``) trained pipeline: fp32 vs the loaded defaults / bf16 autocast /
    bf16 weights / channels-last."""
    try:
        path = Path(args.model) if args.model else bundled_model_path("shapes")
    except FileNotFoundError as exc:
        common.log(f"[bundled] skipped: {exc}")
        return {"skipped": str(exc)}
    common.log(f"[bundled] {path}")
    pipe = UnCLIPPipeline.from_pretrained(path, autocast_dtype=None, memory_format=None)
    sampling = {}
    if args.quick:
        sampling = {"prior": {"steps": 10}, "decoder": {"steps": 10}, "upsampler": {"steps": 5}}
    n = args.batch
    variants = {
        "fp32": pipe,
        # what from_pretrained gives: channels-last, autocast "auto" (bf16 where native)
        "defaults": UnCLIPPipeline.from_pretrained(path),
        "bf16 autocast": with_autocast(pipe),
        "bf16 weights": copy.deepcopy(pipe).to(dtype=torch.bfloat16),
        "channels-last": copy.deepcopy(pipe).to(memory_format=torch.channels_last),
    }
    images = {}

    def caller(name, p):
        clock = unclip_clock(p)

        def call():
            times, out = clock(
                lambda: p(
                    PROMPTS * n,
                    generator=torch.Generator().manual_seed(0),
                    sampling=sampling,
                    output_type="pt",
                    progress=False,
                )
            )
            images[name] = out.images
            return {k: v / n for k, v in times.items()}

        return call

    runs = run_rounds({k: caller(k, p) for k, p in variants.items()}, args.repeats)
    from unclip.interop.diffusers_export import export_problems

    med = {k: medians(v) for k, v in runs.items()}
    ref = images["fp32"]
    settings = {s: vars(c) for s, c in pipe.sampling_settings(sampling).items()}
    return {
        "path": str(path),
        "stages": pipe.stage_names,
        "settings": settings,
        "images_per_call": n,
        "defaults_autocast_dtype": dtype_name(variants["defaults"].autocast_dtype),
        "seconds_per_image": med,
        "speedup_vs_fp32": {
            k: {
                s: common.paired_ratio([x[s] for x in runs["fp32"]], [x[s] for x in v])
                for s in v[0]
            }
            for k, v in runs.items()
        },
        "final_image_max_abs_diff": {k: float((v - ref).abs().max()) for k, v in images.items()},
        "final_image_mean_abs_diff": {k: float((v - ref).abs().mean()) for k, v in images.items()},
        "runs": runs,
        "diffusers_export_problems": export_problems(pipe),
    }


# ------------------------------------------------------------------------------------------ 2. vs
# diffusers
def bench_vs_diffusers(args, pipe: UnCLIPPipeline, tmp: Path) -> dict:
    from diffusers import UnCLIPPipeline as DiffusersUnCLIP

    from unclip.interop.diffusers_export import export_diffusers

    export_diffusers(pipe, tmp / "diffusers")
    dpipe = DiffusersUnCLIP.from_pretrained(str(tmp / "diffusers"))
    # the same weights as a user loads them: from_pretrained's defaults (channels-last, autocast
    # "auto": bf16 where the CPU runs it natively); `pipe` is the fp32 NCHW pipeline
    pipe.save_pretrained(tmp / "unclip")
    fast = UnCLIPPipeline.from_pretrained(tmp / "unclip")
    dpipe.set_progress_bar_config(disable=True)
    steps = (
        {"prior": 25, "decoder": 25, "upsampler": 7}
        if not args.quick
        else {"prior": 10, "decoder": 5, "upsampler": 3}
    )
    sr = pipe.upsampler_names[0]
    sampling = {
        "prior": {"steps": steps["prior"]},
        "decoder": {"steps": steps["decoder"]},
        "upsampler": {"steps": steps["upsampler"]},
    }
    n = args.batch
    prompts = PROMPTS * n
    d_clock = StageClock("prior", [("decoder", dpipe.decoder), (sr, dpipe.super_res_first)])
    captured = {}

    def unclip_caller(name, p):
        clock = unclip_clock(p)

        def call():
            times, out = clock(
                lambda: p(
                    prompts,
                    generator=torch.Generator().manual_seed(0),
                    sampling=sampling,
                    output_type="pt",
                    progress=False,
                    return_intermediates=True,
                )
            )
            captured[name] = out
            return {k: v / n for k, v in times.items()}

        call.clock = clock
        return call

    def diffusers_images(autocast: bool):
        with networks_autocast(dpipe) if autocast else contextlib.nullcontext():
            out = dpipe(
                prompts,
                generator=torch.Generator().manual_seed(0),
                output_type="np",
                prior_num_inference_steps=steps["prior"],
                decoder_num_inference_steps=steps["decoder"],
                super_res_num_inference_steps=steps["upsampler"],
            )
        return torch.from_numpy(out.images).permute(0, 3, 1, 2).float()

    def diffusers_caller(name, autocast):
        def call():
            times, captured[name] = d_clock(lambda: diffusers_images(autocast))
            return {k: v / n for k, v in times.items()}

        return call

    # intermediate outputs of diffusers' stages, for the per-stage equality check
    grabs = {}

    def grab_embeds(module, args_, kwargs, out):
        # the first call's (the fp32 warm-up), as the low-res input below
        grabs.setdefault("image_embeds", kwargs["image_embeddings"].clone())

    def grab_low_res(module, args_, kwargs):
        grabs.setdefault("low_res_up", kwargs["sample"][:, 3:].clone())

    h1 = dpipe.text_proj.register_forward_hook(grab_embeds, with_kwargs=True)
    h2 = dpipe.super_res_first.register_forward_pre_hook(grab_low_res, with_kwargs=True)
    calls = {
        "unclip": unclip_caller("unclip", pipe),
        "unclip defaults": unclip_caller("unclip defaults", fast),
        "diffusers": diffusers_caller("diffusers", autocast=False),
    }
    if args.bf16_both:  # both sides' networks under bf16 autocast, both NCHW (the fp32 format)
        calls["unclip bf16"] = unclip_caller("unclip bf16", with_autocast(pipe))
        calls["diffusers bf16"] = diffusers_caller("diffusers bf16", autocast=True)
    runs = run_rounds(calls, args.repeats)
    for h in (h1, h2, d_clock, *(c.clock for k, c in calls.items() if k.startswith("unclip"))):
        h.remove()
    ours = captured["unclip"]
    size = pipe.upsamplers[0].config.sample_size
    ours_low_up = F.interpolate(
        ours.stage_images["decoder"],
        size=(size, size),
        mode="bicubic",
        align_corners=False,
        antialias=True,
    )
    final_diff = float((ours.images - captured["diffusers"]).abs().max())
    equal = {
        "image_embeds_max_abs_diff": float((ours.image_embeds - grabs["image_embeds"]).abs().max()),
        "image_embeds_max_abs": float(ours.image_embeds.abs().max()),
        "decoder_image_max_abs_diff": float((ours_low_up - grabs["low_res_up"]).abs().max()),
        "final_image_max_abs_diff": final_diff,
        "final_image_mean_abs_diff": float((ours.images - captured["diffusers"]).abs().mean()),
        "final_image_uint8_levels_differing": int(
            ((ours.images * 255).round() != (captured["diffusers"] * 255).round()).sum()
        ),
    }
    # context for the final difference: how much the super-res stage amplifies a 1e-5 change of its
    # input
    small = ours.stage_images["decoder"]
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    a = pipe.upsample(small, g(), sampling, progress=False)
    b = pipe.upsample(
        small + 1e-5 * torch.randn(small.shape, generator=g()), g(), sampling, progress=False
    )
    # in [0, 1] image units
    equal["sr_gain_for_1e-5_input_change"] = float((a - b).abs().max()) / 2 / 1e-5
    med = {k: medians(v) for k, v in runs.items()}
    ratio = {
        s: common.paired_ratio([x[s] for x in runs["unclip"]], [x[s] for x in runs["diffusers"]])
        for s in med["unclip"]
    }
    ratio_of_medians = {s: med["unclip"][s] / med["diffusers"][s] for s in med["unclip"]}
    # speedup (> 1: faster) of what a user gets from from_pretrained over diffusers' pipeline
    speedup = {
        s: common.paired_ratio(
            [x[s] for x in runs["diffusers"]], [x[s] for x in runs["unclip defaults"]]
        )
        for s in med["unclip"]
    }
    d = captured["unclip defaults"].images - captured["diffusers"]
    defaults = {
        "autocast_dtype": dtype_name(fast.autocast_dtype),
        "memory_format": "channels_last",
        "speedup_over_diffusers": speedup,
        "final_image_max_abs_diff_vs_diffusers": float(d.abs().max()),
        "final_image_mean_abs_diff_vs_diffusers": float(d.abs().mean()),
    }
    bf16 = bf16_both(runs, captured, ours.images) if args.bf16_both else None
    return {
        "bf16_both": bf16,
        "steps": steps,
        "guidance": {"prior": 4.0, "decoder": 8.0, "upsampler": 1.0},
        "images_per_call": n,
        "seconds_per_image": med,
        "ratio_unclip_over_diffusers": ratio,
        "ratio_of_medians": ratio_of_medians,
        "equal_outputs": equal,
        "unclip_defaults": defaults,
        "runs": runs,
        "stage_boundaries": (
            "prior = text encoding + prior loop (until the first decoder UNet call); decoder = "
            "decoder conditioning + loop (until the first super-res UNet call); "
            f"{sr} = super-res loop + output conversion"
        ),
    }


@contextlib.contextmanager
def networks_autocast(dpipe):
    """diffusers' denoising networks (prior, decoder, both super-res UNets) each called under CPU
    bf16 autocast with their outputs back in fp32, as unclip's ``autocast_dtype`` runs its own.
    (The whole diffusers call under autocast does not run: its text projection then returns bf16,
    the decoder's latents are created in that dtype, and the bicubic upsampling of the bf16
    decoder image is not implemented.)"""
    nets = [dpipe.prior, dpipe.decoder, dpipe.super_res_first, dpipe.super_res_last]
    for net in nets:
        plain = net.forward

        def forward(*a, _plain=plain, **k):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = _plain(*a, **k)
            if isinstance(out, tuple):
                return tuple(x.float() if torch.is_tensor(x) else x for x in out)
            for key, x in out.items():
                out[key] = x.float()
            return out

        net.forward = forward
    try:
        yield
    finally:
        for net in nets:
            del net.forward  # back to the class's method


def bf16_both(runs: dict, captured: dict, unclip_fp32: torch.Tensor) -> dict:
    """unclip and diffusers both under bf16 autocast: time ratio per stage, and how far the two
    bf16 images are from each other and from their own fp32 images ([0, 1] units)."""
    u, d = runs["unclip bf16"], runs["diffusers bf16"]

    def diff(a, b):
        return {"max_abs": float((a - b).abs().max()), "mean_abs": float((a - b).abs().mean())}

    ub, db = captured["unclip bf16"].images, captured["diffusers bf16"]
    return {
        "memory_format": "NCHW (contiguous) on both sides",
        "ratio_unclip_over_diffusers": {
            s: common.paired_ratio([x[s] for x in u], [x[s] for x in d]) for s in u[0]
        },
        "ratio_of_medians": {s: medians(u)[s] / medians(d)[s] for s in u[0]},
        "speedup_over_fp32": {
            lib: {
                s: common.paired_ratio(
                    [x[s] for x in runs[lib]], [x[s] for x in runs[f"{lib} bf16"]]
                )
                for s in u[0]
            }
            for lib in ("unclip", "diffusers")
        },
        "final_image_diff": {
            "unclip bf16 vs diffusers bf16": diff(ub, db),
            "unclip bf16 vs unclip fp32": diff(ub, unclip_fp32),
            "diffusers bf16 vs diffusers fp32": diff(db, captured["diffusers"]),
            "unclip fp32 vs diffusers fp32": diff(unclip_fp32, captured["diffusers"]),
        },
    }


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about 2 minutes)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds per variant (median; >= 3; default 5, 3 with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine 2 threads lose to contention)",
    )
    parser.add_argument("--batch", type=int, default=1, help="images per pipeline call")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=("bundled", "diffusers", "options")
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a trained pipeline folder for section 1 (default: the bundled shapes model)",
    )
    parser.add_argument(
        "--out",
        default="bench_sampling",
        help="results/<OUT>.json (default %(default)s; the defaults against diffusers were run "
        "with --skip options and stored as bench_sampling_defaults)",
    )
    parser.add_argument(
        "--bf16-both",
        action="store_true",
        help="also time unclip and diffusers both under bf16 autocast (NCHW on both sides) "
        "against diffusers: ratios and image differences under vs_diffusers.bf16_both",
    )
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 3:
        parser.error("--repeats must be >= 3")
    quiet()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {"machine": common.machine(), "args": vars(args)}
    common.log("machine:", common.machine_line(result["machine"]))

    if "bundled" not in args.skip:
        result["bundled"] = bench_bundled(args)
    pipe = models.mid_pipeline()
    result["mid_model"] = {
        "params_M": {k: models.param_count(m) / 1e6 for k, m in pipe.modules().items()},
        "sizes": models.SIZES["mid"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        if "diffusers" not in args.skip:
            common.log("[vs diffusers] exporting and timing")
            result["vs_diffusers"] = bench_vs_diffusers(args, pipe, Path(tmp))
    if "options" not in args.skip:
        result["options"] = bench_options(args, pipe)
        result["bf16_end_to_end"] = bench_end_to_end_bf16(args, pipe)
    return common.finish(args.out, result, started, report)


if __name__ == "__main__":
    raise SystemExit(main())
