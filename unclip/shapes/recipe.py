"""The bundled shapes model's recipe as one command: ``unclip recipe shapes OUT``.

Every step is one of the project's own commands, run as a subprocess with its log in
``OUT/logs/<step>.log``; a step starts as soon as the steps it needs have finished, so on 2 cores
two lanes run side by side:

- A: CLIP (``train-clip``) → the decoder (``train-decoder``, ``torchrun`` with 2 processes) beside
  the prior (``train-prior``) → the decoder fine-tuned on mostly two-object scenes;
- B: the upsamplers 32 → 64 and 64 → 128 (``train-decoder``), which need no CLIP, while the CLIP
  trains;

then ``assemble`` and ``shapes-finalize`` (default sampling settings, fp16 weights). Each finished
step's wall-clock seconds go to ``OUT/timings.tsv``, which is also the record of what is done: the
same command again skips the finished steps and resumes an interrupted training step from its last
checkpoint (every training step runs with ``--resume latest``). A failed step stops only the steps
that need it; the others run to the end, so nothing trained is lost.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

#: the steps that train, in the order they are listed; ``--set`` overrides go to their configs
TRAINING_STEPS = ("clip", "sr64", "sr128", "prior", "decoder", "decoder_pairs")
#: what the recipe's configuration folder must hold
CONFIG_FILES = (
    "clip.yaml",
    "prior.yaml",
    "decoder.yaml",
    "sr64.yaml",
    "sr128.yaml",
    "sampling.yaml",
)


class RecipeError(ValueError):
    """A step failed, or the recipe cannot start; the message says which and what to do."""


@dataclasses.dataclass
class Step:
    name: str
    argv: list  # the command, from the Python executable on
    after: tuple = ()  # the steps that must finish first


def default_configs() -> Path:
    """``configs/shapes`` of the source checkout the package runs from."""
    return Path(__file__).resolve().parents[2] / "configs" / "shapes"


def parse_overrides(items: Sequence[str], steps: Sequence[str] = TRAINING_STEPS) -> dict:
    """``STEP:key=value`` (``all:`` for every training step) → ``{step: [key=value, ...]}``."""
    out: dict = {name: [] for name in steps}
    for item in items:
        step, sep, setting = item.partition(":")
        if not sep or "=" not in setting:
            raise RecipeError(
                f"--set {item!r}: expected STEP:key=value, e.g. all:train.max_steps=100 or "
                "decoder:train.lr=3e-4"
            )
        if step != "all" and step not in out:
            raise RecipeError(
                f"--set {item!r}: unknown step {step!r}; the training steps are "
                f"{', '.join(steps)} (or all)"
            )
        for name in steps if step == "all" else (step,):
            out[name].append(setting)
    return out


def shapes_steps(
    out: Path, configs: Path, overrides: Optional[dict] = None, processes: int = 2
) -> list:
    """The shapes recipe's steps writing under ``out`` from the YAML files in ``configs``."""
    missing = [f for f in CONFIG_FILES if not (configs / f).is_file()]
    if missing:
        raise RecipeError(
            f"the recipe's configs are not in {configs} (missing {', '.join(missing)}); a "
            "pip-installed unclip has no configs/ folder: pass --configs with the repository's "
            "configs/shapes"
        )
    if processes < 1:
        raise RecipeError(f"--processes {processes}: the decoder needs at least one process")
    overrides = overrides or {}
    py = sys.executable
    clip_weights = f"clip.pretrained={out / 'clip' / 'final' / 'clip' / 'model.safetensors'}"

    def command(name: str) -> list:
        return [py, "-m", "unclip.cli", name]

    def train(name: str, launcher: list, config: str, *settings: str, after=()) -> Step:
        argv = [*launcher, str(configs / config), *settings, *overrides.get(name, ())]
        argv += ["--output-dir", str(out / name), "--resume", "latest"]
        return Step(name, argv, tuple(after))

    if processes == 1:
        decoder = command("train-decoder")
    else:  # data-parallel processes on the CPU cores (gloo)
        decoder = [py, "-m", "torch.distributed.run", "--standalone"]
        decoder += ["--nproc_per_node", str(processes), "-m", "unclip.cli.train_decoder"]
    final = out / "{}" / "final" / "{}"
    return [
        train("clip", command("train-clip"), "clip.yaml"),
        train("sr64", command("train-decoder"), "sr64.yaml"),
        train("sr128", command("train-decoder"), "sr128.yaml"),
        train("prior", command("train-prior"), "prior.yaml", clip_weights, after=["clip"]),
        train("decoder", decoder, "decoder.yaml", clip_weights, after=["clip"]),
        # the fine-tune on 60 % two-object scenes (docs/shapes_model.md, levers 8 and 11)
        train(
            "decoder_pairs",
            decoder,
            "decoder.yaml",
            clip_weights,
            f"train.init_weights={out / 'decoder' / 'final' / 'decoder'}",
            "data.shapes_two_object_prob=0.6",
            "train.max_steps=7000",
            "train.lr=4e-4",
            "train.warmup_steps=200",
            after=["decoder"],
        ),
        Step(
            "assemble",
            [
                *command("assemble"),
                *("--clip", str(final).format("clip", "clip")),
                *("--prior", str(final).format("prior", "prior")),
                *("--decoder", str(final).format("decoder_pairs", "decoder")),
                *("--upsampler", str(final).format("sr64", "sr64")),
                *("--upsampler", str(final).format("sr128", "sr128")),
                *("--out", str(out / "pipeline"), "--overwrite"),
            ],
            after=("clip", "prior", "decoder_pairs", "sr64", "sr128"),
        ),
        Step(
            "finalize",
            [
                *command("shapes-finalize"),
                str(out / "pipeline"),
                *("--sampling", str(configs / "sampling.yaml")),
                *("--closed-vocabulary", "clip"),
            ],
            after=("assemble",),
        ),
    ]


