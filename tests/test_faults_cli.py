"""Bad input at the command line: one-line errors with the right exit status, ``--debug``
tracebacks, an instant ``--help``, and the lazy ``unclip`` facade and folder-format entry points."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import unclip
from unclip import cli
from unclip.cli.errors import SEED_MAX, debug_requested, format_error, run_main, seed_type

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"
HEAVY = ("torch", "open_clip", "diffusers", "accelerate", "transformers", "numpy", "scipy")


# unclip/cli/generate.py parses --scheduler choices from unclip.diffusion (torch, diffusers) and
# turns library errors into usage errors; these cases pass once it takes SCHEDULERS from a light
# module, --seed type=seed_type, and lets ValueError reach the one-line report
def _env(**extra: str) -> dict:
    """The test's environment for a subprocess: this source tree first on the path, no
    ``UNCLIP_DEBUG`` unless given, ``extra`` (an extra ``PYTHONPATH`` entry goes after the tree)."""
    env = {k: v for k, v in os.environ.items() if k != "UNCLIP_DEBUG"}
    paths = [str(ROOT), extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    env.update(extra, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return env


def _unclip(args, cwd, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unclip.cli", *map(str, args)],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc, command: str, *needles: str) -> str:
    """The single stderr line of a failed command (exit 1), which must contain ``needles``."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"unclip {command}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with a broken YAML file and a plain file where folders are expected."""
    root = tmp_path_factory.mktemp("cli")
    (root / "broken.yaml").write_text("train:\n  lr: [1e-4, 2\n")
    (root / "afile").write_text("not a folder\n")
    return root


BAD_INPUTS = [
    pytest.param(
        ["train-prior", TINY / "prior.yaml", "train.lrr=1e-4"],
        "train-prior",
        ("unknown key 'train.lrr'", "did you mean 'train.lr'?"),
        id="train-prior-config-key",
    ),
    pytest.param(
        ["train-prior", "missing.yaml"],
        "train-prior",
        ("config file not found: missing.yaml",),
        id="train-prior-missing-config",
    ),
    pytest.param(
        ["train-decoder", "broken.yaml"],
        "train-decoder",
        ("broken.yaml", "not valid YAML"),
        id="train-decoder-bad-yaml",
    ),
    pytest.param(
        ["train-clip", "missing.yaml"],
        "train-clip",
        ("missing.yaml",),
        id="train-clip-missing-config",
    ),
    pytest.param(
        ["assemble", "--clip", "nowhere/clip", "--decoder", "nowhere/decoder", "--out", "p"],
        "assemble",
        ("nowhere/clip",),
        id="assemble-missing-folder",
    ),
    pytest.param(
        [
            "embed",
            *("--source", "folder", "--data", "nowhere"),
            *("--clip-config", str(TINY / "prior.yaml"), "--out", "e"),
        ],
        "embed",
        ("nowhere", "does not exist"),
        id="embed-missing-folder",
    ),
    pytest.param(
        ["make-shapes", "afile/data", "--num", "2"],
        "make-shapes",
        ("afile/data", "Not a directory"),
        id="make-shapes-out-under-a-file",
    ),
    pytest.param(
        ["shapes-eval", "--model", "nowhere", "--num", "1"],
        "shapes-eval",
        ("pipeline folder not found: nowhere",),
        id="shapes-eval-missing-model",
    ),
    pytest.param(
        ["shapes-finalize", "nowhere", "--sampling", "s.yaml"],
        "shapes-finalize",
        ("nowhere",),
        id="shapes-finalize-missing-pipeline",
    ),
    pytest.param(
        ["generate", "a red circle", "--model", "nowhere", "--out", "g"],
        "generate",
        ("pipeline folder not found: nowhere",),
        id="generate-missing-model",
    ),
]


@pytest.mark.parametrize("args, command, needles", BAD_INPUTS)
def test_a_user_error_is_one_line_and_exit_1(work, args, command, needles):
    proc = _unclip(args, cwd=work)
    _one_line_error(proc, command, *needles)
    assert "Traceback" not in proc.stderr
    assert not (work / "p").exists() and not (work / "e").exists()  # nothing written on failure


def test_debug_shows_the_traceback_wherever_it_is_given(work):
    args = ["train-prior", TINY / "prior.yaml", "train.lrr=1e-4"]
    for argv, env in [
        ([*args, "--debug"], {}),
        (["--debug", *args], {}),
        ([args[0], "--debug", *args[1:]], {}),
        (args, {"UNCLIP_DEBUG": "1"}),
    ]:
        proc = _unclip(argv, cwd=work, **env)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback (most recent call last)" in proc.stderr, argv
        assert "ConfigError" in proc.stderr and "did you mean 'train.lr'?" in proc.stderr
    # UNCLIP_DEBUG=0 means off
    _one_line_error(_unclip(args, cwd=work, UNCLIP_DEBUG="0"), "train-prior", "train.lrr")


def test_console_scripts_report_one_line_errors(work):
    """Every [project.scripts] entry goes through the one-line report."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    bad = {
        "unclip": (["train-prior", TINY / "prior.yaml", "train.lrr=1"], "train-prior"),
        "unclip-train-prior": ([TINY / "prior.yaml", "train.lrr=1"], "train-prior"),
        "unclip-train-decoder": ([TINY / "decoder.yaml", "train.lrr=1"], "train-decoder"),
    }
    assert set(scripts) == set(bad)  # a new console script needs a case here
    for name, target in scripts.items():
        module, func = target.split(":")
        argv, command = bad[name]
        code = f"import sys; from {module} import {func}; sys.exit({func}())"
        proc = subprocess.run(
            [sys.executable, "-c", code, *map(str, argv)],
            cwd=work,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        _one_line_error(proc, command, "unknown key 'train.lrr'")


@pytest.mark.parametrize(
    "args",
    [
        ["evaluate", "--seed", str(2**64), "--out", "o"],
        ["shapes-eval", "--seed", "-1"],
        ["make-shapes", "d", "--num", "1", "--seed", str(SEED_MAX + 1)],
        ["generate", "a cat", "--seed", str(2**64), "--out", "o"],
    ],
    ids=["evaluate", "shapes-eval", "make-shapes", "generate"],
)
def test_seed_out_of_range_is_a_usage_error(work, args):
    proc = _unclip(args, cwd=work, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.splitlines()[-1]
    assert "argument --seed: a seed must be an integer from 0 to 2**63 - 1" in last
    assert "Traceback" not in proc.stderr and not (work / "o").exists()


def test_seed_type_bounds():
    assert seed_type("0") == 0 and seed_type(str(SEED_MAX)) == SEED_MAX == 2**63 - 1
    for text in ("-1", str(2**63), "1.5", "seven"):
        with pytest.raises(Exception, match="seed") as e:
            seed_type(text)
        assert type(e.value).__name__ == "ArgumentTypeError"


def test_ctrl_c_exits_130_with_one_line(work):
    proc = subprocess.Popen(
        [sys.executable, "-m", "unclip.cli", "make-shapes", "big", "--num", "1000000"]
        + ["--no-progress"],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job ignores SIGINT, and a child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    # wait for the first image: the interrupt then lands in the writing loop, not in an import
    # (Python 3.11 can turn an interrupt inside a lazy import into another error, or report it
    # as death by SIGINT at exit)
    while not any((work / "big").glob("*.png")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "unclip make-shapes: interrupted\n"
    assert len(list((work / "big").glob("*.png"))) < 1000000


def test_full_disk_on_stdout_is_one_line(work):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "unclip.cli", "train-prior", TINY / "prior.yaml"]
            + ["--print-config", "train.max_steps=3"],
            cwd=work,
            env=_env(),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    _one_line_error(proc, "train-prior", "No space left on device", "the disk is full")


def test_format_error_names_the_file_and_what_to_do(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "w.safetensors"))
    text = format_error(full)
    assert text.startswith(f"{tmp_path / 'w.safetensors'}: No space left on device (the disk is")
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/root/x")
    assert format_error(denied) == "/root/x: Permission denied (choose a folder you can write to)"
    assert format_error(ValueError("first line\n  second line\n")) == "first line second line"
    assert format_error(ValueError()) == "ValueError"


def test_run_main_status_codes(capsys, monkeypatch):
    monkeypatch.delenv("UNCLIP_DEBUG", raising=False)

    def fails(argv):
        raise FileNotFoundError(f"no such file: {argv[0]}")

    assert run_main("unclip x", fails, ["a.yaml"]) == 1
    assert capsys.readouterr().err == "unclip x: error: no such file: a.yaml\n"
    with pytest.raises(FileNotFoundError):
        run_main("unclip x", fails, ["a.yaml", "--debug"])

    def bug(argv):
        raise RuntimeError("a bug keeps its traceback")

    with pytest.raises(RuntimeError):
        run_main("unclip x", bug, [])
    with pytest.raises(SystemExit) as e:  # argparse usage errors keep their status 2
        run_main("unclip x", lambda argv: cli.run_command("make-shapes", argv), ["--bad"])
    assert e.value.code == 2
    assert debug_requested(["a", "--debug", "--", "--debug"]) == (["a", "--", "--debug"], True)
    assert debug_requested(["a", "--", "--debug"]) == (["a", "--", "--debug"], False)


# ------------------------------------------------------------------------------------- start-up
_LOADED = "import sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"


def _modules_after(code: str, cwd) -> tuple[set[str], float, subprocess.CompletedProcess]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", f"{code}\n{_LOADED}"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - start
    lines = proc.stdout.strip().splitlines()
    return set(lines[-1].split()) if lines else set(), seconds, proc


def test_unclip_help_imports_nothing_heavy(tmp_path):
    loaded, seconds, proc = _modules_after(
        "from unclip.cli import main\nassert main(['--help']) == 0", tmp_path
    )
    assert proc.returncode == 0 and "train-prior" in proc.stdout, proc.stderr
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
    assert seconds < 3  # torch alone takes longer; typically ~0.1 s
    loaded, _, proc = _modules_after("import unclip\nfrom unclip import cli", tmp_path)
    assert proc.returncode == 0 and not loaded & set(HEAVY), proc.stderr


@pytest.mark.parametrize(
    "command",
    list(cli.COMMANDS),
)
def test_command_help_and_argument_errors_import_nothing_heavy(command, tmp_path):
    code = (
        "from unclip.cli import main\n"
        "for argv in (['--help'], ['--no-such-option']):\n"
        "    try:\n"
        f"        main([{command!r}, *argv])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == (0 if argv == ['--help'] else 2), (argv, e.code)\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
    )
    loaded, seconds, proc = _modules_after(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"unclip {command}: error: " in proc.stderr
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert seconds < 3


def test_the_facade_imports_on_first_use():
    assert set(unclip.__all__) >= {"UnCLIPPipeline", "CLIP", "load_config", "__version__"}
    core = {"utils", "io", "diffusion", "nets", "sampling", "pipeline"}
    for name in unclip.__all__:  # every exported name resolves to its core definition
        value = getattr(unclip, name)
        if name != "__version__":
            parts = value.__module__.split(".")
            assert parts[0] == "unclip" and len(parts) == 3 and parts[1] in core, value.__module__
    from unclip import CLIP, UnCLIPPipeline
    from unclip.pipeline.pipeline import UnCLIPPipeline as defined

    assert UnCLIPPipeline is defined and unclip.FrozenCLIP is CLIP
    assert "UnCLIPPipeline" in dir(unclip)
    with pytest.raises(AttributeError, match="no attribute 'UnclipPipeline'"):
        unclip.UnclipPipeline  # noqa: B018


# ------------------------------------------------------------------------- folder format readers
def _folder_format_path(tmp_path: Path) -> str:
    """A sys.path entry declaring pyproject.toml's ``unclip.folder_formats`` entry points, for an
    environment whose installed unclip metadata predates them (an editable install is not rebuilt
    when pyproject.toml changes); empty when the installed metadata has them."""
    from importlib.metadata import entry_points

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    declared = declared["unclip.folder_formats"]
    assert declared == {"model_index.json": "unclip.interop.diffusers:load_diffusers_unclip"}
    installed = {ep.name: ep.value for ep in entry_points(group="unclip.folder_formats")}
    if installed == declared:
        return ""
    info = tmp_path / "site" / "unclip_folder_formats-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unclip-folder-formats\n")
    lines = [f"{name} = {value}" for name, value in declared.items()]
    (info / "entry_points.txt").write_text("[unclip.folder_formats]\n" + "\n".join(lines) + "\n")
    return str(info.parent)


def test_a_diffusers_folder_loads_through_the_entry_point(tmp_path):
    from test_convert import build_diffusers

    build_diffusers(tmp_path / "karlo")
    (tmp_path / "empty").mkdir()
    code = (
        "import sys\n"
        "from unclip import UnCLIPPipeline\n"
        "try:\n"
        f"    UnCLIPPipeline.from_pretrained({str(tmp_path / 'empty')!r})\n"
        "except ValueError as e:\n"
        "    assert 'has no unclip.json nor a model_index.json' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('an empty folder loaded')\n"
        "assert 'unclip.interop' not in sys.modules  # a reader is imported when its marker is\n"
        f"pipe = UnCLIPPipeline.from_pretrained({str(tmp_path / 'karlo')!r})\n"
        "assert 'unclip.interop.diffusers' in sys.modules\n"
        "print(','.join(pipe.stage_names))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(PYTHONPATH=_folder_format_path(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("prior,decoder,sr")


def test_register_folder_format_still_works(tmp_path):
    from unclip.pipeline.folders import FOLDER_FORMATS, register_folder_format
    from unclip.pipeline.tiny import tiny_pipeline

    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "other_index.json").write_text(json.dumps({"kind": "other"}))
    seen = []

    made = []

    def read_other(path):  # a reader builds the pipeline from the folder
        seen.append(Path(path))
        made.append(tiny_pipeline(seed=0))
        return made[-1]

    register_folder_format("other_index.json", read_other)
    try:
        assert unclip.UnCLIPPipeline.from_pretrained(folder) is made[-1]
        assert seen == [folder]
    finally:
        del FOLDER_FORMATS["other_index.json"]
    with pytest.raises(ValueError, match="has no unclip.json"):
        unclip.UnCLIPPipeline.from_pretrained(folder)


def test_a_diffusers_folder_without_an_installed_reader_says_to_reinstall(tmp_path, monkeypatch):
    import unclip.pipeline.folders as io

    folder = tmp_path / "karlo"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    monkeypatch.setattr(io, "FOLDER_FORMATS", {})  # an install that lists no entry point
    with pytest.raises(ValueError, match=r"diffusers folder.*reinstall unclip.*folder_formats"):
        unclip.UnCLIPPipeline.from_pretrained(folder)
