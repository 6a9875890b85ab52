"""The diffusion prior's text-position cache (``UnCLIPPrior.conditioned``): prior sampling with
it against the plain forward, same weights, same seeds.

    python benchmarks/bench_prior_cache.py            # results/bench_prior_cache.json
    python benchmarks/bench_prior_cache.py --quick    # 1 round each

Two priors, each through ``pipe.sample_image_embeds`` (text encoding included):

1. the bundled shapes model at its sampling defaults, one batch as its pipeline call makes it
   (``--batch`` prompts, 16 decoder candidates each with its own prior sample, best of 2, guided);
2. the mid-size random model (benchmarks/models.py) at diffusers' ``UnCLIPPipeline`` settings (one
   image, 25 steps, guidance 4, context 77 tokens), as bench_sampling.py's headline runs it.

"plain" swaps the pipeline prior's ``conditioned`` for the full forward every step (what sampling
did before the cache). Variants alternate within rounds after one untimed call each; the speedup is
the median of per-round ratios. Equal outputs: max abs difference of the embeddings.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import common
import models
import torch

from unclip.shapes.evaluate import heldout_samples


@contextlib.contextmanager
def plain_forward(prior):
    """The prior's forward on the whole sequence at every step (the cache off)."""
    prior.conditioned = lambda text: lambda x_t, t: prior(x_t, t, text)
    try:
        yield
    finally:
        del prior.conditioned


def case(pipe, prompts, k: int, sampling, rounds: int) -> dict:
    def run():
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts) * k)]
        text = pipe.encode_text(prompts)
        return pipe.sample_image_embeds(
            text.repeat_interleave(k), 1, gens, sampling, progress=False
        )

    def plain():
        with plain_forward(pipe.prior):
            return run()

    out = {"cached": run(), "plain": plain()}  # untimed: warm-up and the outputs compared
    times = common.interleaved({"cached": run, "plain": plain}, rounds, warmup=0)
    per_image = {key: common.median(ts) / (len(prompts) * k) for key, ts in times.items()}
    return {
        "prompts": len(prompts),
        "prior_samples_per_prompt": k,
        "seconds_per_prior_sample": per_image,
        "speedup": common.paired_ratio(times["plain"], times["cached"]),
        "max_abs_diff": float((out["cached"] - out["plain"]).abs().max()),
        "max_abs": float(out["plain"].abs().max()),
        "runs": times,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16, help="prompts of the bundled model's batch")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 1, 4
    started = time.perf_counter()
    result = {"machine": common.machine(), "rounds": args.rounds}
    shapes = common.fp32_pipeline()
    samples = heldout_samples(args.batch)
    half = args.batch // 2
    prompts = [s.caption for s in samples[: args.batch - half]]
    prompts += [s.caption for s in samples[len(samples) // 2 :][:half]]
    k = shapes.sampling_settings(None)["decoder"].best_of
    common.log("bundled model")
    result["bundled"] = case(shapes, prompts, k, None, args.rounds)
    result["bundled"]["sampling"] = vars(shapes.sampling_settings(None)["prior"])
    common.log("mid model")
    mid = models.mid_pipeline()
    result["mid"] = case(
        mid, ["a red circle to the left of a green triangle"], 1, None, args.rounds
    )
    result["mid"]["sampling"] = vars(mid.sampling_settings(None)["prior"])

    def report(r):
        rows = [
            {
                "model": name,
                "cached s": r[name]["seconds_per_prior_sample"]["cached"],
                "plain s": r[name]["seconds_per_prior_sample"]["plain"],
                "speedup": r[name]["speedup"],
                "max abs diff": r[name]["max_abs_diff"],
            }
            for name in ("bundled", "mid")
        ]
        cols = [(c, c) for c in rows[0]]
        return common.table(rows, cols, "prior sampling, seconds per prior sample")

    out = "bench_prior_cache_quick" if args.quick else "bench_prior_cache"
    return common.finish(out, result, started, report)


if __name__ == "__main__":
    raise SystemExit(main())
