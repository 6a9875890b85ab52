"""``unclip plan`` for the DALL-E and DALL-E Mega families: a fake-CUDA training step of each tiny
family config through the real training code, and the full-scale configs planned to fit 8 × 80 GB
with a shipped strategy (fake tensors: no memory is allocated)."""

from pathlib import Path

import pytest

from unclip.cli.plan import _load_any_config
from unclip.train.plan import measure_step
from unclip.train.strategies import GiB, memory_plan, read_accelerate_config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


@pytest.mark.parametrize("name", ["dvae", "vqgan", "dalle", "mega"])
def test_fake_cuda_step_of_every_tiny_family_config(name):
    cfg = _load_any_config(ROOT / "configs/tiny" / f"{name}.yaml", ["train.mixed_precision=auto"])
    m = measure_step(cfg)
    assert m.mixed_precision == "fp16" and m.loss_dtype == "float32"
    assert m.component == ("tokenizer" if name in ("dvae", "vqgan") else "transformer")
    trainable = 4 * m.params_trainable
    # the tracker rounds each tensor up to 512 bytes: many small tensors in the tiny networks
    assert trainable <= m.grads < trainable * 1.5
    assert 2 * trainable <= m.optimizer < 2 * trainable * 1.5
    assert m.activations > 0 and m.clip == 0


@pytest.mark.parametrize(
    ("name", "launch", "params"),
    [("dalle_12b", "fsdp_8gpu", 12.5e9), ("dalle_mega", "ddp_8gpu", 2.4e9)],
)
def test_full_scale_family_configs_fit_eight_80gb_gpus(name, launch, params):
    cfg = _load_any_config(ROOT / "configs" / f"{name}.yaml", [])
    strategy = read_accelerate_config(ROOT / "configs/accelerate" / f"{launch}.yaml").strategy
    m = measure_step(cfg)  # at the config's micro-batch
    assert params < m.params_trainable < 1.1 * params
    rows, choice = memory_plan(m, 8, 80 * GiB, strategy, cfg.train.grad_accum_steps)
    assert choice is not None and choice.fits
    assert choice.micro_batch == cfg.data.batch_size
