"""The model alone, measured before any server: its engine called in-process on every core (or
the GPU), which gives the ceiling each trial is set against and the reference answers every
trial's replies are checked against. On a CPU the ceiling is the best of one engine on every
core (at batches 1, 4 and 16), one engine of one thread per core all at once in one process
(as one process's sessions run), and one process per core, each with an engine of one thread at
the best batch, all at once (as ``--workers N`` runs, with no GIL between them). Each request's
time alone, with the ceiling, is what the objective is derived from where the user gives none
(tuning/choice.py)."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.figures import percentile
from bench.loadgen import Item
from bench.raw import answer_batch, reference_answers, run_batches, run_parallel, task_requests
from settings.server_config import ServerConfig
from tasks import load_task

#: Requests per batch size measured (the reference pass measures batch 1).
BATCH_SIZES_CPU = (4, 16)
BATCH_SIZES_GPU = (8, 32, 64)
#: Requests run per batch size, at least.
MIN_REQUESTS = 32
#: Most one-thread engines run at once on a CPU (one per core).
MAX_PARALLEL = 8


@dataclass(frozen=True)
class ModelAlone:
    """The ceiling (requests/s at the best batch size), each mix item's answer, and how long a
    request alone takes (p50 and p99 over the mix, each answered by itself on every core)."""

    ceiling_rps: float
    best_batch: int
    per_batch_rps: dict[int, float]
    expected: list[dict[str, Any]]
    seconds: float  # what measuring it took, model load included
    parallel: tuple[int, float] | None = None  # CPU: (engines of one thread each, requests/s)
    alone_p50_ms: float = 0.0
    alone_p99_ms: float = 0.0
    processes: tuple[int, float] | None = None  # CPU: (processes, requests/s) at best_batch

    @property
    def engines(self) -> int:
        """The one-thread engines run at once (1 where none were)."""
        return self.parallel[0] if self.parallel else 1

    def in_flight_rates(self) -> dict[int, float]:
        """Requests/s by requests in flight: each batch size's, and the engines' at once."""
        rates = dict(self.per_batch_rps)
        if self.parallel:
            rates[self.parallel[0]] = max(rates.get(self.parallel[0], 0.0), self.parallel[1])
        if self.processes:
            in_flight = self.processes[0] * self.best_batch
            rates[in_flight] = max(rates.get(in_flight, 0.0), self.processes[1])
        return rates

    def describe(self) -> str:
        """The figures in words."""
        batches = ", ".join(f"batch {b}: {r:.1f}" for b, r in self.per_batch_rps.items())
        engines = f"; {self.parallel[0]} one-thread engines at once, batch 1: " \
            f"{self.parallel[1]:.1f}" if self.parallel else ""
        processes = f"; {self.processes[0]} processes at once, batch {self.best_batch}: " \
            f"{self.processes[1]:.1f}" if self.processes else ""
        return f"ceiling {self.ceiling_rps:.1f} req/s ({batches}{engines}{processes} req/s)"


def measure_model(folder: str | Path, engine_kind: str, items: Sequence[Item],
                  config: ServerConfig, *, device: str = "auto",
                  gpu: bool = False) -> ModelAlone:
    """Load the model's task (under ``config``, the server's settings: its window length,
    stride and answer length) and engine as the server would, answer every item alone (the
    reference, and the batch-1 rate), then time larger batches."""
    from engines import load_engine
    from engines.model_dir import load_model_info

    began = time.perf_counter()
    task = load_task(folder, load_model_info(folder), config)
    requests = task_requests(task, items)
    engine = load_engine(engine_kind, folder, threads=0, device=device)
    reference_answers(task, engine, requests[:1])  # the first run's set-up is not measured
    expected, seconds = _answer_each(task, engine, requests)
    rates = {1: len(requests) / sum(seconds)}
    for size in BATCH_SIZES_GPU if gpu else BATCH_SIZES_CPU:
        count = max(2, math.ceil(MIN_REQUESTS / size))
        run_batches(task, engine, requests, size, 1, offset=0)  # this shape's first run
        rates[size] = size * count / sum(run_batches(task, engine, requests, size, count,
                                                     offset=size))
    best = max(rates, key=lambda size: rates[size])
    engines = min(os.cpu_count() or 1, MAX_PARALLEL)
    parallel = processes = None
    if not gpu and engines >= 2:
        parallel = (engines, _parallel_rate(task, engine_kind, folder, requests, engines))
        processes = (engines, _process_rate(folder, engine_kind, items, config, engines, best))
    ceiling = max([rates[best], *(rate for _, rate in filter(None, (parallel, processes)))])
    ordered = sorted(1000.0 * s for s in seconds)
    return ModelAlone(ceiling, best, rates, expected, time.perf_counter() - began, parallel,
                      percentile(ordered, 50), percentile(ordered, 99), processes)


def _answer_each(task: Any, engine: Any,
                 requests: Sequence[Any]) -> tuple[list[dict[str, Any]], list[float]]:
    """Each request answered alone (the reference answers), and the seconds each took."""
    answers, seconds = [], []
    for request in requests:
        started = time.perf_counter()
        answers.append(answer_batch(task, engine, [request])[0])
        seconds.append(time.perf_counter() - started)
    return answers, seconds


def _parallel_rate(task: Any, engine_kind: str, folder: str | Path,
                   requests: Sequence[Any], engines: int) -> float:
    """Requests/s of ``engines`` engines of one thread each, each called by a thread of its
    own at batch 1: the cores used as the server's sessions use them."""
    from engines import load_engine

    loaded = [load_engine(engine_kind, folder, threads=1, device="cpu") for _ in range(engines)]
    each = math.ceil(MIN_REQUESTS / engines)
    elapsed, _ = run_parallel(task, loaded, requests, each)
    return each * engines / elapsed


