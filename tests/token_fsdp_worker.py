"""Run by tests/test_token_fsdp.py under ``torchrun`` (gloo) with the environment ``accelerate
launch`` derives from configs/accelerate/fsdp_8gpu.yaml: the token families' trainings under
FSDP2, then the same trainings as DDP runs (FSDP switched off) for reference, in one process
start. ``train-tokenizer`` trains the tiny dVAE and the tiny VQGAN, ``train-tokens`` the tiny
DALL-E transformer over the dVAE and the tiny Mega transformer over the VQGAN (each over the
FSDP run's tokenizer, in both runs). Rank 0 writes the ``FSDP2: ...`` layout lines each run
logged to ``OUT/layouts.json``.

``python token_fsdp_worker.py OUT``"""

import json
import logging
import os
import sys
from pathlib import Path

from accelerate.state import PartialState
from fsdp_worker import Layouts

from unclip.cli import train_tokenizer, train_tokens

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tiny"
COMMON = [
    "train.progress=false",
    "train.max_steps=3",
    "train.checkpoint_every=3",
    "train.log_every=1",  # every step runs the tokenizers' round-trip metrics too
    "train.warmup_steps=1",
    "train.mixed_precision=no",
]
#: run name → (command, config, tokenizer run it trains over)
RUNS = {
    "dvae": (train_tokenizer, "dvae.yaml", None),
    "dalle": (train_tokens, "dalle.yaml", "dvae"),
    "vqgan": (train_tokenizer, "vqgan.yaml", None),
    "mega": (train_tokens, "mega.yaml", "vqgan"),
}


def main():
    out = Path(sys.argv[1])
    # each run ends with Accelerator.end_training, which destroys the process group; keep it for
    # the next run (process start-up is most of this test's time)
    PartialState.destroy_process_group = lambda self, group=None: None
    layouts = Layouts()
    logging.getLogger("unclip.train").addHandler(layouts)
    seen: dict[str, list[str]] = {}
    for strategy in ("fsdp", "ddp"):
        if strategy == "ddp":
            os.environ["ACCELERATE_USE_FSDP"] = "false"
        for name, (command, config, over) in RUNS.items():
            args = [str(CONFIGS / config), *COMMON, f"train.output_dir={out / strategy / name}"]
            if over is not None:
                args.append(f"tokenizer={out / 'fsdp' / over / 'final' / 'tokenizer'}")
            assert command.main(args) == 0, (strategy, name)
            seen[f"{strategy}_{name}"] = list(layouts.lines)
            layouts.lines.clear()
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "layouts.json").write_text(json.dumps(seen, indent=1))


if __name__ == "__main__":
    main()
