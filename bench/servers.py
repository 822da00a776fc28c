"""Real server.py processes for the benchmarks: started on a free port, stopped gracefully (and
killed, said, where a graceful stop hangs)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def qa_model_dir(model_dir: str) -> str:
    """The ``qa`` model of ``model_dir`` (``task_model_dir``): the QA benchmarks take a model
    folder or a repository, as the server does."""
    return task_model_dir(model_dir, "qa")


def task_model_dir(model_dir: str, task: str) -> str:
    """The model of ``task`` in ``model_dir``: the folder itself if it is one, else the
    repository's model named after the task (``prepare_model.py`` writes ``saved_models/qa``
    beside ``saved_models/embed``), or else its first model of that task.

    Raises:
        ValueError: none there.
    """
    from engines.model_dir import find_models, load_model_info

    found = find_models(model_dir)
    ours = [folder for _, folder in found if load_model_info(folder).task == task]
    named = [folder for folder in ours if folder.name == task]
    for folder in named or ours:
        return str(folder)
    raise ValueError(f"no {task} model in {model_dir} (its models: "
                     f"{', '.join(n for n, _ in found)})")


#: Flags that name a server's layout (else start_server names one process).
LAYOUT_FLAGS = frozenset({"--workers", "--executors", "--broker", "--role"})


def start_server(kind: str | None, model_dir: str, sessions: int, extra: list[str],
                 timeout_s: float | None = None, root: Path = ROOT,
                 cwd: Path | None = None) -> tuple[Any, int]:
    """A real server process on a free port; returns (process, port). Its layout is what
    ``extra`` says: one process where it names none (no ``--workers``, ``--executors``,
    ``--broker`` or ``--role``), not the layout server.py would choose for the machine
    (workers/layout.py), so that a benchmark measures the layout it names. ``kind`` None:
    server.py's own choices, with no engine, sessions or layout flag but ``extra``'s
    (workers/engine_choice.py, workers/layout.py; ``sessions`` unused). ``root``: the
    checkout whose server.py runs (another commit's, to compare two in one run); ``cwd``: the
    folder relative paths in ``extra`` start from (default: ``root``).

    Raises:
        RuntimeError: it exited before serving, or (``timeout_s``) was not serving that many
            seconds after its start (it is killed then).
    """
    named = kind is None or any(arg.split("=")[0] in LAYOUT_FLAGS for arg in extra)
    chosen = [] if kind is None else ["--inference_engine_type", kind,
                                      "--num_inference_sessions", str(sessions)]
    cmd = [sys.executable, str(root / "server.py"), "--port", "0", "--model_dir", model_dir,
           *chosen, "--log_level", "INFO", *([] if named else ["--workers", "1"]), *extra]
    proc = subprocess.Popen(cmd, cwd=cwd or root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    late = threading.Timer(timeout_s, proc.kill) if timeout_s is not None else None
    if late is not None:
        late.start()
    tail: list[str] = []
    try:
        for line in proc.stderr:
            if match := re.search(r"serving on [\d.]+:(\d+)", line):
                subprocess_drain(proc)
                return proc, int(match.group(1))
            tail = [*tail[-9:], line.rstrip()]
    except BaseException:  # Ctrl+C (or anything else) before it serves: it goes too
        proc.kill()
        proc.wait()
        raise
    finally:
        if late is not None:
            late.cancel()
    code = proc.wait()
    why = f"not serving {timeout_s:g} s after its start: killed" if code == -signal.SIGKILL \
        and timeout_s is not None else f"exit {code}"
    raise RuntimeError(f"server did not start ({why}); its last lines:\n" + "\n".join(tail))


def subprocess_drain(proc: Any) -> None:
    """Keep reading the server's log in the background so it never blocks."""
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


def stop_servers(*procs: Any, timeout_s: float = 60) -> None:
    """SIGTERM every server (or worker) process, then wait for each to drain and exit; one
    still running after ``timeout_s`` is killed, and that is said (a graceful stop that hangs)."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  server pid {proc.pid} still running {timeout_s:.0f} s after SIGTERM: "
                  f"killed", flush=True)
            proc.kill()
            proc.wait()
