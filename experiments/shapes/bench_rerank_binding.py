"""Does the reranking rule read which color goes with which shape? The bundled model's CLIP on clean
renders.

    python experiments/shapes/bench_rerank_binding.py    # results/bench_rerank_binding.json (200)
    python experiments/shapes/bench_rerank_binding.py --num 40   # the scenes of its test

For each held-out two-object scene the pipeline's ``rerank`` chooses among four clean 32 px renders
(``unclip.shapes.evaluate.binding_probe``): the true scene, the same scene with the two objects'
colors swapped, another relation, another shape for one object; once by the plain cosine with the
prompt, once by contrastive reranking (``--contrast``, the decoder's ``rerank_contrast``). Also
times both rules on ``--candidates`` generated-size images for 16 two-object prompts (the extra
cost of the contrast is its text encodings).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# import benchmarks/common.py (timing, machine description, JSON output) from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402

from unclip.sampling.scorers import RERANK_CONTRASTS  # noqa: E402
from unclip.shapes.evaluate import (  # noqa: E402
    BINDING_PROBE_RENDERS,
    binding_probe,
    heldout_samples,
)

common.RESULTS = Path(__file__).resolve().parent / "results"  # experiments/shapes/results/


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=200, help="held-out two-object scenes")
    p.add_argument("--seed", type=int, default=5, help="world seed of the scenes")
    p.add_argument("--contrast", default="shapes", choices=list(RERANK_CONTRASTS))
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_rerank_binding")
    args = p.parse_args(argv)
    if min(args.num, args.candidates, args.repeats) < 1:
        p.error("--num, --candidates and --repeats must be >= 1")
    started = time.perf_counter()
    torch.set_num_threads(1)
    pipe = common.fp32_pipeline()
    counts = binding_probe(pipe, args.num, args.seed, args.contrast)
    picked = {
        rule: dict(zip(BINDING_PROBE_RENDERS, row, strict=True)) for rule, row in counts.items()
    }
    prompts = [s.caption for s in heldout_samples(16)[16:]]
    k = args.candidates
    images = torch.rand(16 * k, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    captions = [c for c in prompts for _ in range(k)]
    times = {}
    for rule, contrast in (("cosine", None), ("contrast", args.contrast)):
        times[rule] = common.median(
            [
                common.timed(lambda c=contrast: pipe.rerank(images, captions, k, c))[0]
                for _ in range(args.repeats)
            ]
        )
    result = {
        "machine": common.machine(),
        "scenes": args.num,
        "world_seed": args.seed,
        "contrast": args.contrast,
        "picked": picked,
        "rerank_seconds_16_prompts": {
            "candidates": k,
            "threads": 1,
            **{rule: round(t, 4) for rule, t in times.items()},
        },
    }
    return common.finish(args.out, result, started, report)


def report(result: dict) -> str:
    rows = [{"rule": rule, **row} for rule, row in result["picked"].items()]
    cols = [("rule", "rule")] + [(name, name) for name in BINDING_PROBE_RENDERS]
    return common.table(rows, cols) + f"\nrerank time: {result['rerank_seconds_16_prompts']}"


if __name__ == "__main__":
    raise SystemExit(main())
