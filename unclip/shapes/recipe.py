"""The shapes model's recipes as one command: ``unclip recipe shapes OUT``.

Every step is one of the project's own commands, run as a subprocess with its log in
``OUT/logs/<step>.log``; a step starts as soon as the steps it needs have finished, so on 2 cores
two lanes run side by side:

- A: CLIP (``train-clip``) → the decoder (``train-decoder``, ``torchrun`` with 2 processes) beside
  the prior (``train-prior``) → in ``shapes`` and ``shapes-one-clip``, the decoder fine-tuned on
  mostly two-object scenes (``shapes-1h`` trains one decoder instead: :data:`RECIPES`);
- B: the upsampler 32 → 64, then 64 → 128 (``train-decoder``), which need no CLIP, while the CLIP
  trains; then, in ``shapes``, a second CLIP (``train-clip`` with hard negatives), which chooses
  among the decoder's candidates;

then ``assemble`` and ``shapes-finalize`` (default sampling settings, fp16 weights). Each finished
step's wall-clock seconds go to ``OUT/timings.tsv`` with a fingerprint of what it ran (its command
and the contents of the config files it read). That file is the record of what is done: the same
command again skips the finished steps and resumes an interrupted training step from its last
checkpoint (every training step runs with ``--resume latest``); a finished step whose settings
changed since is an error, not a silent reuse. A failed step stops only the steps that need it;
the others run to the end, so nothing trained is lost. One recipe at a time may use an ``OUT``
(a lock file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

#: the training steps every recipe has before its own (the keys of :data:`RECIPES`)
BASE_STEPS = ("clip", "sr64", "sr128", "prior")
#: what the recipe's configuration folder must hold
CONFIG_FILES = (
    "clip.yaml",
    "prior.yaml",
    "decoder.yaml",
    "sr64.yaml",
    "sr128.yaml",
    "sampling.yaml",
)
#: an override's key: a dotted config name (not an option such as ``--max-steps-this-run``)
_KEY = re.compile(r"^[A-Za-z_][\w.]*$")
#: seconds a step gets to stop after SIGTERM when the recipe is interrupted, before SIGKILL
STOP_GRACE = 10.0


class RecipeError(ValueError):
    """A step failed, or the recipe cannot start; the message says which and what to do."""


@dataclasses.dataclass
class Step:
    name: str
    argv: list  # the command, from the Python executable on
    after: tuple = ()  # the steps whose outputs it reads: they must finish first
    inputs: tuple = ()  # files whose contents are part of the step's settings (its configs)
    output: Optional[Path] = None  # what a successful run leaves; checked before it is recorded
    trains: bool = False  # a training step: its folder holds a run that --resume continues
    # steps it waits for without reading them (to leave their core to others); one that fails
    # or runs again does not concern it
    wait_for: tuple = ()

    def fingerprint(self) -> str:
        """A hash of the command (without the interpreter's path) and the contents of the
        ``inputs``."""
        h = hashlib.sha256(json.dumps([str(a) for a in self.argv[1:]]).encode())
        for path in self.inputs:
            h.update(Path(path).read_bytes())
        return h.hexdigest()[:16]


def default_configs() -> Path:
    """``configs/shapes`` of the source checkout the package runs from."""
    return Path(__file__).resolve().parents[2] / "configs" / "shapes"


def parse_overrides(items: Sequence[str], steps: Optional[Sequence[str]] = None) -> dict:
    """``STEP:key=value`` (``all:`` for every training step) → ``{step: [key=value, ...]}``;
    ``steps``: the training steps that may be named (default: every recipe's)."""
    steps = TRAINING_STEPS if steps is None else steps
    out: dict = {name: [] for name in steps}
    for item in items:
        step, sep, setting = item.partition(":")
        key = setting.partition("=")[0]
        if not sep or "=" not in setting or not _KEY.match(key):
            raise RecipeError(
                f"--set {item!r}: expected STEP:key=value with a dotted config key, e.g. "
                "all:train.max_steps=100 or decoder:train.lr=3e-4"
            )
        if step != "all" and step not in out:
            raise RecipeError(
                f"--set {item!r}: unknown step {step!r}; the training steps are "
                f"{', '.join(steps)} (or all)"
            )
        for name in steps if step == "all" else (step,):
            out[name].append(setting)
    return out


def _path_setting(key: str, path: Path) -> str:
    # quoted, so that the override parser (YAML) reads any path as a string
    return f"{key}={json.dumps(str(path))}"


#: the decoder run from scratch, aligned to the CLIP's layer1 (REPA)
_ALIGNED_DECODER = (
    "repa.weight=0.05",
    "repa.clip_layer=layer1",
    "data.shapes_two_object_prob=0.5",
    "train.max_steps=4600",
)
#: the relation-reading CLIP: a quarter of each batch hard negatives, two-object scenes
#: with the colours swapped or another relation
_RELATION_CLIP = ("data.hard_negatives=0.25", "data.pair_negatives={swap: 0.5, relation: 0.5}")
#: the fine-tune of the aligned decoder on 60 % two-object scenes
_PAIRS_FINE_TUNE = (
    "data.shapes_two_object_prob=0.6",
    "train.max_steps=4000",
    "train.lr=4e-4",
    "train.warmup_steps=200",
)
#: bf16 autocast where the CPU runs it natively, fp32 elsewhere (about 1.2x per decoder sample)
_BF16 = ("train.mixed_precision=auto",)
#: the aligned decoder and its two-object fine-tune, both in bf16 where native
_BF16_DECODERS = {
    "decoder": (*_ALIGNED_DECODER, *_BF16),
    "decoder_pairs": (*_PAIRS_FINE_TUNE, *_BF16),
}
#: the recipes' own training steps and their settings (a base step's settings come before the
#: config overrides of ``--set``). ``shapes`` (the bundled weights) trains the decoder from
#: scratch aligned to the CLIP's layer1, fine-tunes it on 60 % two-object scenes, both in bf16
#: where native, and trains a second CLIP with relation and colour-swap hard negatives that
#: reranks the decoder's candidates (docs/shapes_model.md); ``shapes-one-clip`` trains only that
#: second CLIP, which then conditions the prior and decoder too (fewer prompts right);
#: ``shapes-1h`` is the first decoder run alone, in fp32, with far fewer two-object scenes right
RECIPES: dict[str, dict] = {
    "shapes": {**_BF16_DECODERS, "reranker": _RELATION_CLIP},
    "shapes-one-clip": {"clip": _RELATION_CLIP, **_BF16_DECODERS},
    "shapes-1h": {"decoder": _ALIGNED_DECODER},
}


def _own_steps(recipe: str) -> dict:
    """``RECIPES[recipe]``: its own training steps and their settings."""
    if recipe not in RECIPES:
        raise RecipeError(f"unknown recipe {recipe!r}; the recipes are {', '.join(RECIPES)}")
    return RECIPES[recipe]


def training_steps(recipe: str) -> tuple:
    """The training steps of ``recipe``, which ``--set`` may name."""
    return (*BASE_STEPS, *(s for s in _own_steps(recipe) if s not in BASE_STEPS))


#: every recipe's training steps, in order
TRAINING_STEPS = tuple(dict.fromkeys(s for r in RECIPES for s in training_steps(r)))


def shapes_steps(
    out: Path,
    configs: Path,
    overrides: Optional[dict] = None,
    processes: int = 2,
    recipe: str = "shapes",
) -> list:
    """The steps of ``recipe`` (:data:`RECIPES`) writing under ``out`` from the YAML files in
    ``configs``."""
    own = _own_steps(recipe)
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

    def final(step: str, name: str) -> Path:
        return out / step / "final" / name

    clip_weights = _path_setting("clip.pretrained", final("clip", "clip") / "model.safetensors")

    def command(name: str) -> list:
        return [py, "-m", "unclip.cli", name]

    def train(name: str, launcher: list, config: str, *settings: str, after=(), wait_for=()):
        # the step's paths, then the recipe's own settings for it, then the user's --set
        mine = (*settings, *own.get(name, ()), *overrides.get(name, ()))
        argv = [*launcher, str(configs / config), *mine]
        argv += ["--output-dir", str(out / name), "--resume", "latest"]
        # every training command exports to <output_dir>/final/<the component it trains>; a
        # CLIP config trains a CLIP whatever the step's name (the reranker)
        clip_config = config == "clip.yaml"
        component = "clip" if clip_config else "decoder" if name.startswith("decoder") else name
        output = final(name, component)
        inputs = (configs / config,)
        return Step(name, argv, tuple(after), inputs, output, trains=True, wait_for=tuple(wait_for))

    if processes == 1:
        decoder = command("train-decoder")
    else:  # data-parallel processes on the CPU cores (gloo)
        decoder = [py, "-m", "torch.distributed.run", "--standalone"]
        decoder += ["--nproc_per_node", str(processes), "-m", "unclip.cli.train_decoder"]
    pipeline = out / "pipeline"
    steps = [
        train("clip", command("train-clip"), "clip.yaml"),
        train("sr64", command("train-decoder"), "sr64.yaml"),
        # one after the other, so the CLIP, which the decoder and prior wait for, has a core
        train("sr128", command("train-decoder"), "sr128.yaml", wait_for=["sr64"]),
        train("prior", command("train-prior"), "prior.yaml", clip_weights, after=["clip"]),
        train("decoder", decoder, "decoder.yaml", clip_weights, after=["clip"]),
    ]
    last = "decoder"
    if "decoder_pairs" in own:
        init = _path_setting("train.init_weights", final("decoder", "decoder"))
        steps.append(
            train("decoder_pairs", decoder, "decoder.yaml", clip_weights, init, after=[last])
        )
        last = "decoder_pairs"
    ranks = []  # assemble's arguments for a reranking CLIP
    if "reranker" in own:
        # after the upsamplers, on their core, so the CLIP that the decoder waits for has the other
        steps.append(train("reranker", command("train-clip"), "clip.yaml", wait_for=["sr128"]))
        ranks = ["--reranker", str(final("reranker", "clip"))]
    return steps + [
        Step(
            "assemble",
            [
                *command("assemble"),
                *("--clip", str(final("clip", "clip"))),
                *("--prior", str(final("prior", "prior"))),
                *("--decoder", str(final(last, "decoder"))),
                *("--upsampler", str(final("sr64", "sr64"))),
                *("--upsampler", str(final("sr128", "sr128"))),
                *ranks,
                *("--out", str(pipeline), "--overwrite"),
            ],
            after=("clip", "prior", last, "sr64", "sr128", *(["reranker"] if ranks else [])),
            output=pipeline,
        ),
        Step(
            "finalize",
            [
                *command("shapes-finalize"),
                str(pipeline),
                *("--sampling", str(configs / "sampling.yaml")),
                *("--closed-vocabulary", "clip"),
                *(("--closed-vocabulary", "reranker") if ranks else ()),
            ],
            after=("assemble",),
            inputs=(configs / "sampling.yaml",),
            output=pipeline,
        ),
    ]


def finished_steps(timings: Path) -> dict:
    """``{step: (seconds, fingerprint)}`` of the steps ``timings.tsv`` records as finished."""
    if not timings.is_file():
        return {}
    done = {}
    for number, line in enumerate(timings.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        try:
            name, seconds, fingerprint = fields[0], float(fields[1]), fields[2]
            if not name or len(fields) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise RecipeError(
                f"{timings}:{number}: {line!r} is not 'step<TAB>seconds<TAB>fingerprint'; the "
                "file records the finished steps: fix or delete that line (its step then runs "
                "again)"
            ) from None
        done[name] = (seconds, fingerprint)
    return done


def plan(steps: Sequence[Step], out: Path) -> tuple[set, list]:
    """``(finished, to_run)``: the step names ``out/timings.tsv`` records with the same settings,
    and the steps still to run. A finished step whose settings changed since, or a finished
    training step that needs a step that will run again, is a :class:`RecipeError` (its folder
    holds a run with the earlier settings); ``assemble``-like steps after such a step just run
    again."""
    names = [s.name for s in steps]
    for i, step in enumerate(steps):
        unknown = [d for d in (*step.after, *step.wait_for) if d not in names[:i]]
        if unknown:
            raise RecipeError(f"step {step.name} waits for {unknown}, not listed before it")
    recorded = finished_steps(out / "timings.tsv")
    finished: set = set()
    for step in steps:  # in order: a step's dependencies are decided before it
        if step.name not in recorded:
            continue
        if step.output is not None and not step.output.exists():
            continue  # its output is gone: it runs again
        if recorded[step.name][1] != step.fingerprint():
            if not step.trains:  # nothing to lose: it runs again with the new settings
                continue
            raise RecipeError(
                f"step {step.name} finished in {out} with other settings (its command or config "
                f"changed since); use another output folder, or delete {out / step.name} and "
                f"the {step.name} line of {out / 'timings.tsv'} to train it again"
            )
        rerun = [d for d in step.after if d not in finished]
        if rerun and step.trains:
            raise RecipeError(
                f"step {step.name} finished in {out}, but {', '.join(rerun)}, which it was "
                f"trained after, runs again; delete {out / step.name} and the {step.name} line "
                f"of {out / 'timings.tsv'} so that it is trained again too"
            )
        if not rerun:
            finished.add(step.name)
    return finished, [s for s in steps if s.name not in finished]


def _lock(out: Path):
    """Hold ``out/.recipe.lock`` for this process; a second recipe in ``out`` is refused."""
    import fcntl

    f = open(out / ".recipe.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RecipeError(
            f"another unclip recipe is running in {out} (pid {holder}); wait for it to finish or "
            "stop it, then run this command again"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def _why(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (out of memory?)" if returncode == -signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit status {returncode}"


def _append(path: Path, line: str) -> None:
    """Append ``line``, on a line of its own even if the file was edited without a final one."""
    with open(path, "a+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                line = "\n" + line
        f.write(line)


def _signal_group(proc, sig) -> None:
    try:  # each step runs in a process group of its own: torchrun's workers get it too
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop(running: dict) -> None:
    """SIGTERM to every running step's process group, then SIGKILL to those still up after
    :data:`STOP_GRACE`; a second Ctrl-C meanwhile goes straight to SIGKILL."""
    for _, proc, *_ in running.values():
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    try:
        for _, proc, *_ in running.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for _, proc, *_ in running.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: handled as Ctrl-C is (the steps are stopped, exit status 130)."""


def _raise_terminated(signum, frame):
    raise _Terminated(signal.Signals(signum).name)


def run_steps(
    steps: Sequence[Step],
    out: Path,
    say: Callable[[str], None] = print,
    poll: float = 0.5,
) -> dict:
    """Run ``steps`` (each when the steps it needs have finished, the others side by side),
    recording each finished one in ``out/timings.tsv``; returns ``{step: seconds}`` of this run's
    steps. Steps recorded there with the same settings are skipped (:func:`plan`). A failed step's
    dependents do not start, the rest run to the end, then :class:`RecipeError` names the
    failures. Interrupted (Ctrl-C, SIGTERM, SIGHUP), the running steps are stopped (a training
    step resumes from its last checkpoint on the next run) and the exception propagates."""
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    saved = {}
    if _in_main_thread():  # a plain kill stops the steps too, instead of orphaning them
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's ignored hangup stays so
                saved[sig] = signal.signal(sig, _raise_terminated)
    try:
        return _run(steps, out, say, poll)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        lock.close()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _run(steps, out: Path, say, poll: float) -> dict:
    timings = out / "timings.tsv"
    done, pending = plan(steps, out)
    for step in steps:
        if step.name in done:
            say(f"skip  {step.name} (finished in an earlier run, {timings})")
    # name -> (step, process, start time, fingerprint of what it was started with)
    running: dict = {}
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
                    failed[step.name] = f"not run: {', '.join(blocked)} did not finish"
                elif all(d in done for d in step.after) and all(
                    d in done or d in failed for d in step.wait_for
                ):
                    pending.remove(step)
                    log_path = out / "logs" / f"{step.name}.log"
                    with open(log_path, "a") as log:  # the child keeps its own handle
                        log.write(f"=== {time.strftime('%F %T')} {json.dumps(step.argv)}\n")
                        log.flush()
                        proc = subprocess.Popen(
                            step.argv,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                            start_new_session=True,
                        )
                    running[step.name] = (step, proc, time.monotonic(), step.fingerprint())
                    say(f"[{time.strftime('%H:%M:%S')}] start {step.name}")
            if pending and not running:
                names = ", ".join(s.name for s in pending)
                raise RecipeError(f"steps {names} wait for each other (a cycle in their order)")
            for name, (step, proc, t0, fingerprint) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                seconds = time.monotonic() - t0
                log_path = out / "logs" / f"{name}.log"
                if proc.returncode == 0 and (step.output is None or step.output.exists()):
                    done.add(name)
                    took[name] = seconds
                    _append(timings, f"{name}\t{seconds:.0f}\t{fingerprint}\n")
                    say(f"[{time.strftime('%H:%M:%S')}] done  {name} ({seconds:.0f} s)")
                    continue
                if proc.returncode == 0:
                    why = f"exit status 0 but no {step.output}"
                else:
                    why = _why(proc.returncode)
                last = _last_line(log_path)
                failed[name] = f"{why}; see {log_path}" + (f" ({last})" if last else "")
                say(f"[{time.strftime('%H:%M:%S')}] FAILED {name} ({failed[name]})")
            if running:
                time.sleep(poll)
    finally:
        if running:  # interrupted: a training step resumes from its checkpoint next time
            _stop(running)
    if failed:
        lines = "; ".join(f"{n}: {why}" for n, why in failed.items())
        raise RecipeError(
            f"{len(failed)} step(s) did not finish ({lines}). Fix the cause (a --set value: "
            "change it on the command line) and run the command again: finished steps are "
            "skipped and interrupted training resumes from its last checkpoint (to start a step "
            "afresh, delete its folder in the output folder)"
        )
    return took
