"""Starting and ending one child process of the front end (a worker, or an executor): its
command, environment and pipe, its ``__main__``, and its exit in words."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent


def spawn(module: str, first: Any) -> tuple[subprocess.Popen[bytes], Connection]:
    """``python -m MODULE FD`` (``start_worker``) with a new pipe, whose first message, sent
    here, is ``first``; returns the process and the front end's end of the pipe."""
    ours, theirs = socket.socketpair()
    with theirs:
        process = start_worker(theirs.fileno(), module)
    conn = Connection(ours.detach())
    conn.send(first)
    return process, conn


def serve_child(argv: list[str], body: Callable[[Connection, Any], int]) -> NoReturn:
    """The ``__main__`` of a process ``spawn`` started: ``body(pipe, first message)`` (FD in
    ``argv[1]``), or exit status 1 where the pipe closed before its first message. Everything
    is answered and closed by then: it skips the interpreter's teardown (a full garbage
    collection of a model and tokenizer takes seconds on a busy machine), so that a drained
    process exits at once."""
    conn = Connection(int(argv[1]))
    try:
        first = conn.recv()
    except (EOFError, OSError):
        status = 1
    else:
        status = body(conn, first)
    logging.shutdown()
    os._exit(status)


def start_worker(fd: int, module: str = "workers.worker_main") -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``python -m MODULE FD`` (not a fork of the threaded front
    end, and not multiprocessing's spawn, which would re-run the user's main module),
    inheriting only the pipe ``fd``.

    It runs in a session of its own: Ctrl+C at a terminal goes to the foreground process group,
    and must reach the front end alone, which stops its workers itself (even a worker that has
    not yet set its signals, still importing, would print a ``KeyboardInterrupt`` traceback)."""
    return subprocess.Popen([sys.executable, "-m", module, str(fd)],
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
