"""The raw-engine ceiling of any task: its engine called directly in-process, no sockets, no queue.

A model folder's task is built as the server builds it (``tasks.load_task`` with
``ServerConfig()``'s defaults), and the request mix's items become the protocol requests of the
task's op (``protocol.parse_request``, as the server parses a frame), so the raw path and the
server see the same requests. Each batch is timed through the whole task contract::

    features(request) for each request -> collate -> engine.run -> split_outputs -> postprocess

and the figure is requests per second (for qa: question/context pairs per second) per batch size.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.loadgen import Item
from engines.model_dir import load_model_info
from protocol import parse_request
from protocol.messages import Request
from settings.server_config import ServerConfig
from tasks import load_task
from tasks.base import Task

__all__ = ["answer_batch", "load_raw_task", "raw_ceiling", "raw_parallel", "reference_answers",
           "run_batches", "run_parallel", "task_requests"]


def load_raw_task(model_dir: str | Path) -> Task:
    """The task of a prepared model folder, under the server's default settings."""
    return load_task(model_dir, load_model_info(model_dir), ServerConfig())


def task_requests(task: Task, items: Sequence[Item]) -> list[Request]:
    """The mix's items as the protocol requests of ``task.op``: a (question, context) pair as a
    qa request, a map as the fields of the op (``bench.mix.load_mix``).

    Raises:
        BadRequest: an item the server would refuse to parse as that op.
    """
    requests = []
    for n, item in enumerate(items):
        fields = item if isinstance(item, Mapping) else \
            {"question": item[0], "context": item[1]}
        requests.append(parse_request({**fields, "op": task.op, "id": n}, {task.op}))
    return requests


def answer_batch(task: Task, engine: Any, batch: Sequence[Request]) -> list[dict[str, Any]]:
    """``batch`` run as one through the whole task contract: each request's answer."""
    features = [task.features(request) for request in batch]
    outputs = task.split_outputs(features, engine.run(task.collate(features)))
    return [task.postprocess(one, *arrays) for one, arrays in zip(features, outputs, strict=True)]


def reference_answers(task: Task, engine: Any, requests: Sequence[Request]) -> list[dict[str, Any]]:
    """Each request's answer from ``engine`` alone, one request per batch (no padding): what a
    server must answer whatever its batching (bench/answers.py checks replies against it)."""
    return [answer_batch(task, engine, [request])[0] for request in requests]


def run_batches(task: Task, engine: Any, requests: Sequence[Request], size: int, count: int,
                offset: int) -> list[float]:
    """Run ``count`` batches of ``size`` requests (round robin from ``offset``) through the whole
    task contract; the seconds each batch took."""
    seconds = []
    for b in range(count):
        started = time.perf_counter()
        answer_batch(task, engine,
                     [requests[(offset + b * size + i) % len(requests)] for i in range(size)])
        seconds.append(time.perf_counter() - started)
    return seconds


def run_parallel(task: Task, engines: Sequence[Any], requests: Sequence[Request],
                 per_engine: int) -> tuple[float, list[float]]:
    """Each engine called from a thread of its own, all at once, ``per_engine`` requests at
    batch 1 (after two uncounted ones each); the seconds they all took, and each request's."""
    latencies: list[list[float]] = [[] for _ in engines]
    for engine in engines:
        run_batches(task, engine, requests, 1, 2, offset=0)  # warm-up

    def work(n: int) -> None:
        latencies[n] = run_batches(task, engines[n], requests, 1, per_engine,
                                   offset=n * per_engine)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(len(engines))]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - started, sum(latencies, [])


def raw_ceiling(kind: str, model_dir: str | Path, items: Sequence[Item], batch_sizes: list[int],
                min_pairs: int, threads: int, device: str = "auto", precision: str = "fp32",
                model: str | None = None) -> list[dict[str, Any]]:
    """Requests/s of one engine called in-process, per batch size (features, engine, answers).

    Args:
        kind: The engine (``onnx``, ``pytorch``, ``zero``).
        model_dir: A prepared model folder.
        items: The request mix of the folder's task (``bench.mix.load_mix``).
        batch_sizes: Requests per batch, one row each.
        min_pairs: Requests per batch size, at least (two batches at least).
        threads: Engine threads (0: the engine's default).
        device, precision: As for ``engines.load_engine``.
        model: The model's name in the rows (default: the folder's name).
    """
    from engines import load_engine

    task = load_raw_task(model_dir)
    requests = task_requests(task, items)
    engine = load_engine(kind, model_dir, threads=threads, device=device, precision=precision)
    label = {"model": model or Path(model_dir).resolve().name, "task": task.name}
    rows = []
    for size in batch_sizes:
        batches = max(2, -(-min_pairs // size))
        run_batches(task, engine, requests, size, 1, offset=0)  # warm-up for this shape family
        started = time.perf_counter()
        latencies = run_batches(task, engine, requests, size, batches, offset=size)
        elapsed = time.perf_counter() - started
        layout = f"1 engine x {threads or 'auto'} thread(s)" + _precision_note(engine)
        rows.append(raw_row(kind, layout, size, batches * size, elapsed, latencies, label))
    return rows


def raw_parallel(kind: str, model_dir: str | Path, items: Sequence[Item], engines: int,
                 min_pairs: int, model: str | None = None, device: str = "auto",
                 precision: str = "fp32") -> dict[str, Any]:
    """Requests/s of ``engines`` engines called directly from as many threads, batch 1, cores
    shared out as the server does: the ceiling for the server's own session layout
    (``device`` and ``precision`` as for ``engines.load_engine``)."""
    from engines import load_engine

    task = load_raw_task(model_dir)
    requests = task_requests(task, items)
    threads = max(1, (os.cpu_count() or 1) // engines)
    loaded = [load_engine(kind, model_dir, threads=threads, device=device, precision=precision)
              for _ in range(engines)]
    per_engine = -(-min_pairs // engines)
    elapsed, latencies = run_parallel(task, loaded, requests, per_engine)
    label = {"model": model or Path(model_dir).resolve().name, "task": task.name}
    return raw_row(kind, f"{engines} engines x {threads} thread(s), parallel"
                   + _precision_note(loaded[0]), 1, per_engine * engines, elapsed,
                   latencies, label)


def _precision_note(engine: Any) -> str:
    """", fp16" (or bf16) where the engine runs a precision other than fp32: what it really
    runs, which may be fp32 where the asked one is not available."""
    precision = getattr(engine, "precision", "fp32")
    return "" if precision == "fp32" else f", {precision}"


def raw_row(kind: str, layout: str, size: int, pairs: int, elapsed: float,
            latencies: list[float], label: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One raw figure (``pairs``: requests run; ``pairs_per_s``: requests/s), printed."""
    ordered = sorted(latencies)
    row = {**(label or {}), "engine": kind, "layout": layout, "batch_size": size,
           "pairs": pairs, "pairs_per_s": pairs / elapsed,
           "batch_latency_ms": 1000 * elapsed * size / pairs,
           "p50_batch_ms": 1000 * ordered[len(ordered) // 2]}
    name = f"{row['model']} " if "model" in row else ""
    print(f"  raw {name}{kind} [{layout}] batch {size:>3}: {row['pairs_per_s']:7.1f} req/s, "
          f"mean {row['batch_latency_ms']:8.1f} ms/batch, p50 {row['p50_batch_ms']:8.1f} ms",
          flush=True)
    return row
