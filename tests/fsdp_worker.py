"""Run by tests/test_sharding.py under ``torchrun`` (gloo) with the environment that
``accelerate launch`` derives from an FSDP config in configs/accelerate: the tiny decoder trained
under FSDP2 in one go and the same run split in two (stop, ``--resume latest``); optionally a
DDP run of the same config for reference (FSDP switched off for it), and the split run again under
each further config's environment (a JSON file ``{name: {variable: value}}``). One process start
for all of the runs.
Rank 0 writes the ``FSDP2: ...`` layout line each run logged to ``OUT/layouts.json``; with
``--peak`` each process writes its measured peaks of FSDP2 steps to ``OUT/peaks_<rank>.json``
(``{run_accumulation: bytes}``: 1 and 2 micro-batches under CONFIG's environment, 2 under each
further config's but CPU offload's): what the plan is checked against.

``python fsdp_worker.py CONFIG OUT [--ddp] [--peak] [--more ENV_JSON] [OVERRIDE ...]`` (the
overrides go to every run)"""

import json
import logging
import os
import sys
from pathlib import Path

from accelerate.state import PartialState

from unclip.cli import train_decoder

#: the micro-batch of the peak measurements (tests/test_sharding.py plans the same)
PEAK_BATCH = "data.batch_size=16"


class Layouts(logging.Handler):
    """Keeps the ``FSDP2: ...`` lines the training loop logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("FSDP2: "):
            self.lines.append(message)


def main():
    cfg, out, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    ddp, measure = "--ddp" in args, "--peak" in args
    more = {}
    if "--more" in args:
        more = json.loads(Path(args[args.index("--more") + 1]).read_text())
        del args[args.index("--more") : args.index("--more") + 2]
    args = [a for a in args if a not in ("--ddp", "--peak")]
    # each run ends with Accelerator.end_training, which destroys the process group; keep it for
    # the next run (process start-up is most of this test's time)
    PartialState.destroy_process_group = lambda self, group=None: None
    layouts = Layouts()
    logging.getLogger("unclip.train").addHandler(layouts)
    seen: dict[str, list[str]] = {}
    peaks: dict[str, int] = {}
    common = [
        cfg,
        "train.progress=false",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.sample_every=4",
        "train.warmup_steps=1",
        "train.mixed_precision=no",
        "data.batch_size=4",
        *args,
    ]

    def run(name, *extra):
        assert train_decoder.main([*common, f"train.output_dir={out / name}", *extra]) == 0
        if layouts.lines:
            seen.setdefault(name, []).extend(layouts.lines)
        layouts.lines.clear()

    def peak(name, accumulation):
        """This process's measured peak of an FSDP2 step (the plan's check), at a micro-batch
        large enough for the backward to be the step's peak."""
        from unclip.train.config import load_stage_config
        from unclip.train.plan_measure import real_cpu_step_peak

        overrides = [*common[1:], f"train.grad_accum_steps={accumulation}", PEAK_BATCH]
        peaks[f"{name}_{accumulation}"] = real_cpu_step_peak(load_stage_config(cfg, overrides))
        layouts.lines.clear()

    def sharded_grads_after_one_micro_batch():
        """The share of trained parameters holding their (sharded) gradient after the first of
        two micro-batches: 1 when each micro-batch is reduce-scattered, 0 when FSDP2 keeps the
        whole gradients to itself until the last micro-batch."""
        import tempfile

        from unclip.nets.clip import CLIP
        from unclip.train.config import load_stage_config
        from unclip.train.loop import TrainLoop
        from unclip.train.plan_build import _build, _synthetic_batch

        overrides = [*common[1:], "train.grad_accum_steps=2"]
        with tempfile.TemporaryDirectory() as tmp:
            stage = load_stage_config(cfg, [*overrides, f"train.output_dir={tmp}"])
            loop = TrainLoop(stage, overwrite=True)
            clip = CLIP.from_config(stage.clip)
            model, task = _build(stage, clip, "cpu", loop.mixed_precision)
            model = loop.prepare(model)
            batch = _synthetic_batch(stage, clip, stage.data.batch_size)
            with loop.accelerator.accumulate(model):
                loop.backward(task.loss(model, batch, loop.generators(stage.data.batch_size)))
            assert not loop.accelerator.sync_gradients  # the step is not over
            trained = [p for p in model.parameters() if p.requires_grad]
            share = sum(p.grad is not None for p in trained) / len(trained)
            loop.accelerator.end_training()
            loop.release_output_dir()
        return share

    run("fsdp_full")
    if measure:
        peaks["sharded_grads_after_one_micro_batch"] = sharded_grads_after_one_micro_batch()
    run("fsdp_split", "--max-steps-this-run", "2")
    run("fsdp_split", "--resume", "latest")
    if measure:
        peak("fsdp_full", 1)
        peak("fsdp_full", 2)
    for name, env in more.items():
        os.environ.update(env)
        # the fp16 files' runs stay in fp32 (train.mixed_precision=no: CPUs have no fp16 kernels
        # to speak of) to compare bit for bit; a bf16 file's run trains as the file says
        # (train.mixed_precision: auto follows the launch)
        if env.get("ACCELERATE_MIXED_PRECISION") == "bf16":
            run(name, "train.mixed_precision=auto", "train.max_steps=2")
            continue
        run(name, "--max-steps-this-run", "2")
        run(name, "--resume", "latest")
        if measure and env.get("FSDP_OFFLOAD_PARAMS", "false").lower() != "true":
            peak(name, 2)
    if ddp:
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        run("ddp")
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        (out / "layouts.json").write_text(json.dumps(seen, indent=1))
    if peaks:
        (out / f"peaks_{rank}.json").write_text(json.dumps(peaks))


if __name__ == "__main__":
    main()