def finished_steps(timings: Path) -> dict:
    """``{step: seconds}`` of the steps ``timings.tsv`` records as finished."""
    if not timings.is_file():
        return {}
    done = {}
    for line in timings.read_text().splitlines():
        name, _, seconds = line.partition("\t")
        if name and seconds.strip():
            done[name] = float(seconds)
    return done


def run_steps(
    steps: Sequence[Step],
    out: Path,
    say: Callable[[str], None] = print,
    poll: float = 0.5,
) -> dict:
    """Run ``steps`` (each when the steps it needs have finished, the others side by side),
    recording each finished one in ``out/timings.tsv``; returns ``{step: seconds}`` of this run's
    steps. Steps recorded there already are skipped. A failed step's dependents do not start, the
    rest run to the end, then :class:`RecipeError` names the failures."""
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    timings = out / "timings.tsv"
    done = set(finished_steps(timings))
    names = {s.name for s in steps}
    for step in steps:
        unknown = [d for d in step.after if d not in names]
        if unknown:
            raise RecipeError(f"step {step.name} needs unknown steps {unknown}")
    for step in steps:
        if step.name in done:
            say(f"skip  {step.name} (finished in an earlier run, {timings})")
    pending = [s for s in steps if s.name not in done]
    running: dict = {}  # name -> (process, start time, log file)
    failed: dict = {}  # name -> why
    took: dict = {}
    env = dict(os.environ)
    # one thread per process: far faster than two per process on a shared 2-core machine
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        while pending or running:
            for step in list(pending):
                blocked = [d for d in step.after if d in failed]
                if blocked:
                    pending.remove(step)
                    failed[step.name] = f"not run: {', '.join(blocked)} failed"
                elif all(d in done for d in step.after):
                    pending.remove(step)
                    log = open(out / "logs" / f"{step.name}.log", "a")
                    proc = subprocess.Popen(
                        step.argv, stdout=log, stderr=subprocess.STDOUT, env=env
                    )
                    running[step.name] = (proc, time.monotonic(), log)
                    say(f"[{time.strftime('%H:%M:%S')}] start {step.name}")
            for name, (proc, t0, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                seconds = time.monotonic() - t0
                if proc.returncode == 0:
                    done.add(name)
                    took[name] = seconds
                    with open(timings, "a") as f:
                        f.write(f"{name}\t{seconds:.0f}\n")
                    say(f"[{time.strftime('%H:%M:%S')}] done  {name} ({seconds:.0f} s)")
                else:
                    failed[name] = f"exit status {proc.returncode}; see {out / 'logs' / name}.log"
                    say(f"[{time.strftime('%H:%M:%S')}] FAILED {name} ({failed[name]})")
            if running:
                time.sleep(poll)
    finally:
        for proc, _, log in running.values():  # interrupted: training resumes from checkpoints
            proc.terminate()
            proc.wait()
            log.close()
    if failed:
        lines = "; ".join(f"{n}: {why}" for n, why in failed.items())
        raise RecipeError(
            f"{len(failed)} step(s) did not finish ({lines}). Fix the cause and run the same "
            "command again: finished steps are skipped and interrupted training resumes from its "
            "last checkpoint"
        )
    return took
