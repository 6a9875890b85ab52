"""Where the seconds of a cold ``unclip generate`` go: fresh processes, timed start to exit.

    python benchmarks/bench_cold_start.py                # results/bench_cold_start.json
    python benchmarks/bench_cold_start.py --threads 2    # OMP_NUM_THREADS of every process
    python benchmarks/bench_cold_start.py --quick        # 1 round, to check the script runs

Every row is a new Python process (``sys.executable``, the current virtualenv), timed by wall
clock from its start to its exit; the rows of a round run in alternating order (as
``common.rounds_order``) and each figure is the median over ``--rounds``. The rows build up what
the README's first command pays before and after sampling:

- ``python``: the interpreter alone;
- ``import torch``;
- ``torch + diffusers``: the UNet classes the decoder wraps (diffusers imports ``torch._dynamo``
  and, through its single-file loaders, ``scipy.stats``);
- ``torch + open_clip`` (open_clip imports torchvision, whose ops import ``torch._dynamo``);
- ``unclip.pipeline``: everything ``unclip generate`` imports; ``... then os._exit``: the same
  process ended without the interpreter's teardown;
- ``load the bundled model``: ``UnCLIPPipeline.from_pretrained()`` as well (ended at once);
- ``README command``: the README's first command through the console script (which ends
  ``generate`` without the teardown, ``unclip.cli.FAST_EXIT``), and ``README command, with
  teardown``: the same through ``unclip.cli.main``, exiting as Python normally does.

Sampling's own share is what the command reports (``generate.json``'s ``seconds``), recorded per
round. docs/shapes_model.md (the shapes model's card) quotes these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

README_PROMPT = "a small red circle on the left"
README_ARGS = ["generate", README_PROMPT, "--num-images", "4", "--seed", "0", "--no-progress"]
UNET = "from diffusers import UNet2DConditionModel, UNet2DModel"
EXIT = "import os, sys; sys.stdout.flush(); os._exit(0)"
LOAD = "from unclip.pipeline import UnCLIPPipeline; UnCLIPPipeline.from_pretrained()"
MAIN = "import sys; from unclip.cli import main; sys.exit(main())"

ROWS = {
    "python": ["-c", "pass"],
    "import torch": ["-c", "import torch"],
    "torch + diffusers": ["-c", f"import torch; {UNET}"],
    "torch + open_clip": ["-c", "import torch, open_clip"],
    "unclip.pipeline": ["-c", "import unclip.pipeline"],
    "unclip.pipeline then os._exit": ["-c", f"import unclip.pipeline; {EXIT}"],
    "load the bundled model": ["-c", f"{LOAD}; {EXIT}"],
    "README command": ["-m", "unclip.cli", *README_ARGS],
    "README command, with teardown": ["-c", MAIN, *README_ARGS],
}


def run_row(args: list[str], env: dict, out: str) -> tuple[float, float | None]:
    """Wall seconds of one process, and the sampling seconds a generate command reported."""
    extra = ["--out", out] if "generate" in args else []
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args, *extra], check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    if not extra:
        return wall, None
    with open(os.path.join(out, "generate.json"), encoding="utf-8") as f:
        return wall, float(json.load(f)["seconds"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each process")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench_cold_start")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.out = "bench_cold_start_quick" if args.out == "bench_cold_start" else args.out
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    walls: dict[str, list[float]] = {name: [] for name in ROWS}
    sampling: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ROWS:  # one untimed run each: the file cache, .pyc files
            run_row(ROWS[name], env, os.path.join(tmp, "warm"))
        for i in range(args.rounds):
            for name in common.rounds_order(list(ROWS), i):
                wall, seconds = run_row(ROWS[name], env, os.path.join(tmp, f"r{i}"))
                walls[name].append(wall)
                if seconds is not None:
                    sampling.setdefault(name, []).append(seconds)
                common.log(f"round {i} {name}: {wall:.2f} s")
    rows = [
        {
            "row": name,
            "median_s": round(common.median(ws), 2),
            "min_s": round(min(ws), 2),
            "sampling_s": round(common.median(sampling[name]), 2) if name in sampling else "",
        }
        for name, ws in walls.items()
    ]
    result = {
        "machine": common.machine(),
        "threads": env.get("OMP_NUM_THREADS"),
        "rounds": args.rounds,
        "rows": rows,
        "per_round": walls,
        "sampling_per_round": sampling,
    }

    def report(r):
        return common.table(
            r["rows"],
            [
                ("process", "row"),
                ("median s", "median_s"),
                ("min s", "min_s"),
                ("sampling s (reported)", "sampling_s"),
            ],
            f"Cold processes ({common.machine_line(r['machine'])}, {r['rounds']} rounds)",
        )

    return common.finish(args.out, result, started, report)


if __name__ == "__main__":
    raise SystemExit(main())
