"""How the command line reports errors, shared by ``unclip COMMAND`` and every console script.

A user error (a bad config key, a missing file, a full disk, Ctrl-C) is one line on stderr,
``unclip COMMAND: error: <message>``, and exit status 1 (130 for Ctrl-C); argparse usage errors
keep status 2. ``--debug`` anywhere on the command line (before a ``--``), or ``UNCLIP_DEBUG=1``,
lets the exception through with its traceback. Nothing here imports more than the standard
library, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

__all__ = [
    "DEBUG_ENV",
    "DEBUG_FLAG",
    "SEED_MAX",
    "USER_ERRORS",
    "debug_requested",
    "format_error",
    "resume_command",
    "run_main",
    "seed_type",
]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "UNCLIP_DEBUG"
# torch generators take 64-bit seeds and a command adds the image index to its seed
SEED_MAX = 2**63 - 1

# what a user can fix from the message alone (ConfigError and JSONDecodeError are ValueErrors,
# FileNotFoundError and a full disk are OSErrors); anything else is a bug and keeps its traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)


def seed_type(text: str) -> int:
    """argparse ``type=`` of a random seed: an integer in ``[0, 2**63 - 1]``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"a seed must be an integer from 0 to 2**63 - 1 ({SEED_MAX}), got {value}"
        )
    return value


def debug_requested(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (only before a ``--``, after which words are the command's
    own), and whether tracebacks were asked for by the flag or by ``UNCLIP_DEBUG``."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    flagged = DEBUG_FLAG in argv[:end]
    argv = [a for a in argv[:end] if a != DEBUG_FLAG] + argv[end:]
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    return argv, flagged or env


def format_error(exc: BaseException) -> str:
    """One line naming what went wrong (and for a system error, which file)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        text = f"{where}: {exc.strerror}" if where else exc.strerror
        if exc.errno == errno.ENOSPC:
            text += " (the disk is full: free some space or write somewhere else, then run again)"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            text += " (choose a folder you can write to)"
    else:
        text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines) or type(exc).__name__


def run_main(
    prog: str,
    main: Callable[[list[str]], Optional[int]],
    argv: Sequence[str],
    debug: bool = False,
) -> int:
    """``main(argv)`` with user errors reported on one line; returns the exit status. With
    ``debug`` (or ``--debug`` in ``argv``, taken out first) the exception propagates instead."""
    argv, flagged = debug_requested(argv)
    if debug or flagged:
        return int(main(argv) or 0)
    try:
        with one_line_warnings(prog):
            status = int(main(argv) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe on stdout is reported here
        return status
    except KeyboardInterrupt as exc:
        # on a terminal the cursor is still after "^C" (or a progress bar)
        start = "\n" if sys.stderr.isatty() else ""
        why = f": {exc}" if str(exc) else ""
        if getattr(exc, "resume_hint", False):  # a training run that checkpointed as it stopped
            why += f"; resume with: {resume_command(prog, argv)}"
        print(f"{start}{prog}: interrupted{why}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of our output went away (e.g. `| head`): nobody is left to tell
        _discard_stdout()
        return 1
    except USER_ERRORS as exc:
        if isinstance(exc, OSError):
            _discard_stdout()
        print(f"{prog}: error: {format_error(exc)}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """Python warnings shown as ``prog: warning: message`` on one line, without the file, line
    and source text a library warning carries (``--debug`` keeps Python's full form)."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        out = file if file is not None else sys.stderr
        try:
            print(f"{prog}: warning: {message}", file=out)
        except OSError:  # a closed stderr: nothing left to tell
            pass

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def resume_command(prog: str, argv: Sequence[str]) -> str:
    """The command line that resumes the training run ``prog argv`` started: the same arguments
    without ``--overwrite`` (which would delete the run) or an earlier ``--resume``, plus
    ``--resume latest``."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--resume":
            skip = True
        elif word != "--overwrite" and not word.startswith("--resume="):
            words.append(word)
    return shlex.join([*prog.split(), *words, "--resume", "latest"])


def _discard_stdout() -> None:
    """If stdout cannot take its buffered output (full disk, closed pipe), send it to the null
    device, so that the interpreter's last flush at exit adds no second error."""
    try:
        sys.stdout.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        finally:
            os.close(devnull)
