"""Check ``unclip plan``'s memory method against real CPU training steps.

For each mid-size stage below, the plan's estimate of one step's peak (measured on fake CPU tensors,
with the stand-in backward) is compared with the peak of a real CPU step (real backward), both
counted by the same tracker (live tensor storages, 512-byte rounding). fp32, two micro-batches of
accumulation, so the second micro-batch runs with the first one's gradients held.

    python benchmarks/bench_plan.py            # writes benchmarks/results/bench_plan.json
"""

from __future__ import annotations

import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import ROOT, machine, write_json  # noqa: E402

from unclip.train.config import load_stage_config  # noqa: E402
from unclip.train.plan import measure_step  # noqa: E402
from unclip.train.plan_measure import real_cpu_step_peak  # noqa: E402

MiB = 2**20
MID_DECODER = [
    "decoder.sample_size=64",
    "data.resolution=64",
    "decoder.block_out_channels=[128,256]",
    "decoder.layers_per_block=2",
    "decoder.attention_head_dim=32",
    "data.batch_size=8",
]
CASES = {
    "decoder 64px, checkpointing off": ("configs/tiny/decoder.yaml", MID_DECODER),
    "decoder 64px, checkpointing on": (
        "configs/tiny/decoder.yaml",
        MID_DECODER + ["train.gradient_checkpointing=true"],
    ),
    "upsampler 32→64": ("configs/tiny/sr64.yaml", ["data.batch_size=8"]),
    "prior": ("configs/tiny/prior.yaml", ["data.batch_size=64"]),
}


def main() -> None:
    rows = []
    common = ["train.mixed_precision=no", "clip.pretrained=null", "train.grad_accum_steps=2"]
    for name, (path, overrides) in CASES.items():
        cfg = load_stage_config(ROOT / path, common + overrides)
        est = measure_step(cfg, device_type="cpu")
        real = real_cpu_step_peak(cfg)
        rows.append(
            {
                "case": name,
                "params_M": est.params_total / 1e6,
                "estimate_MiB": est.peak / MiB,
                "real_MiB": real / MiB,
                "error_pct": 100 * (est.peak - real) / real,
            }
        )
        print(
            f"{name:34s} {est.params_total / 1e6:6.1f}M params  estimate {est.peak / MiB:8.1f} MiB"
            f"  real {real / MiB:8.1f} MiB  error {rows[-1]['error_pct']:+5.1f} %",
            flush=True,
        )
    print(f"wrote {write_json('bench_plan', {'machine': machine(), 'rows': rows})}")


if __name__ == "__main__":
    main()
