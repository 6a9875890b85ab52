"""Sizes checked against memory before anything is allocated: a request such as 100,000 decoder
candidates or a batch of 10^8 images is refused with one line naming the setting, the estimate and
the limit, instead of growing until the system kills the process."""

from __future__ import annotations

from typing import Optional

__all__ = ["available_memory", "check_fits", "format_bytes"]


def available_memory() -> Optional[int]:
    """Bytes of memory this machine can still give (``MemAvailable`` of ``/proc/meminfo``, or
    psutil's figure elsewhere); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional: not every platform has /proc
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(
    setting: str,
    value: int,
    bytes_each: int,
    what: str,
    limit: Optional[int] = None,
    limit_name: str = "this machine's available memory",
) -> None:
    """A ``ValueError`` if ``value`` units of ``bytes_each`` bytes (a lower bound of what ``setting
    = value`` allocates: ``what``) exceed ``limit`` (default: :func:`available_memory`)."""
    limit = available_memory() if limit is None else limit
    need = int(value) * int(bytes_each)
    if limit is not None and need > limit:
        raise ValueError(
            f"{setting} {value} needs at least {format_bytes(need)} ({what}), more than "
            f"{limit_name} ({format_bytes(limit)}): lower it"
        )
