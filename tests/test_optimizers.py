"""SOAP and KL-Shampoo (heavyball) as ``train.optimizer``: settings, the loop's schedule and
clipping, checkpoints without pickles, exact resume."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file

from unclip.cli import train_prior
from unclip.train import checkpoint as ckpt
from unclip.train.config import TrainConfig, load_stage_config
from unclip.train.loop import TrainLoop
from unclip.train.optimizers import checkpoint_state, make_optimizer
from unclip.utils.config import ConfigError

pytest.importorskip("heavyball")
pytestmark = pytest.mark.usefixtures("one_thread")


def weights(folder):
    return load_file(str(next(Path(folder).glob("*.safetensors"))))


def train(out, *overrides, args=()):
    return train_prior.main(
        [str(CONFIGS / "tiny" / "prior.yaml"), f"train.output_dir={out}", "train.progress=false"]
        + list(overrides)
        + list(args)
    )


@pytest.mark.parametrize(
    "optimizer, prior",
    # the Mega recipe: NormFormer + GLU blocks trained by SOAP; KL-Shampoo on diffusers' blocks
    [("soap", ["prior.normformer=true", "prior.ff_activation=swiglu"]), ("kl_shampoo", [])],
)
def test_resume_is_exact(tmp_path, optimizer, prior):
    common = [
        f"train.optimizer={optimizer}",
        "train.precondition_frequency=2",  # the preconditioner is refreshed across the resume
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.warmup_steps=2",
        *prior,
    ]
    assert train(tmp_path / "full", *common) == 0
    assert train(tmp_path / "split", *common, args=["--max-steps-this-run", "2"]) == 0
    assert train(tmp_path / "split", *common, args=["--resume", "latest"]) == 0
    a = weights(tmp_path / "full" / "final" / "prior")
    b = weights(tmp_path / "split" / "final" / "prior")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if prior:
        assert any(".attn.head_scale" in k for k in a)  # the Mega blocks were trained
    # the optimizer state is heavyball's (Kronecker factors), written without pickles
    saved = Path(tmp_path / "full" / "checkpoints" / "step_00000002")
    factors = [k for k in load_file(str(saved / "optimizer.safetensors")) if "_GG_" in k]
    assert factors and "precond_schedule" not in (saved / "optimizer.json").read_text()


@dataclass
class _Config:
    train: TrainConfig


def _update_size(tmp_path, name, **train):
    """|Δw| of 3 loop steps of SOAP on a fixed regression task."""
    cfg = TrainConfig(
        output_dir=str(tmp_path / name),
        optimizer="soap",
        max_steps=3,
        grad_accum_steps=1,
        lr=1e-2,
        weight_decay=0.0,  # decay moves the weights whatever the gradient
        mixed_precision="no",
        ema=False,
        trackers=[],
        progress=False,
        **{"warmup_steps": 0, **train},
    )

    class Task:
        name = "fit"

        def loss(self, model, batch, generators):
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(8, 4, generator=g)
            yield {"x": x, "y": x @ torch.ones(4, 3), "caption": [""] * 8}

    loop = TrainLoop(_Config(cfg))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = model.weight.detach().clone()
    loop.prepare(model)
    loop.run(Task(), data())
    loop.finish()
    return float((model.weight.detach() - before).abs().sum())


def test_schedule_and_clipping_reach_the_preconditioned_optimizer(tmp_path):
    """The loop's warmup sets heavyball's learning rate each step and its clipping happens before
    heavyball's step: a long warmup (lr/1000 ... 3·lr/1000) and a clip to a 1e-12 norm (far below
    Adam's epsilon) each shrink the update by orders of magnitude."""
    free = _update_size(tmp_path, "free")
    warm = _update_size(tmp_path, "warm", warmup_steps=1000)
    clipped = _update_size(tmp_path, "clip", max_grad_norm=1e-12)
    assert free > 0
    assert warm < 0.01 * free
    assert clipped < 0.01 * free


def test_preconditioner_settings_are_checked():
    with pytest.raises(ConfigError, match="train.precondition_frequency must be an integer >= 1"):
        TrainConfig(optimizer="soap", precondition_frequency=0)
    with pytest.raises(ConfigError, match=r"train.shampoo_beta must be in \[0, 1\)"):
        TrainConfig(optimizer="kl_shampoo", shampoo_beta=1.0)
    with pytest.raises(ConfigError, match="train.max_precond_dim must be an integer >= 1"):
        TrainConfig(optimizer="soap", max_precond_dim=0)
    with pytest.raises(ConfigError, match="train.shampoo_beta=0.9 applies to train.optimizer soap"):
        TrainConfig(optimizer="adamw", shampoo_beta=0.9)
    cfg = load_stage_config(
        CONFIGS / "tiny" / "prior.yaml", ["train.optimizer=soap", "train.precondition_1d=true"]
    )
    assert cfg.train.optimizer == "soap" and cfg.train.precondition_1d is True
    with pytest.raises(ConfigError, match="'train.optimizer' must be one of"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["train.optimizer=shampoo"])


def test_missing_heavyball_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "heavyball", None)  # as if not installed
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.0}]
    with pytest.raises(ImportError, match=r"pip install 'unclip\[optim\]'"):
        make_optimizer("soap", groups, lr=1e-3, betas=[0.9, 0.99], eps=1e-8)


def test_optimizer_files_keep_nested_state_and_adamw_layout():
    """heavyball's state (nested per-parameter dicts under int keys, sets, lists of tensors and
    None, tensors in the groups, one tensor in two places) round-trips through safetensors + JSON;
    AdamW keeps the flat layout older checkpoints have."""
    p = torch.nn.Parameter(torch.randn(3, 2))
    for name in ("soap", "kl_shampoo"):
        opt = make_optimizer(
            name, [{"params": [p], "weight_decay": 0.1}], lr=1e-2, betas=[0.9, 0.99], eps=1e-8
        )
        for _ in range(2):
            p.grad = torch.randn(3, 2)
            opt.step()
        state = checkpoint_state(opt)
        tensors, meta = ckpt.optimizer_files(state)
        assert all(k.startswith("tree.") for k in tensors)
        back = ckpt.optimizer_state(dict(tensors), meta, opt.state_dict())
        assert _same(back, state)
    adam = torch.optim.AdamW([p])
    p.grad = torch.randn(3, 2)
    adam.step()
    tensors, meta = ckpt.optimizer_files(adam.state_dict())
    assert set(tensors) == {"state.0.step", "state.0.exp_avg", "state.0.exp_avg_sq"}
    assert "tree" not in meta


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b
