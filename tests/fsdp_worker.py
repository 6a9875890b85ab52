"""Run by tests/test_sharding.py under ``torchrun --nproc_per_node 2`` (gloo) with the environment
``accelerate launch`` derives from ``configs/accelerate/fsdp_8gpu.yaml``: the tiny decoder trained
under FSDP2 in one go, the same run split in two (stop, ``--resume latest``), and a DDP run of the
same config for reference (FSDP switched off for it). One process start for the three runs.

``python fsdp_worker.py CONFIG OUT [OVERRIDE ...]`` (the overrides go to every run)"""

import os
import sys
from pathlib import Path

from accelerate.state import PartialState

from unclip.cli import train_decoder


def main():
    cfg, out = sys.argv[1], Path(sys.argv[2])
    # each run ends with Accelerator.end_training, which destroys the process group; keep it for
    # the next run (process start-up is most of this test's time)
    PartialState.destroy_process_group = lambda self, group=None: None
    common = [
        cfg,
        "train.progress=false",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.sample_every=4",
        "train.warmup_steps=1",
        "train.mixed_precision=no",
        "data.batch_size=4",
        *sys.argv[3:],
    ]

    def run(name, *args):
        assert train_decoder.main([*common, f"train.output_dir={out / name}", *args]) == 0

    run("fsdp_full")
    run("fsdp_split", "--max-steps-this-run", "2")
    run("fsdp_split", "--resume", "latest")
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    run("ddp")


if __name__ == "__main__":
    main()
