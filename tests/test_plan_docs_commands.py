"""Every ``unclip plan`` command docs/full_scale.md and configs/README.md print runs as printed:
each is read by the plan's own command line (its options, the config with its overrides, the
Accelerate file, the micro-batch's fit) with ``--check-only``, which stops before the dry run's
minutes of fake-tensor work."""

import re
import shlex
from pathlib import Path

import pytest

from unclip.cli.plan import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "full_scale.md", ROOT / "configs" / "README.md"]


def printed_commands(text: str) -> list[str]:
    """The ``unclip plan`` commands of a Markdown text: lines of its code blocks and inline code
    spans (a span may run over a line break) that name a config, without those written with
    placeholders (``CONFIG``, ``...``); a span naming only an option (``unclip plan --sample``)
    is prose about the option, not a command."""
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        found += [line.strip() for line in block.splitlines()]
    spans = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", spans)]
    commands = [c for c in found if c.startswith("unclip plan ") and ".yaml" in c]
    return [c for c in commands if "..." not in c and not re.search(r"\b[A-Z]{3,}\b", c)]


COMMANDS = sorted({c for doc in DOCS for c in printed_commands(doc.read_text())})


def test_the_docs_print_plan_commands():
    assert len(COMMANDS) >= 3, COMMANDS
    assert any("--accelerate-config" in c and "train." in c.split()[-1] for c in COMMANDS)
    # a placeholder command is left out, a real one kept, also across a line break
    text = "`unclip plan CONFIG --gpus 8`, `unclip plan --sample`, `unclip plan configs/a.yaml"
    text += "\n--gpus 8`"
    assert printed_commands(text) == ["unclip plan configs/a.yaml --gpus 8"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_printed_plan_command_runs_as_printed(command, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the docs' paths are the repository's
    assert main([*shlex.split(command)[2:], "--check-only"]) == 0
    assert "dry run skipped" in capsys.readouterr().out


def test_check_only_reads_the_command_and_refuses_what_the_plan_would():
    config = str(ROOT / "configs" / "decoder_64.yaml")
    with pytest.raises(ValueError, match="train.grad_accum_stepz"):
        main([config, "train.grad_accum_stepz=4", "--check-only"])
    with pytest.raises(SystemExit):  # an unknown option is argparse's error, as printed
        main([config, "--gpu", "8", "--check-only"])
