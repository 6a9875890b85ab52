"""Resume at scale: a run with dropout and a DataLoader worker resumes bit-exactly (the random state
is set after the loader starts), from webdataset shards it skips by cursor; PowerSGD's error
feedback and factors are in the checkpoint, so a 2-process PowerSGD run resumes bit-exactly."""

import json
import os
import subprocess

import pytest
import torch
from conftest import CONFIGS, ROOT, TORCHRUN
from safetensors.torch import load_file

from unclip.cli import train_decoder
from unclip.shapes.export import write_shapes


def final_weights(run) -> dict:
    return load_file(str(run / "final" / "decoder" / "diffusion_pytorch_model.safetensors"))


def test_dropout_run_with_a_loader_worker_resumes_exactly_from_shards(tmp_path):
    """Dropout draws from the global generator; starting a DataLoader draws its base seed from it
    too, before the first step of a run. A run stopped after 2 steps and resumed ends with exactly
    the weights of an uninterrupted one, and the checkpoint holds the worker's data cursor and the
    sample counts of the shards it consumed."""
    write_shapes(
        tmp_path / "wds", 24, resolution=16, format="webdataset", shard_size=6, progress=False
    )
    common = [
        str(CONFIGS / "tiny" / "decoder.yaml"),
        "train.progress=false",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.warmup_steps=1",
        "decoder.dropout=0.3",
        "data.source=webdataset",
        f"data.path={tmp_path / 'wds' / '{00000..00003}.tar'}",
        "data.shuffle_buffer=4",
        "data.num_workers=1",
        "data.batch_size=4",
    ]
    full, split = tmp_path / "full", tmp_path / "split"
    assert train_decoder.main([*common, f"train.output_dir={full}"]) == 0
    run = [*common, f"train.output_dir={split}"]
    assert train_decoder.main([*run, "--max-steps-this-run", "2"]) == 0
    cursors = json.loads((split / "checkpoints" / "step_00000002" / "data_0.json").read_text())
    # 2 steps of 4 good samples; the buffer of 4 had taken 12 samples, the first 2 shards of 6
    assert cursors["num_workers"] == 1 and cursors["positions"] == {"0": 8}
    assert [v[0] for v in cursors["shards"].values()] == [6, 6]
    assert train_decoder.main([*run, "--resume", "latest"]) == 0
    a, b = final_weights(full), final_weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_powersgd_run_resumes_exactly(tmp_path):
    """2 gloo processes, PowerSGD from step 2: 6 steps in one go, and 4 then 2 more after a resume
    (a new DDP whose first step uses its initial bucket layout), end with the same weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = ROOT / "tests" / "powersgd_resume_worker.py"
    proc = subprocess.run(
        [*TORCHRUN, str(worker), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, split = (
        load_file(str(tmp_path / run / "weights.safetensors")) for run in ("full", "split")
    )
    assert all(torch.equal(full[k], split[k]) for k in full)
    ckpt = tmp_path / "split" / "checkpoints" / "step_00000004"
    assert {"powersgd_0.safetensors", "powersgd_1.safetensors"} <= {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "powersgd_0.json").read_text())["iter"] >= 4
