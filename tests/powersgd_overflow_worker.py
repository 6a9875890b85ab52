"""Run by tests/test_sharding.py under ``torchrun --nproc_per_node 2`` (gloo): PowerSGD from step 2,
one overflowing step, then training must go on with finite steps.

``python powersgd_overflow_worker.py OUT MODE [stock]``. MODE ``fp32``: the overflow is an infinite
loss on rank 0 only (the loop's non-finite skip path runs). MODE ``scaler``: a
``torch.amp.GradScaler("cpu")`` is put in Accelerate's place (Accelerate makes none on CPU), so the
scaler's own inf check, step skip and back-off run. ``stock``: torch's plain ``powerSGD_hook``
instead of the project's (to show the failure it fixes)."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from unclip.train import distributed as dist_utils
from unclip.train.config import TrainConfig
from unclip.train.loop import NonFiniteError, TrainLoop

OVERFLOW_STEP = 4  # steps 0, 1 plain all-reduce; PowerSGD from step 2


@dataclass
class Config:
    train: TrainConfig


class Regression:
    name = "mlp"

    def __init__(self, loop):
        self.loop = loop

    def loss(self, model, batch, generators):
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        if self.loop.state.step == OVERFLOW_STEP and self.loop.rank == 0:
            loss = loss * float("inf")  # as an fp16 overflow: inf/NaN gradients on one rank
        return loss


def data(rank):
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(99))
    while True:
        x = torch.randn(16, 32, generator=g)
        yield {"x": x, "y": x @ w, "caption": [""] * 16}


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    stock = len(sys.argv) > 3 and sys.argv[3] == "stock"
    cfg = Config(
        TrainConfig(
            output_dir=str(out),
            max_steps=10,
            grad_accum_steps=1,
            warmup_steps=0,
            lr=1e-2,
            mixed_precision="no",
            ema=True,
            ema_decay=0.9,
            trackers=[],
            progress=False,
            log_every=1,
            checkpoint_every=0,
            powersgd_rank=1,
            powersgd_start_step=2,
            max_consecutive_nonfinite=3,
        )
    )
    if stock:  # torch's hook, registered where the loop registers its own
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        def register(model, accelerator, rank, start):
            state = psgd.PowerSGDState(
                None, matrix_approximation_rank=rank, start_powerSGD_iter=start
            )
            model.register_comm_hook(state, psgd.powerSGD_hook)

        dist_utils.register_powersgd = register
    loop = TrainLoop(cfg)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    loop.prepare(model)
    if mode == "scaler":
        # fp16-style loss scaling on CPU: the real GradScaler, wired as Accelerate wires its own
        acc = loop.accelerator
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
        acc.native_amp = True
        acc.state._mixed_precision = "fp16"  # Accelerate unscales only under fp16
        loop.optimizer.__init__(loop.optimizer.optimizer, device_placement=False, scaler=acc.scaler)
    result = {"error": None}
    try:
        loop.run(Regression(loop), data(loop.rank))
        loop.finish()
    except NonFiniteError as exc:
        result["error"] = str(exc)
    result["nonfinite"] = loop.state.nonfinite
    result["rolled_back"] = getattr(loop.powersgd, "rolled_back", None)
    if mode == "scaler":
        result["scale"] = float(loop.accelerator.scaler.get_scale())
    if loop.rank == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
