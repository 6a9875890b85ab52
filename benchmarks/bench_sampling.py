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
   step, channels-last, bf16 autocast, bf16 weights, 2 threads vs 1.

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

from unclip.nets.text_encoding import TextEncoding
from unclip.pipeline.folders import bundled_model_path
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.utils.precision import dtype_name

PROMPTS = ["a red circle to the left of a blue square"]


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


# ------------------------------------------------------------------------------------------ 3.
# options
@contextlib.contextmanager
def threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def classic_attention(pipe: UnCLIPPipeline) -> UnCLIPPipeline:
    """A copy using diffusers' non-SDPA processors (explicit softmax(QK^T)V)."""
    from diffusers.models.attention_processor import AttnAddedKVProcessor, AttnProcessor

    p = copy.deepcopy(pipe)
    p.prior.transformer.set_attn_processor(AttnProcessor())
    p.decoder.unet.set_attn_processor(AttnAddedKVProcessor())
    return p


def two_pass_guidance(pipe: UnCLIPPipeline) -> UnCLIPPipeline:
    """A copy whose prior and decoder run the [uncond; cond] batch as two separate forward
    passes."""
    p = copy.deepcopy(pipe)
    prior_conditioned, dec_fwd = p.prior.conditioned, p.decoder.forward

    def prior_two(text):  # the sampler's per-step function (UnCLIPPrior.conditioned), per half
        h = len(text) // 2
        halves = prior_conditioned(text[:h]), prior_conditioned(text[h:])
        return lambda x_t, t: torch.cat([halves[0](x_t[:h], t), halves[1](x_t[h:], t)])

    def decoder_two(x_t, t, image_embed=None, text=None, drop_image=None, cond=None):
        h = x_t.shape[0] // 2
        halves = [tuple(c[s] for c in cond) for s in (slice(0, h), slice(h, None))]
        return torch.cat([dec_fwd(x_t[:h], t, cond=halves[0]), dec_fwd(x_t[h:], t, cond=halves[1])])

    p.prior.conditioned, p.decoder.forward = prior_two, decoder_two
    return p


def conditioning_per_step(pipe: UnCLIPPipeline) -> UnCLIPPipeline:
    """A copy that recomputes the decoder conditioning (projections of image embedding and text
    tokens) at every step, as a naive implementation would."""
    p = copy.deepcopy(pipe)
    condition, dec_fwd, saved = p.decoder.condition, p.decoder.forward, {}

    def remember(image_embed, text, drop_image=None):
        saved["args"] = (image_embed, text, drop_image)
        return condition(image_embed, text, drop_image)

    def recompute(x_t, t, image_embed=None, text=None, drop_image=None, cond=None):
        return dec_fwd(x_t, t, cond=condition(*saved["args"]))

    p.decoder.condition, p.decoder.forward = remember, recompute
    return p


def with_autocast(pipe):
    p = copy.deepcopy(pipe)
    p.autocast_dtype = torch.bfloat16
    return p


