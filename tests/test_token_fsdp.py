"""The token families under FSDP2 on 2 CPU processes (gloo), as ``accelerate launch`` with
configs/accelerate/fsdp_8gpu.yaml runs them: ``train-tokenizer`` (dVAE, VQGAN) and ``train-tokens``
(DALL-E, Mega) train with every parameter a DTensor shard and their blocks as FSDP units, the
tokenizers' round-trip metrics run on the sharded model, the exports load and generate, and the
weights match DDP runs of the same configs."""

import json
import os
import subprocess

import pytest
import torch
from conftest import ROOT, TORCHRUN
from safetensors.torch import load_file
from test_sharding import fsdp_env, layout_of

#: run name → the blocks FSDP shards as its own units
UNITS = {
    "dvae": "DVAEBlock",
    "dalle": "DalleBlock",
    "vqgan": "ResnetBlock2D, Attention",
    "mega": "MegaLayer",
}


@pytest.mark.slow
def test_token_families_train_under_fsdp2_on_two_cpu_processes(tmp_path):
    from unclip.pipeline.auto import load_pipeline

    proc = subprocess.run(
        [*TORCHRUN, str(ROOT / "tests" / "token_fsdp_worker.py"), str(tmp_path)],
        env={
            **os.environ,
            **fsdp_env("fsdp_8gpu.yaml"),
            "OMP_NUM_THREADS": "1",
            "ACCELERATE_MIXED_PRECISION": "no",
        },
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy: fsdp on 2 processes" in proc.stderr
    assert "returned a view tensor" not in proc.stderr  # FSDP2's warning on the VQGAN's output
    layouts = json.loads((tmp_path / "layouts.json").read_text())
    for name, block in UNITS.items():
        assert f"({block}) as their own groups" in proc.stderr, name
        layout = layout_of(layouts[f"fsdp_{name}"])  # every parameter is a shard, units > 0
        assert layout["mesh"] == "shard 2", name
        assert not layouts[f"ddp_{name}"], name
        component = "tokenizer" if name in ("dvae", "vqgan") else "transformer"
        fsdp, ddp = (
            load_file(str(tmp_path / run / name / "final" / component / "model.safetensors"))
            for run in ("fsdp", "ddp")
        )
        assert fsdp.keys() == ddp.keys(), name
        assert all(torch.allclose(fsdp[k], ddp[k], atol=1e-4) for k in fsdp), name

    for name in ("dalle", "mega"):
        pipe = load_pipeline(str(tmp_path / "fsdp" / name / "final" / "pipeline"))
        images = pipe(
            ["a red circle"],
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
            progress=False,
        ).images
        assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all(), name
