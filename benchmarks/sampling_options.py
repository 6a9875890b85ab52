"""Section 3 of ``bench_sampling.py``: the speed options and the naive alternatives they are
measured against, each a modified copy of the mid pipeline timed stage by stage against the
default; a count of the work each pipeline call does once; threads; bf16 autocast end to end.

Not part of the library; imported by ``bench_sampling.py``.
"""

from __future__ import annotations

import contextlib
import copy

import common
import torch

from unclip.nets.text_encoding import TextEncoding
from unclip.pipeline.pipeline import UnCLIPPipeline

# the prompt every section of the benchmark samples
PROMPTS = ["a red circle to the left of a blue square"]


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
