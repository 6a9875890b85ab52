"""The ``unclip`` command: one subcommand per job, each a module with ``main(argv=None)``.

unclip generate "a small red circle on the left" --out samples/
unclip edit inpaint IMAGE MASK PROMPT --out edited/ | unclip edit text-diff IMAGE --source ...
unclip serve [--model PIPELINE] [--port 7860]   (a local web demo; pip install 'unclip[demo]')
unclip make-shapes data/shapes --num 10000 --format webdataset
unclip embed ... | unclip evaluate ... | unclip convert SRC DST
unclip train-prior CONFIG | unclip train-decoder CONFIG | unclip assemble ...
unclip train-tokenizer CONFIG | unclip train-tokens CONFIG   (the DALL-E and DALL-E Mega families)
unclip shapes-eval --model PIPELINE | unclip shapes-finalize PIPELINE --sampling YAML
unclip recipe shapes OUT   (the bundled model's training, every step)

Errors are one line and exit status 1 (argument errors 2); ``--debug`` or ``UNCLIP_DEBUG=1`` shows
the traceback (see :mod:`unclip.cli.errors`). Only the chosen command's module is imported, and each
imports torch and the models after parsing its arguments, so ``--help`` is instant.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time

from unclip.cli.errors import DEBUG_ENV, DEBUG_FLAG, debug_requested, run_main

#: when the command line was entered (before torch and the models are imported, which take
#: seconds): the times a command prints count from here
STARTED = time.monotonic()

COMMANDS = {
    "generate": (
        "unclip.cli.generate",
        "text → images with a pipeline (default: the bundled shapes model)",
    ),
    "edit": (
        "unclip.cli.edit",
        "edit images: invert, text-diff, interpolate, inpaint, img2img",
    ),
    "serve": (
        "unclip.cli.serve",
        "a local web demo (Gradio): generate, variations, interpolate, edit",
    ),
    "make-shapes": (
        "unclip.cli.make_shapes",
        "write the procedural shapes dataset (folder or webdataset shards)",
    ),
    "train-prior": ("unclip.cli.train_prior", "train the diffusion prior"),
    "train-decoder": ("unclip.cli.train_decoder", "train the base decoder or an upsampler"),
    "train-clip": (
        "unclip.cli.train_clip",
        "train a small CLIP on the shapes world (contrastive)",
    ),
    "train-tokenizer": (
        "unclip.cli.train_tokenizer",
        "train an image tokenizer (DALL-E's dVAE, DALL-E Mega's VQGAN)",
    ),
    "train-tokens": (
        "unclip.cli.train_tokens",
        "train a DALL-E or DALL-E Mega token transformer over a frozen tokenizer",
    ),
    "plan": (
        "unclip.cli.plan",
        "dry-run a training step on fake CUDA tensors and print a per-GPU memory plan",
    ),
    "embed": ("unclip.cli.embed", "precompute CLIP embeddings into .npy shards + statistics"),
    "evaluate": ("unclip.cli.evaluate", "FID, CLIP score, CLIP-FID and shapes faithfulness"),
    "convert": (
        "unclip.cli.convert",
        "import Karlo/diffusers unCLIP folders, export to diffusers",
    ),
    "assemble": ("unclip.cli.assemble", "build a pipeline folder from trained component folders"),
    "shapes-eval": (
        "unclip.cli.shapes_eval",
        "measure a shapes pipeline on the held-out split (per-stage scores, timings)",
    ),
    "recipe": (
        "unclip.cli.recipe",
        "train the bundled shapes model from scratch, every step (unclip recipe shapes OUT)",
    ),
    "shapes-finalize": (
        "unclip.cli.shapes_finalize",
        "set a shapes pipeline's default sampling settings, store fp16 weights",
    ),
}


# commands whose process has nothing left to do once their main returns: every file they write is
# closed by then and they start no thread that must finish. The console script ends them with
# os._exit, skipping the interpreter's teardown of torch, open_clip and diffusers, which takes about
# a second; called in-process, main() just returns. Under a
# profiler or tracer (cProfile, coverage), which write their results at exit, or with
# UNCLIP_NO_FAST_EXIT=1, the process exits normally.
FAST_EXIT = frozenset({"generate"})
NO_FAST_EXIT_ENV = "UNCLIP_NO_FAST_EXIT"


def usage() -> str:
    lines = ["usage: unclip COMMAND [args...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "run 'unclip COMMAND --help' for the options of a command;",
        f"{DEBUG_FLAG} (anywhere) or {DEBUG_ENV}=1 shows the full traceback of an error",
    ]
    return "\n".join(lines)


def run_command(name: str, argv=None, debug: bool = False) -> int:
    """``unclip NAME ARGV...``: the command's ``main`` with one-line errors; the exit status."""
    argv, flagged = debug_requested(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(COMMANDS[name][0])
    return run_main(f"unclip {name}", module.main, argv, debug=debug or flagged)


def main(argv=None) -> int:
    """The ``unclip`` command; returns the exit status."""
    argv, debug = debug_requested(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        import unclip

        print(unclip.__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"unclip: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    return run_command(name, rest, debug=debug)


def console() -> None:
    """The ``unclip`` console script: :func:`main`, then exit with its status (at once, without
    the interpreter's teardown, after a command in :data:`FAST_EXIT`)."""
    argv, _ = debug_requested(sys.argv[1:])
    status = main()
    observed = sys.gettrace() is not None or sys.getprofile() is not None
    opted_out = os.environ.get(NO_FAST_EXIT_ENV, "").strip() not in ("", "0")
    if argv and argv[0] in FAST_EXIT and not observed and not opted_out:
        exit_now(status)
    sys.exit(status)


def exit_now(status: int) -> None:
    """End the process with ``status`` once stdout, stderr and the logging handlers are flushed,
    without running atexit handlers or finalizing modules."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 1  # output that could not be written is a failure
    os._exit(status)


# console scripts of their own (pyproject.toml [project.scripts]), the same as `unclip NAME`
def train_prior_script(argv=None) -> int:
    return run_command("train-prior", argv)


def train_decoder_script(argv=None) -> int:
    return run_command("train-decoder", argv)


if __name__ == "__main__":
    console()
