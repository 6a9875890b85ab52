"""Faults and bad input in training: checkpoints that carry code, damaged checkpoints, a reused
output folder, out-of-range settings, a full disk and ``kill -9`` at random points.

Each case asserts the error (type, one line, what it names), what is left on disk and, where a
resume follows, that the run ends with the weights of an uninterrupted one."""

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, ROOT
from safetensors.torch import load, load_file

from unclip.cli import train_clip, train_decoder, train_prior
from unclip.train.checkpoint import MANIFEST, CheckpointError, verify
from unclip.train.config import TrainConfig, load_stage_config
from unclip.utils.config import ConfigError

PRIOR = CONFIGS / "tiny" / "prior.yaml"
QUIET = ["train.progress=false", "train.warmup_steps=1", "train.log_every=1"]


def train(out, *overrides, args=()):
    return train_prior.main([str(PRIOR), f"train.output_dir={out}", *QUIET, *overrides, *args])


def final_weights(run) -> dict:
    return {
        **load_file(str(Path(run) / "final" / "prior" / "diffusion_pytorch_model.safetensors")),
        **{
            f"clip.{k}": v
            for k, v in load_file(str(Path(run) / "final" / "clip" / "model.safetensors")).items()
        },
    }


def losses(run) -> list[tuple]:
    """``(step, loss, lr)`` of each step ``metrics.jsonl`` records."""
    records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"]) for r in records if "loss" in r]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def tree(folder) -> dict:
    """``{relative path: sha256}`` of every file under ``folder``."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def step_dir(run, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """``full``: 4 uninterrupted steps; ``half``: the same run stopped after 3 steps, with a
    checkpoint after each."""
    root = tmp_path_factory.mktemp("runs")
    common = ["train.max_steps=4", "train.checkpoint_every=1", "train.keep_last=4"]
    assert train(root / "full", *common) == 0
    assert train(root / "half", *common, args=["--max-steps-this-run", "3"]) == 0
    return root


@pytest.fixture
def half(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "half", run)
    return run


def resume(run, *args):
    return train(
        run, "train.max_steps=4", "train.checkpoint_every=1", "train.keep_last=4", args=args
    )


# --------------------------------------------------------------------------------------------------
# 1. a checkpoint never runs code
# --------------------------------------------------------------------------------------------------
class Payload:
    """Creates ``marker`` when unpickled: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


#: the file names Accelerate's ``save_state`` used for pickled state, and other likely ones
PICKLE_NAMES = [
    "custom_checkpoint_0.pkl",
    "custom_checkpoint_1.pkl",
    "custom_checkpoint_2.pkl",
    "random_states_0.pkl",
    "optimizer.bin",
    "scheduler.bin",
    "scaler.pt",
    "pytorch_model.bin",
    "model.pt",
]

_EVENTS: list = []
_RECORDING = [False]


def _audit(event, args):
    if _RECORDING[0] and event in ("pickle.find_class", "open"):
        _EVENTS.append((event, args))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only inside `recording`


class recording:
    """Records the files opened from Python and every class lookup of an unpickler."""

    def __enter__(self):
        _EVENTS.clear()
        _RECORDING[0] = True
        return self

    def __exit__(self, *exc):
        _RECORDING[0] = False

    @property
    def unpickled(self) -> list:
        return [a for e, a in _EVENTS if e == "pickle.find_class"]

    def opened_in(self, folder: Path) -> set[str]:
        out = set()
        for e, a in _EVENTS:
            if e == "open" and isinstance(a[0], (str, os.PathLike)):
                p = Path(os.fsdecode(a[0]))
                if p.parent == folder:
                    out.add(p.name)
        return out


def plant(folder: Path, marker: Path) -> None:
    for name in PICKLE_NAMES:
        if name.endswith(".pkl"):
            (folder / name).write_bytes(pickle.dumps({"state": Payload(marker)}))
        else:
            torch.save({"state": Payload(marker)}, folder / name)


