"""One tuning trial: a real ``server.py`` with the candidate's flags, started on a free port,
loaded as the objective says (bench/runs.py, every reply checked against the model's own
answer), and stopped."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import Item
from bench.runs import run_closed_loop, run_open_loop
from bench.servers import start_server, stop_servers
from tuning.objective import Objective
from tuning.space import Candidate

#: Uncounted requests before a trial's load (first runs of each shape, lazy set-up).
WARMUP = 8
#: Seconds without a reply after which a trial's outstanding requests count as timeouts.
REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Load:
    """What every trial sends, and what it must answer."""

    objective: Objective
    items: Sequence[Item]  # the request mix, round robin
    expected: Sequence[Any] | None  # the model's own answer to each item (bench/answers.py)
    op: str = "qa"
    model: str | None = None  # the model requests name (a repository's; None: the only one)
    processes: int | None = None  # load-generating processes (default: bench/runs.py's)


@dataclass(frozen=True)
class Server:
    """How every trial's server starts: the model folder or repository, the engine, and the
    user's fixed flags (tune.py's after ``--``)."""

    model_dir: str
    engine: str = "onnx"
    fixed: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    cwd: Path | None = None  # where relative paths of the flags start (default: the checkout)


@dataclass
class Trial:
    """One trial's outcome: ``figures`` (bench/runs.py's) or ``error`` (why there are none)."""

    number: int
    rung: int  # 0, 1, ...: its successive-halving round; -1: the probe
    candidate: Candidate
    load_s: float  # seconds of load asked
    wall_s: float = 0.0  # the whole trial: start, load, stop
    start_s: float = 0.0  # until the server was serving
    figures: dict[str, Any] | None = None
    error: str | None = None
    start_timed_out: bool = False  # the server was not serving within the start's time limit


def run_trial(number: int, rung: int, candidate: Candidate, load_s: float, server: Server,
              load: Load, start_timeout_s: float | None = None) -> Trial:
    """Start the candidate's server, load it for ``load_s`` seconds, stop it. A server that
    does not start (or not within ``start_timeout_s``), or a load that cannot reach it, is the
    trial's ``error``."""
    trial = Trial(number, rung, candidate, load_s)
    limit = start_timeout_s or server.start_timeout_s
    began = time.perf_counter()
    try:
        proc, port = start_server(server.engine, server.model_dir, 2,
                                  [*server.fixed, *candidate.flags()], timeout_s=limit,
                                  cwd=server.cwd)
    except RuntimeError as exc:
        trial.error = _first_line(exc)
        trial.wall_s = time.perf_counter() - began
        trial.start_timed_out = trial.wall_s >= limit - 0.5
        return trial
    trial.start_s = time.perf_counter() - began
    try:
        trial.figures = _load(port, load_s, load)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:  # unreachable, hung, died
        trial.error = f"load failed: {type(exc).__name__}: {exc}"
    finally:
        stop_servers(proc, timeout_s=30)
        trial.wall_s = time.perf_counter() - began
    return trial


def _load(port: int, load_s: float, load: Load) -> dict[str, Any]:
    """The objective's load on the server at ``port`` for ``load_s`` seconds."""
    common: dict[str, Any] = {"pairs": load.items, "processes": load.processes,
                              "warmup": WARMUP, "progress": False,
                              "timeout_s": REPLY_TIMEOUT_S, "op": load.op, "model": load.model,
                              "expected": load.expected}
    objective = load.objective
    if objective.rate is not None:
        return run_open_loop("127.0.0.1", port, rate=objective.rate, duration_s=load_s,
                             connections=objective.clients, **common)
    return run_closed_loop("127.0.0.1", port, clients=objective.clients,
                           total_clients=objective.clients, requests_per_client=10 ** 9,
                           budget_s=load_s, **common)


def _first_line(exc: Exception) -> str:
    """A failed start in one line: what happened, and the server's last log line."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1].strip()}"