def bench_options(args, pipe: UnCLIPPipeline) -> dict:
    n = args.batch
    steps = (
        {"prior": 25, "decoder": 6, "upsampler": 4}
        if not args.quick
        else {"prior": 10, "decoder": 2, "upsampler": 2}
    )
    repeats = args.repeats
    sampling, stage_fn, inputs = common.stage_runners(pipe, PROMPTS * n, steps)
    text, embeds = inputs["text"], inputs["embeds"]

    bf16_weights = copy.deepcopy(pipe).to(dtype=torch.bfloat16)
    cl = copy.deepcopy(pipe).to(memory_format=torch.channels_last)
    # (name, what, default-or-alternative pipeline, stages it can affect, thread count)
    variants = [
        (
            "attention: classic (non-SDPA) processors",
            "alternative",
            classic_attention(pipe),
            ("prior", "decoder"),
            None,
        ),
        (
            "guidance: two forward passes per step",
            "alternative",
            two_pass_guidance(pipe),
            ("prior", "decoder"),
            None,
        ),
        (
            "decoder conditioning recomputed every step",
            "alternative",
            conditioning_per_step(pipe),
            ("decoder",),
            None,
        ),
        (
            "channels-last (pipe.to(memory_format=torch.channels_last))",
            "option",
            cl,
            ("decoder", "upsampler"),
            None,
        ),
        (
            "bf16 autocast (pipe.autocast_dtype = torch.bfloat16)",
            "option",
            with_autocast(pipe),
            ("prior", "decoder", "upsampler"),
            None,
        ),
        (
            "bf16 weights (pipe.to(dtype=torch.bfloat16))",
            "option",
            bf16_weights,
            ("prior", "decoder", "upsampler"),
            None,
        ),
    ]
    rows, raw = [], {}
    for stage in ("prior", "decoder", "upsampler"):
        fns = {"baseline": stage_fn(pipe, stage)}
        for name, _, p, stages, nthreads in variants:
            if stage in stages:
                fn = stage_fn(p, stage)
                fns[name] = lambda fn=fn, k=nthreads: _with_threads(fn, k)
        with torch.no_grad():
            outs = {k: f() for k, f in fns.items()}
        ref = outs["baseline"]
        common.log(f"[options] {stage}: {len(fns)} variants × {repeats} rounds")
        times = common.interleaved(fns, repeats, warmup=1)
        raw[stage] = times
        base = common.median(times["baseline"])
        for name, kind, _, _, _ in [("baseline", "default", None, (), None)] + variants:
            if name not in times:
                continue
            t = common.median(times[name])
            delta = (outs[name].float() - ref.float()).abs()
            rows.append(
                {
                    "stage": stage,
                    "variant": name,
                    "kind": kind,
                    "s_per_image": t / n,
                    "s_per_step": t / steps[stage] / n,
                    "speedup_vs_default": common.paired_ratio(times["baseline"], times[name]),
                    "ratio_of_medians": base / t,
                    "max_abs_diff": float(delta.max()),
                    "mean_abs_diff": float(delta.mean()),
                }
            )
    return {
        "steps": steps,
        "images_per_call": n,
        "repeats": repeats,
        "rows": rows,
        "raw_seconds": raw,
        "work_done_once": verify_work_done_once(pipe, text, embeds, repeats),
        "threads": thread_check(pipe, text, embeds, repeats),
        "note": (
            "speedup_vs_default > 1: the variant is faster than the default pipeline; stage "
            "outputs compared with the default's from the same inputs (prior: embeddings, "
            "decoder/upsampler: images in [-1, 1])"
        ),
    }


def verify_work_done_once(
    pipe: UnCLIPPipeline, text: TextEncoding, embeds: torch.Tensor, repeats: int
) -> dict:
    """Count conditioning computations and network calls (with their batch sizes) in one pipeline
    call, and time the decoder conditioning against one guided decoder forward pass."""
    p = copy.deepcopy(pipe)
    calls = {"decoder.condition": 0, "clip.encode_text": 0}
    cond_fn, enc_fn = p.decoder.condition, p.clip.encode_text

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    p.decoder.condition = counted("decoder.condition", cond_fn)
    p.clip.encode_text = counted("clip.encode_text", enc_fn)
    batches = {name: [] for name in p.denoisers()}
    step_nets = p.denoisers()
    # the prior's sampler runs the transformer's blocks itself (UnCLIPPrior.conditioned): one pass
    # over the text positions, then one per step over the three positions that change
    step_nets["prior"] = p.prior.transformer.transformer_blocks[-1]
    for name, net in step_nets.items():
        net.register_forward_pre_hook(
            lambda m, a, k, name=name: batches[name].append(
                (a[0] if a else next(iter(k.values()))).shape[0]
            ),
            with_kwargs=True,
        )
    sampling = {"prior": {"steps": 3}, "decoder": {"steps": 3}, "upsampler": {"steps": 2}}
    p(
        PROMPTS,
        generator=torch.Generator().manual_seed(0),
        sampling=sampling,
        output_type="pt",
        progress=False,
    )
    b = len(PROMPTS)
    both = TextEncoding.cat([pipe.null_text(b), text])
    e2 = torch.cat([embeds[:b], embeds[:b]])
    drop = torch.arange(2 * b) < b
    cond = pipe.decoder.condition(e2, both, drop)
    size = pipe.decoder.config.sample_size
    x = torch.randn(2 * b, 3, size, size)
    with torch.no_grad():
        times = common.interleaved(
            {
                "condition": lambda: pipe.decoder.condition(e2, both, drop),
                "forward": lambda: pipe.decoder(x, torch.tensor(500), cond=cond),
            },
            max(repeats, 5),
        )
    c, f = common.median(times["condition"]), common.median(times["forward"])
    return {
        "calls_per_pipeline_call": calls,
        "network_batch_sizes_per_step": batches,
        "sampling": sampling,
        "prompts": b,
        "decoder_condition_s": c,
        "decoder_guided_forward_s": f,
        "condition_over_forward": c / f,
    }