def _process_rate(folder: str | Path, engine_kind: str, items: Sequence[Item],
                  config: ServerConfig, processes: int, size: int) -> float:
    """Requests/s of ``processes`` processes at once, each with an engine of one thread, at
    batches of ``size``: the cores used as ``--workers N`` uses them, with no GIL shared. Each
    starts its clock after a barrier that every one reaches loaded and warmed up."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    children = [context.Process(target=_timed_process, daemon=True, args=(
        str(folder), engine_kind, list(items), config, size, n, barrier, results))
        for n in range(processes)]
    for child in children:
        child.start()
    try:
        done = [results.get(timeout=300) for _ in children]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    if any(isinstance(d, str) for d in done):
        raise RuntimeError(next(d for d in done if isinstance(d, str)))
    answered = sum(count for count, _, _ in done)
    return answered / (max(end for _, _, end in done) - min(start for _, start, _ in done))


def _timed_process(folder: str, engine_kind: str, items: list[Item], config: ServerConfig,
                   size: int, n: int, barrier: Any, results: Any) -> None:
    """One process of ``_process_rate``: puts (requests, start, end) on ``results`` (times of
    the system's monotonic clock, which every process shares), or what went wrong."""
    try:
        from engines import load_engine
        from engines.model_dir import load_model_info

        task = load_task(folder, load_model_info(folder), config)
        requests = task_requests(task, items)
        engine = load_engine(engine_kind, folder, threads=1, device="cpu")
        count = max(2, math.ceil(MIN_REQUESTS / size))
        run_batches(task, engine, requests, size, 2, offset=0)  # warm-up
        barrier.wait(timeout=240)
        started = time.monotonic()
        run_batches(task, engine, requests, size, count, offset=n * size * count)
        results.put((size * count, started, time.monotonic()))
    except Exception as exc:  # said by the parent, which raises it
        barrier.abort()  # the others stop waiting for this one
        results.put(f"process {n} of the model alone: {type(exc).__name__}: {exc}")
