"""Run by tests/test_resume_at_scale.py under ``torchrun --nproc_per_node 2`` (gloo): a small
regression trained with PowerSGD (from step 2) for 6 steps in one go, then the same run stopped
after 4 steps and resumed. Each run writes its final weights (rank 0).

``python powersgd_resume_worker.py OUT``"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.state import PartialState
from safetensors.torch import save_file

from unclip.train.config import TrainConfig
from unclip.train.loop import TrainLoop


@dataclass
class Config:
    train: TrainConfig


class Regression:
    name = "mlp"

    def loss(self, model, batch, generators):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def data(rank, start):
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(99))
    i = start
    while True:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * rank + i))
        yield {"x": x, "y": torch.tanh(x @ w), "caption": [""] * 8}
        i += 8


def run(out: Path, resume=None, steps=None):
    cfg = Config(
        TrainConfig(
            output_dir=str(out),
            max_steps=6,
            grad_accum_steps=2,
            warmup_steps=0,
            lr=1e-2,
            mixed_precision="no",
            ema=False,
            trackers=[],
            progress=False,
            checkpoint_every=0,
            powersgd_rank=2,
            powersgd_start_step=2,
        )
    )
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=steps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Linear(48, 32)
    )
    loop.prepare(model)
    loop.run(Regression(), data(loop.rank, loop.state.samples))
    if loop.rank == 0:
        state = {k: v.detach().clone() for k, v in loop.unwrapped.state_dict().items()}
        save_file(state, str(out / "weights.safetensors"))
    loop.finish()


def main():
    out = Path(sys.argv[1])
    # each run ends with Accelerator.end_training, which destroys the process group; keep it
    PartialState.destroy_process_group = lambda self, group=None: None
    run(out / "full")
    run(out / "split", steps=4)
    run(out / "split", resume="latest")


if __name__ == "__main__":
    main()
