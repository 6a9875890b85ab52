"""DDIM inversion's round trip against its fixed-point refinement, on held-out shapes renders.

    python benchmarks/bench_inversion.py                 # results/bench_inversion.json, key default
    python benchmarks/bench_inversion.py --num 4 --steps 10 --fixed-point 0 2 --out /tmp/inv

For every (steps, fixed_point) pair, each render is inverted through the decoder from the empty
caption at guidance 1 and decoded back; the table gives the round trip's RMSE (in [-1, 1] units at
the decoder's resolution) over the renders, how many exceed 0.1, and the RMSE of the render of
tests/test_editing.py. ``--caption-steps`` adds rows inverted with each render's caption. The model
is the bundled one unless ``--model``; autocast as the pipeline's defaults pick it on this machine.
docs/editing.md reads the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common
import torch

from unclip.pipeline import editing
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.shapes.world import ShapesWorld
from unclip.utils.precision import dtype_name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a pipeline folder (default: the bundled one)")
    p.add_argument("--num", type=int, default=12, help="held-out renders")
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 50])
    p.add_argument("--fixed-point", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--caption-steps", type=int, nargs="*", default=[20])
    p.add_argument(
        "--damping",
        type=float,
        default=editing.FIXED_POINT_DAMPING,
        help="how far each iteration moves towards its new solution (the library's: 0.5)",
    )
    p.add_argument("--out", default="bench_inversion:default")
    args = p.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    editing.FIXED_POINT_DAMPING = args.damping  # a benchmark knob, not a library setting
    pipe = UnCLIPPipeline.from_pretrained(args.model)
    spec = "ShapesWorld(128, seed=5, split='heldout', two_object_prob=0.5)"
    world = ShapesWorld(128, seed=5, split="heldout", two_object_prob=0.5)
    renders = [world[i] for i in range(args.num)]
    # the render tests/test_editing.py inverts
    test = ShapesWorld(128, seed=5, split="heldout", two_object_prob=0.0)[0]

    def rmse(sample, steps, fixed_point, caption):
        inv = pipe.invert(
            sample.image,
            caption=sample.caption if caption else None,
            steps=steps,
            fixed_point=fixed_point,
            progress=False,
        )
        return round(inv.error, 4)

    runs = [(s, k, False) for s in args.steps for k in args.fixed_point]
    runs += [(s, k, True) for s in args.caption_steps for k in (0, 2)]
    rows = []
    for steps, k, caption in runs:
        errors = [rmse(r, steps, k, caption) for r in renders]
        rows.append(
            {
                "steps": steps,
                "fixed_point": k,
                "caption": "each render's" if caption else "empty",
                "inversion_evaluations": steps * (1 + k),
                "rmse": errors,
                "rmse_median": statistics.median(errors),
                "rmse_max": max(errors),
                "above_0.1": sum(e > 0.1 for e in errors),
                "test_image_rmse": rmse(test, steps, k, caption),
            }
        )
        common.log(common.table(rows[-1:], COLUMNS))
    result = {
        "command": ["python", "benchmarks/bench_inversion.py", *sys.argv[1:]],
        "model": args.model or "shapes",
        "renders": f"{spec}[0:{args.num}]",
        "test_image": "ShapesWorld(128, seed=5, split='heldout', two_object_prob=0.0)[0]",
        "autocast_dtype": dtype_name(pipe.autocast_dtype),
        "guidance_scale": 1.0,
        "damping": args.damping,
        "machine": common.machine(),
        "rows": rows,
    }
    return common.finish(args.out, result, started, lambda r: common.table(r["rows"], COLUMNS))


COLUMNS = [
    ("steps", "steps"),
    ("fixed_point", "fixed_point"),
    ("caption", "caption"),
    ("evaluations", "inversion_evaluations"),
    ("RMSE median", "rmse_median"),
    ("RMSE worst", "rmse_max"),
    ("above 0.1", "above_0.1"),
    ("test image", "test_image_rmse"),
]

if __name__ == "__main__":
    sys.exit(main())
