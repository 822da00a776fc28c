"""What a process holds in memory, read from Linux's /proc, and the C heap's free pages given
back to the system. Elsewhere every figure is None and trimming does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

_KB_PER_MB = 1024


def resident_mb(pid: int | None = None) -> float | None:
    """Resident memory (RSS) of process ``pid`` (default: this one) in MB; None where it
    cannot be read (gone, or not Linux)."""
    return _status_field(pid, "VmRSS")


def proportional_mb(pid: int | None = None) -> float | None:
    """Proportional set size (PSS) of ``pid`` in MB: its resident pages, each page shared with
    other processes (libraries, a parent's pages after fork) counted as its share, so that the
    PSS of several processes adds up to what they hold together; None where it cannot be read."""
    where = Path(f"/proc/{pid or 'self'}/smaps_rollup")
    try:
        for line in where.read_text().splitlines():
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) / _KB_PER_MB, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


#: Seconds a process's figures are reused: reading PSS walks every mapping of the process
#: (milliseconds), and a client may ask for stats thousands of times a second.
FRESH_S = 1.0
_recent: dict[int | None, tuple[float, dict[str, float | None]]] = {}


def process_memory(pid: int | None = None) -> dict[str, float | None]:
    """``rss_mb`` and ``pss_mb`` of process ``pid`` (default: this one), read at most once a
    ``FRESH_S``."""
    now = time.monotonic()
    cached = _recent.get(pid)
    if cached is not None and now - cached[0] < FRESH_S:
        return dict(cached[1])
    figures = {"rss_mb": resident_mb(pid), "pss_mb": proportional_mb(pid)}
    _recent[pid] = (now, figures)
    return dict(figures)


def _status_field(pid: int | None, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / _KB_PER_MB, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _libc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``malloc_trim``, where this process's C library has one (not musl, not macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim() if os.name == "posix" else None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``): what
    tokenizers, numpy and the runtimes freed stays mapped otherwise. True where it did."""
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
