"""Starting and ending one worker process: its command, environment, and its exit in words."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_worker(fd: int) -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``python -m workers.worker_main FD`` (not a fork of the
    threaded front end, and not multiprocessing's spawn, which would re-run the user's main
    module), inheriting only the pipe ``fd``.

    It runs in a session of its own: Ctrl+C at a terminal goes to the foreground process group,
    and must reach the front end alone, which stops its workers itself (even a worker that has
    not yet set its signals, still importing, would print a ``KeyboardInterrupt`` traceback)."""
    return subprocess.Popen([sys.executable, "-m", "workers.worker_main", str(fd)],
                            pass_fds=(fd,), env=worker_env(), start_new_session=True)


def worker_env() -> dict[str, str]:
    """This environment, with the project importable from any working directory (a checkout's
    root first on PYTHONPATH; installed in a site directory, it is importable already)."""
    if any(Path(sysconfig.get_path(key)).resolve() == ROOT for key in ("purelib", "platlib")):
        return dict(os.environ)  # (a site directory first on PYTHONPATH could shadow the stdlib)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def wait_exit(process: subprocess.Popen[bytes], seconds: float) -> None:
    """Wait up to ``seconds`` for ``process`` to exit (it may not)."""
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def exit_words(exitcode: int | None) -> str:
    """A process's end, in words: "was killed by SIGKILL", "exited with status 1"."""
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
