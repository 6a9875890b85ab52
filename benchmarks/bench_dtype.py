"""Which tensors a float16/bfloat16 pipeline should keep in float32: text encodings and prior
samples of the bundled model against float32, per candidate rule.

    python benchmarks/bench_dtype.py     # about 2 minutes here (bf16 is emulated on AVX2-only CPUs)

Rules: everything in the half dtype; the prior's embedding statistics (``clip_mean``/``clip_std``)
in float32, the rule ``unclip.utils.precision`` applies; plus the CLIP in open_clip's own
low-precision mode (``convert_weights_to_lp``: LayerNorms, embeddings and the positional table stay
float32); plus the sampler's latents and scheduler arithmetic in float32 (the network output cast up
each step). Measured on 8 shapes prompts, one prior candidate each, the model's default prior
settings, seeds 0..7: 1 − cosine of the text embeddings and of the sampled image embeddings to
float32's (the largest over the prompts), and the relative L2 distance of the text token states and
of the sampled image embeddings (the mean).
"""

from __future__ import annotations

import copy
import time

import common
import open_clip.model
import torch
import torch.nn.functional as F

import unclip.sampling.stages
from unclip.diffusion.loop import sample_loop
from unclip.utils.precision import cast_floating, dtype_name

PROMPTS = [
    "a small red circle on the left",
    "a big blue square at the bottom",
    "a green triangle left of a yellow circle",
    "a purple square on a white background",
    "a small orange triangle at the top",
    "a red square right of a blue circle",
    "a yellow circle in the middle",
    "a big green square on the right",
]
RULES = ["all half", "statistics fp32", "+ CLIP open_clip lp", "+ sampler fp32"]
STATS = ["clip_mean", "clip_std"]


def fp32_sampler(denoise, shape, sched, settings, net, desc, **kwargs):
    """``unclip.sampling._sample`` with float32 latents and scheduler steps."""
    return sample_loop(
        lambda x, t: denoise(x, t).float(),
        shape,
        sched,
        num_steps=settings.steps,
        guidance_scale=settings.guidance_scale,
        device=net.device,
        dtype=torch.float32,
        desc=desc,
        **kwargs,
    )


def measure(pipe):
    gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    text = pipe.encode_text(PROMPTS)
    embeds = pipe.sample_image_embeds(PROMPTS, 1, gens, {"prior": {"best_of": 1}}, progress=False)
    return text, embeds


def rel(a, b):
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).mean())


def main() -> int:
    torch.set_num_threads(1)
    started = time.perf_counter()
    base = common.fp32_pipeline()
    ref_text, ref_embeds = measure(base)
    original_sample = unclip.sampling._sample
    rows = []
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for rule in RULES:
                pipe = copy.deepcopy(base)
                for name, module in pipe.modules().items():
                    if name == "clip" and rule.startswith("+ CLIP"):
                        open_clip.model.convert_weights_to_lp(module.model, dtype)
                    else:
                        cast_floating(module, dtype, [] if rule == "all half" else STATS)
                sampler = fp32_sampler if rule == "+ sampler fp32" else original_sample
                unclip.sampling._sample = sampler
                text, embeds = measure(pipe)
                common.log(dtype, rule)
                rows.append(
                    {
                        "dtype": dtype_name(dtype),
                        "rule": rule,
                        "text_1_minus_cos": float(
                            1 - F.cosine_similarity(text.text_embed, ref_text.text_embed).min()
                        ),
                        "tokens_rel_l2": rel(text.text_tokens, ref_text.text_tokens),
                        "prior_rel_l2": rel(embeds, ref_embeds),
                        "prior_1_minus_cos": float(
                            1 - F.cosine_similarity(embeds, ref_embeds).min()
                        ),
                    }
                )
    finally:
        unclip.sampling._sample = original_sample
    result = {"machine": common.machine(), "prompts": PROMPTS, "rows": rows}
    return common.finish("bench_dtype", result, started, report)


def report(r: dict) -> str:
    columns = [
        ("dtype", "dtype"),
        ("kept in float32", "rule"),
        ("text embed 1 − cos (max)", "text_1_minus_cos"),
        ("text tokens rel L2", "tokens_rel_l2"),
        ("prior embeds rel L2", "prior_rel_l2"),
        ("prior embeds 1 − cos (max)", "prior_1_minus_cos"),
    ]
    title = "bundled model, half-precision weights against float32 (8 prompts)"
    return f"machine: {common.machine_line(r['machine'])}\n" + common.table(
        r["rows"], columns, title
    )


if __name__ == "__main__":
    raise SystemExit(main())