def test_resume_never_unpickles_planted_files(runs, half, tmp_path):
    """Pickles with a code payload under every name Accelerate used are never opened: the resume
    reads only the files the manifest lists (safetensors and JSON), no unpickler runs, the payload
    never runs, and the run ends bit-identical to an uninterrupted one."""
    latest = step_dir(half, 3)
    marker = tmp_path / "PAYLOAD_RAN"
    plant(latest, marker)
    with recording() as rec:
        assert resume(half, "--resume", "latest") == 0
    assert not marker.exists()
    assert rec.unpickled == []
    listed = set(json.loads((latest / MANIFEST).read_text())["files"])
    opened = rec.opened_in(latest)
    assert opened and opened <= listed | {MANIFEST}
    assert not opened & set(PICKLE_NAMES)
    assert_same_weights(final_weights(half), final_weights(runs / "full"))


@pytest.mark.parametrize("name", ["trainer_state.json", "optimizer.safetensors", "ema.json"])
def test_a_listed_file_replaced_by_a_pickle_is_refused(half, tmp_path, name):
    """An attacker who also rewrites the manifest gets a one-line CheckpointError: the file is
    read as JSON or safetensors only, so the pickle payload never runs."""
    latest = step_dir(half, 3)
    marker = tmp_path / "PAYLOAD_RAN"
    (latest / name).write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((latest / MANIFEST).read_text())
    data = (latest / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (latest / MANIFEST).write_text(json.dumps(manifest))
    with recording() as rec, pytest.raises(CheckpointError) as err:
        resume(half, "--resume", "latest")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {latest} cannot be loaded")
    assert not marker.exists() and rec.unpickled == []


def test_an_old_pickle_checkpoint_is_never_loaded(half, tmp_path, caplog):
    """A checkpoint in Accelerate's pickle layout (no manifest) is skipped by ``--resume latest``
    and refused when named, saying why; its payload never runs."""
    old = step_dir(half, 9)
    old.mkdir()
    marker = tmp_path / "PAYLOAD_RAN"
    plant(old, marker)
    with pytest.raises(CheckpointError) as err:
        resume(half, "--resume", str(old))
    msg = str(err.value)
    assert "\n" not in msg and str(old) in msg and "older unclip as pickles" in msg
    caplog.set_level("INFO", "unclip.train")
    assert resume(half, "--resume", "latest", "--max-steps-this-run", "1") == 0
    assert f"skipping damaged checkpoint {old}: it was written by an older unclip" in caplog.text
    assert f"resumed from {step_dir(half, 3)}" in caplog.text
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# 2. a damaged latest checkpoint
# --------------------------------------------------------------------------------------------------
def _truncate(folder):
    p = folder / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _empty(folder):
    (folder / "optimizer.safetensors").write_bytes(b"")


def _drop_optimizer(folder):
    (folder / "optimizer.safetensors").unlink()


def _garbage(folder):
    p = folder / "trainer_state.json"
    p.write_bytes(random.Random(0).randbytes(p.stat().st_size))


def _no_manifest(folder):
    (folder / MANIFEST).unlink()


def _garbage_manifest(folder):
    (folder / MANIFEST).write_text("{not json")


DAMAGE = {
    "truncated": (_truncate, "model.safetensors is .* bytes, the manifest says .* \\(truncated"),
    "emptied": (_empty, "optimizer.safetensors is empty, the manifest says"),
    "missing optimizer": (_drop_optimizer, "optimizer.safetensors is missing"),
    "garbage": (_garbage, "trainer_state.json does not match its SHA-256"),
    "no manifest": (_no_manifest, "no manifest.json \\(the checkpoint was never finished\\)"),
    "garbage manifest": (_garbage_manifest, "manifest.json is damaged"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact(half, kind, caplog):
    """``--resume latest`` skips the damaged step 3 (saying which and why) and resumes step 2;
    the step it trains again matches the lost checkpoint bit for bit. Named explicitly, the
    damaged checkpoint is a one-line error that changes nothing on disk."""
    damage, reason = DAMAGE[kind]
    latest = step_dir(half, 3)
    intact = load((latest / "model.safetensors").read_bytes())  # a copy: the file is damaged
    damage(latest)
    before = tree(half / "checkpoints")
    expected = f"^checkpoint {re.escape(str(latest))} is damaged: {reason}"
    with pytest.raises(CheckpointError, match=expected) as err:
        resume(half, "--resume", str(latest))
    assert "\n" not in str(err.value) and "--resume latest" in str(err.value)
    assert tree(half / "checkpoints") == before
    caplog.set_level("INFO", "unclip.train")
    assert resume(half, "--resume", "latest", "--max-steps-this-run", "1") == 0
    assert f"skipping damaged checkpoint {latest}: " in caplog.text
    assert f"resumed from {step_dir(half, 2)} at step 2" in caplog.text
    verify(latest)  # step 3 written again, intact
    assert_same_weights(load_file(str(latest / "model.safetensors")), intact)


def test_a_run_folder_given_as_checkpoint_is_a_clear_error(half):
    with pytest.raises(CheckpointError) as err:
        resume(half, "--resume", str(half))
    assert str(err.value) == (
        f"{half} is a run folder, not a checkpoint; use --resume latest or one of its "
        "checkpoints/step_* folders"
    )


def test_only_damaged_checkpoints_is_an_error_not_a_fresh_start(half):
    for step in (1, 2, 3):
        _truncate(step_dir(half, step))
    before = tree(half)
    with pytest.raises(CheckpointError) as err:
        resume(half, "--resume", "latest")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"no intact checkpoint in {half / 'checkpoints'}: all 3 are damaged")
    assert "--overwrite" in msg
    after = tree(half)
    assert {k: v for k, v in after.items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }


# --------------------------------------------------------------------------------------------------
# 3. a reused output folder
# --------------------------------------------------------------------------------------------------
def test_reused_output_dir_is_refused_and_left_alone(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "full", run)
    before = tree(run)
    with pytest.raises(ValueError) as err:
        train(run, "train.max_steps=2")
    msg = str(err.value)
    assert "\n" not in msg and str(run) in msg
    assert "--resume latest" in msg and "--overwrite" in msg
    assert tree(run) == before
    # --overwrite removes the earlier run's files (not others) and starts afresh
    (run / "notes.txt").write_text("mine")
    assert train(run, "train.max_steps=2", args=["--overwrite"]) == 0
    steps = [
        json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s for s in steps if s is not None][:2] == [1, 2] and max(steps) == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    assert (run / "notes.txt").read_text() == "mine"


def test_resume_and_overwrite_together_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path / "r", args=["--resume", "latest", "--overwrite"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_every_train_command_refuses_a_folder_holding_files(tmp_path):
    from unclip.nets.clip import tiny_clip_config

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    clip_cfg = tmp_path / "clip.yaml"
    clip_cfg.write_text(
        json.dumps(
            {
                "clip": {"model_name": "tiny", "model_cfg": tiny_clip_config()},
                "data": {"resolution": 32, "batch_size": 4},
                "train": {"max_steps": 1, "progress": False},
            }
        )
    )
    calls = [
        (train_decoder.main, CONFIGS / "tiny" / "decoder.yaml"),
        (train_decoder.main, CONFIGS / "tiny" / "sr32.yaml"),
        (train_clip.main, clip_cfg),
    ]
    for main, cfg in calls:
        with pytest.raises(
            ValueError, match=f"^train.output_dir {re.escape(str(out))} already holds"
        ):
            main([str(cfg), "--output-dir", str(out), "train.progress=false"])
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


# --------------------------------------------------------------------------------------------------
# 4. every numeric setting is range-checked where it enters
# --------------------------------------------------------------------------------------------------
BAD = [
    ("data.batch_size=0", "data.batch_size must be an integer >= 1, got 0"),
    ("data.resolution=0", "data.resolution must be an integer >= 1, got 0"),
    ("data.num_workers=-1", "data.num_workers must be an integer >= 0, got -1"),
    ("data.shuffle_buffer=-5", "data.shuffle_buffer must be an integer >= 0, got -5"),
    ("data.shapes_two_object_prob=1.5", "data.shapes_two_object_prob must be a probability"),
    ("train.max_steps=0", "train.max_steps must be an integer >= 1, got 0"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps must be an integer >= 1, got 0"),
    ("train.log_every=0", "train.log_every must be an integer >= 1, got 0"),
    (
        "train.max_consecutive_nonfinite=0",
        "train.max_consecutive_nonfinite must be an integer >= 1, got 0",
    ),
    ("train.checkpoint_every=-1", "train.checkpoint_every must be an integer >= 0, got -1"),
    ("train.keep_last=0", "train.keep_last must be an integer >= 1, got 0"),
    ("train.sample_every=-1", "train.sample_every must be an integer >= 0, got -1"),
    ("train.warmup_steps=-1", "train.warmup_steps must be an integer >= 0, got -1"),
    ("train.lr=0", "train.lr must be a positive finite number"),
    ("train.lr=-1e-4", "train.lr must be a positive finite number"),
    ("train.lr=.inf", "train.lr must be a positive finite number"),
    ("train.lr=.nan", "train.lr must be a positive finite number"),
    ("train.min_lr=0.5", "train.min_lr must be a number in \\[0, train.lr = 0.001\\]"),
    ("train.min_lr=-1e-6", "train.min_lr must be a number in \\[0, train.lr"),
    ("train.ema_decay=1.0", "train.ema_decay must be in \\[0, 1\\), got 1.0"),
    ("train.ema_decay=-0.5", "train.ema_decay must be in \\[0, 1\\)"),
    ("train.adam_betas=[0.9, 1.0]", "train.adam_betas must be two numbers in \\[0, 1\\)"),
    ("train.adam_betas=[0.9]", "train.adam_betas must be two numbers"),
    ("train.adam_eps=0", "train.adam_eps must be a positive number"),
    ("train.weight_decay=-0.1", "train.weight_decay must be a finite number >= 0"),
    ("train.max_grad_norm=0", "train.max_grad_norm must be a positive number"),
    ("train.text_drop_prob=1.1", "train.text_drop_prob must be a probability in \\[0, 1\\]"),
    ("train.image_embed_drop_prob=-0.1", "train.image_embed_drop_prob must be a probability"),
    ("train.seed=-1", "train.seed must be an integer in \\[0, 2\\*\\*63\\)"),
    ("train.seed=9223372036854775808", "train.seed must be an integer in \\[0, 2\\*\\*63\\)"),
    ("train.powersgd_rank=-1", "train.powersgd_rank must be an integer >= 0"),
    ("train.powersgd_start_step=-1", "train.powersgd_start_step must be an integer >= 0"),
]


@pytest.mark.parametrize("override, message", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_setting_is_a_one_line_config_error(tmp_path, override, message):
    out = tmp_path / "r"
    with pytest.raises(ConfigError) as err:
        train(out, override)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{PRIOR}: ")
    assert re.search(message, msg), msg
    assert not out.exists()  # refused before anything was written (or run)


UPSAMPLER_BAD = [
    (
        "upsampler_train.max_noise_level=1000",
        "upsampler_train.max_noise_level must be in [0, diffusion.num_train_timesteps - 1 = 999]",
    ),
    ("upsampler_train.max_noise_level=-1", "upsampler_train.max_noise_level must be an integer"),
    ("upsampler_train.blur_sigma=[0.6, 0.4]", "upsampler_train.blur_sigma must be [low, high]"),
    ("upsampler_train.crop_size=0", "upsampler_train.crop_size must be an integer >= 1"),
    (
        "upsampler.attention_head_dim=5",
        "upsampler.attention_head_dim (5) must divide the mid block's",
    ),
]


@pytest.mark.parametrize("override, message", UPSAMPLER_BAD, ids=[b[0] for b in UPSAMPLER_BAD])
def test_out_of_range_upsampler_setting(override, message):
    with pytest.raises(ConfigError) as err:
        load_stage_config(CONFIGS / "tiny" / "sr32.yaml", [override])
    assert "\n" not in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.batch_size=0", "data.batch_size must be an integer >= 1, got 0"),
        ("train.max_steps=0", "train.max_steps must be an integer >= 1, got 0"),
        ("data.noise_prob=2", "data.noise_prob must be a probability"),
        ("output.eval_samples=0", "output.eval_samples must be an integer >= 1"),
    ],
)
def test_out_of_range_train_clip_setting(override, message):
    from unclip.shapes.train_clip import load_clip_train_config

    with pytest.raises(ConfigError) as err:
        load_clip_train_config(CONFIGS / "shapes" / "clip.yaml", [override])
    assert "\n" not in str(err.value) and message in str(err.value)


def test_edge_values_are_accepted_and_a_changed_config_is_checked_again(tmp_path):
    cfg = load_stage_config(
        PRIOR,
        [
            "train.checkpoint_every=0",
            "train.sample_every=0",
            "train.warmup_steps=0",
            "train.min_lr=0",
            "train.ema_decay=0",
            "train.text_drop_prob=1",
            "train.max_grad_norm=.inf",
            "data.shuffle_buffer=0",
        ],
    )
    assert cfg.train.checkpoint_every == 0 and cfg.train.max_grad_norm == float("inf")
    with pytest.raises(ConfigError, match="^train.max_steps must be an integer >= 1, got 0$"):
        TrainConfig(max_steps=0)
    from unclip.train.loop import TrainLoop

    cfg.train.output_dir = str(tmp_path / "r")
    cfg.train.log_every = 0  # changed after loading: the loop checks again
    with pytest.raises(ConfigError, match="^train.log_every must be an integer >= 1, got 0$"):
        TrainLoop(cfg)
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------------
# 5. a full disk
# --------------------------------------------------------------------------------------------------
DISK_FULL_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    from unclip.cli import train_prior
    from unclip.train.checkpoint import CheckpointError, DiskFullError, verify

    root, config = Path(sys.argv[1]), sys.argv[2]
    report = {}

    def mount(folder, size):
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True
        )

    def run(out, *args):
        argv = [config, f"train.output_dir={out}", "train.progress=false", "train.max_steps=3",
                "train.checkpoint_every=1", "train.keep_last=1", *args]
        try:
            train_prior.main(argv)
            return None
        except Exception as exc:
            return {"type": type(exc).__name__, "message": str(exc),
                    "errno": getattr(exc, "errno", None)}

    def state(out):
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        intact = []
        for p in sorted((out / "checkpoints").glob("*")):
            try:
                verify(p)
                intact.append(p.name)
            except CheckpointError:
                pass
        return {"files": files, "intact": intact}

    # a disk with room for one checkpoint: the second one does not fit
    small = root / "small"
    mount(small, "{one_checkpoint}")
    report["checkpoint"] = {"error": run(small / "run"), **state(small / "run")}

    # room for the checkpoints and the prior, not for the CLIP export
    medium = root / "medium"
    mount(medium, "{no_clip}")
    report["export"] = {"error": run(medium / "run"), **state(medium / "run")}
    # space freed: the run resumes and exports
    subprocess.run(["mount", "-o", "remount,size=64m", str(medium)], check=True)
    report["resumed"] = {"error": run(medium / "run", "--resume", "latest"),
                         **state(medium / "run")}
    print("REPORT " + json.dumps(report))
    """
)


def _namespace_command() -> list[str] | None:
    """A command prefix that runs a process in its own mount namespace, where it may mount a
    tmpfs: an unprivileged user namespace, or plain ``unshare -m`` as root."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for cmd in ([unshare, "-rm"], [unshare, "-m"]):
        probe = subprocess.run([*cmd, "true"], capture_output=True)
        if probe.returncode == 0:
            return cmd
    return None


def test_disk_full_keeps_the_last_checkpoint_and_never_half_writes_an_export(runs, tmp_path):
    """On a real size-limited file system (a tmpfs in a private mount namespace): a checkpoint
    that does not fit, and a CLIP export that does not fit, each stop the run with the one-line
    "disk full" error naming the folder; the last intact checkpoint is kept, no partial folder is
    left, and once space is freed ``--resume latest`` exports."""
    cmd = _namespace_command()
    if cmd is None:
        pytest.skip("cannot mount a size-limited tmpfs here (no unshare, user namespaces or root)")
    ckpt = sum(p.stat().st_size for p in step_dir(runs / "full", 4).iterdir())
    prior = sum(p.stat().st_size for p in (runs / "full" / "final" / "prior").iterdir())
    one_checkpoint = int(1.4 * ckpt) + 64 * 1024
    no_clip = 2 * ckpt + prior + 2 * 1024 * 1024  # the tiny CLIP is 6.5 MB
    script = DISK_FULL_SCRIPT.replace("{one_checkpoint}", str(one_checkpoint)).replace(
        "{no_clip}", str(no_clip)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*cmd, sys.executable, "-c", script, str(tmp_path), str(PRIOR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])

    full = report["checkpoint"]
    out = tmp_path / "small" / "run"
    assert full["error"] == {
        "type": "DiskFullError",
        "message": f"disk full while writing {out / 'checkpoints' / 'step_00000002'}: free space "
        "or choose another output_dir",
        "errno": 28,
    }
    assert full["intact"] == ["step_00000001"]  # kept, and nothing half-written beside it
    assert not [f for f in full["files"] if ".tmp" in f or f.startswith("final")]

    export = report["export"]
    out = tmp_path / "medium" / "run"
    assert export["error"]["type"] == "DiskFullError" and export["error"]["message"] == (
        f"disk full while writing {out / 'final' / 'clip'}: free space or choose another output_dir"
    )
    assert export["intact"] == ["step_00000003"]
    assert not [f for f in export["files"] if f.startswith("final/clip") or ".tmp" in f]
    assert "final/prior/diffusion_pytorch_model.safetensors" in export["files"]

    resumed = report["resumed"]
    assert resumed["error"] is None and resumed["intact"] == ["step_00000003"]
    assert {"final/clip/config.json", "final/clip/model.safetensors"} <= set(resumed["files"])


# --------------------------------------------------------------------------------------------------
# 6. kill -9 at random points
# --------------------------------------------------------------------------------------------------
def _wait_for(path: Path, proc=None, timeout: float = 120) -> float:
    """Wait until ``path`` exists (or ``proc`` ended); return the time."""
    deadline = time.monotonic() + timeout
    while not path.exists() and (proc is None or proc.poll() is None):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.002)
    return time.monotonic()


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_is_exact(tmp_path, one_thread):
    """A tiny run killed with SIGKILL at a random moment, then resumed with ``--resume latest``,
    ends with the weights of an uninterrupted run, bit for bit, logs each step's loss once, as
    that run did, and leaves no temporary folder. The moments are drawn per seed from strata of
    the uninterrupted run's timeline: start-up before the first checkpoint, then three thirds of
    the span of training, checkpoints (written, renamed, pruned) and the export."""
    common = ["train.max_steps=6", "train.checkpoint_every=1", "train.keep_last=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def start(run):
        argv = [str(PRIOR), f"train.output_dir={run}", *QUIET, *common]
        return subprocess.Popen(
            [sys.executable, "-m", "unclip.cli.train_prior", *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    ref = tmp_path / "reference"
    proc = start(ref)
    config = _wait_for(ref / "config.yaml", proc)
    checkpoints = _wait_for(ref / "checkpoints", proc)
    exported = _wait_for(ref / "final" / "clip", proc)
    assert proc.wait(timeout=120) == 0
    reference = final_weights(ref)
    logged = losses(ref)
    assert [step for step, _, _ in logged] == [1, 2, 3, 4, 5, 6]
    for seed in range(4):
        run = tmp_path / f"killed{seed}"
        u = random.Random(seed).random()
        proc = start(run)
        try:
            if seed == 0:  # start-up
                _wait_for(run / "config.yaml", proc)
                time.sleep(u * (checkpoints - config))
            else:  # training, checkpoints, export
                _wait_for(run / "checkpoints", proc)
                time.sleep((seed - 1 + u) / 3 * (exported - checkpoints))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert train(run, *common, args=["--resume", "latest"]) == 0
        assert_same_weights(final_weights(run), reference)
        assert losses(run) == logged
        assert not [p for p in run.rglob("*") if p.name.endswith((".tmp", ".old"))]