def thread_check(
    pipe: UnCLIPPipeline, text: TextEncoding, embeds: torch.Tensor, repeats: int
) -> dict:
    """One guided decoder forward pass at the configured thread count vs twice as many threads."""
    b = len(text)
    both = TextEncoding.cat([pipe.null_text(b), text])
    cond = pipe.decoder.condition(torch.cat([embeds, embeds]), both, torch.arange(2 * b) < b)
    size = pipe.decoder.config.sample_size
    x = torch.randn(2 * b, 3, size, size)
    n = torch.get_num_threads()
    with torch.no_grad():
        fn = lambda: pipe.decoder(x, torch.tensor(500), cond=cond)  # noqa: E731
        times = common.interleaved(
            {f"{n} thread(s)": fn, f"{2 * n} threads": lambda: _with_threads(fn, 2 * n)}, repeats
        )
    return {
        "decoder_guided_forward_s": {k: common.median(v) for k, v in times.items()},
        "speedup_of_more_threads": common.paired_ratio(
            times[f"{n} thread(s)"], times[f"{2 * n} threads"]
        ),
        "raw": times,
    }


def _with_threads(fn, k):
    if k is None:
        return fn()
    with threads(k):
        return fn()


def bench_end_to_end_bf16(args, pipe: UnCLIPPipeline) -> dict:
    """End-to-end image difference of bf16 autocast vs fp32 (same seed), and the first-step
    error."""
    sampling = {
        "prior": {"steps": 10},
        "decoder": {"steps": 5 if args.quick else 10},
        "upsampler": {"steps": 3},
    }
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    ref = pipe(PROMPTS, generator=g(), sampling=sampling, output_type="pt", progress=False).images
    p = with_autocast(pipe)
    out = p(PROMPTS, generator=g(), sampling=sampling, output_type="pt", progress=False).images
    text = pipe.encode_text(PROMPTS)
    x = torch.randn(2, 3, 64, 64, generator=g())
    both = TextEncoding.cat([pipe.null_text(len(text)), text])
    cond = pipe.decoder.condition(torch.randn(2, pipe.clip.embed_dim, generator=g()), both)
    with torch.no_grad():
        a = pipe.decoder(x, torch.tensor(500), cond=cond)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = pipe.decoder(x, torch.tensor(500), cond=cond).float()
    return {
        "final_image_max_abs_diff": float((out - ref).abs().max()),
        "final_image_mean_abs_diff": float((out - ref).abs().mean()),
        "decoder_one_forward_rel_l2": float((a - b).norm() / a.norm()),
        "sampling": sampling,
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


def report(r: dict) -> str:
    out = [f"machine: {common.machine_line(r['machine'])}"]
    b = r.get("bundled")
    if b is not None:
        if "skipped" in b:
            out.append(f"\nbundled model: skipped ({b['skipped']})")
        else:
            med, sp = b["seconds_per_image"], b["speedup_vs_fp32"]
            rows = [
                {
                    "variant": k,
                    **{s: f"{med[k][s]:.3g} ({sp[k][s]:.2f}×)" for s in med[k]},
                    "max_diff": b["final_image_max_abs_diff"][k],
                    "mean_diff": b["final_image_mean_abs_diff"][k],
                }
                for k in med
            ]
            cols = [("variant", "variant")] + [
                (f"{s} s/image (speedup)", s) for s in next(iter(med.values()))
            ]
            cols += [("final max abs diff", "max_diff"), ("final mean abs diff", "mean_diff")]
            out.append(
                common.table(
                    rows,
                    cols,
                    f"trained model {b['path']} (stages {', '.join(b['stages'])}, "
                    f"median of {r['args']['repeats']})",
                )
            )
    v = r.get("vs_diffusers")
    if v is not None:
        rows = [
            {
                "stage": s,
                "u": v["seconds_per_image"]["unclip"][s],
                "d": v["seconds_per_image"]["diffusers"][s],
                "ratio": v["ratio_unclip_over_diffusers"][s],
            }
            for s in v["seconds_per_image"]["unclip"]
        ]
        out.append(
            common.table(
                rows,
                [
                    ("stage", "stage"),
                    ("unclip s/image", "u"),
                    ("diffusers s/image", "d"),
                    ("unclip / diffusers (median of per-round ratios)", "ratio"),
                ],
                f"mid model: unclip vs diffusers UnCLIPPipeline (steps {v['steps']}, "
                f"median of {r['args']['repeats']})",
            )
        )
        e = v["equal_outputs"]
        out.append(
            "equal outputs (same seed): " + ", ".join(f"{k} = {val:.3g}" for k, val in e.items())
        )
        bf = v.get("bf16_both")
        if bf is not None:
            sec = v["seconds_per_image"]
            rows = [
                {
                    "stage": s,
                    "u": sec["unclip bf16"][s],
                    "d": sec["diffusers bf16"][s],
                    "ratio": bf["ratio_unclip_over_diffusers"][s],
                    "su": bf["speedup_over_fp32"]["unclip"][s],
                    "sd": bf["speedup_over_fp32"]["diffusers"][s],
                }
                for s in bf["ratio_unclip_over_diffusers"]
            ]
            out.append(
                common.table(
                    rows,
                    [
                        ("stage", "stage"),
                        ("unclip bf16 s/image", "u"),
                        ("diffusers bf16 s/image", "d"),
                        ("unclip / diffusers (median of per-round ratios)", "ratio"),
                        ("unclip bf16 speedup over its fp32", "su"),
                        ("diffusers bf16 speedup over its fp32", "sd"),
                    ],
                    f"mid model: both under bf16 autocast, {bf['memory_format']}",
                )
            )
            out.append(
                "final image differences ([0, 1]): "
                + "; ".join(
                    f"{k}: max {d['max_abs']:.3g}, mean {d['mean_abs']:.3g}"
                    for k, d in bf["final_image_diff"].items()
                )
            )
        f = v["unclip_defaults"]
        rows = [
            {
                "stage": s,
                "u": v["seconds_per_image"]["unclip defaults"][s],
                "d": v["seconds_per_image"]["diffusers"][s],
                "x": f["speedup_over_diffusers"][s],
            }
            for s in f["speedup_over_diffusers"]
        ]
        out.append(
            common.table(
                rows,
                [
                    ("stage", "stage"),
                    ("unclip defaults s/image", "u"),
                    ("diffusers s/image", "d"),
                    ("speedup over diffusers (median of per-round ratios)", "x"),
                ],
                f"mid model: from_pretrained's defaults (autocast {f['autocast_dtype']}, "
                "channels-last) vs diffusers UnCLIPPipeline (fp32)",
            )
        )
    o = r.get("options")
    if o is not None:
        out.append(
            common.table(
                o["rows"],
                [
                    ("stage", "stage"),
                    ("variant", "variant"),
                    ("kind", "kind"),
                    ("s/image", "s_per_image"),
                    ("speedup vs default", "speedup_vs_default"),
                    ("max abs diff", "max_abs_diff"),
                    ("mean abs diff", "mean_abs_diff"),
                ],
                f"speed options on the mid model (steps {o['steps']}, median of {o['repeats']})",
            )
        )
    if o is not None:
        w = o["work_done_once"]
        out.append(
            f"work done once per call: {w['calls_per_pipeline_call']}; network batch sizes per "
            f"step ({w['prompts']} prompt(s)): {w['network_batch_sizes_per_step']}; decoder "
            f"conditioning {w['decoder_condition_s'] * 1e3:.2f} ms = "
            f"{w['condition_over_forward']:.2%} of one guided decoder forward "
            f"({w['decoder_guided_forward_s']:.3f} s)"
        )
        t = o["threads"]
        out.append(
            f"threads: one guided decoder forward {t['decoder_guided_forward_s']}; speedup of "
            f"doubling the threads {t['speedup_of_more_threads']:.2f}"
        )
    e = r.get("bf16_end_to_end")
    if e is not None:
        out.append(
            "bf16 autocast end to end vs fp32: " + ", ".join(f"{k} = {val}" for k, val in e.items())
        )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
