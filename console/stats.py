"""``python client.py --stats``: the server's ``stats`` (docs/metrics.md) as a readable summary,
or with ``--json`` as the raw JSON.

The summary reads the per-model sections (``models``) for each model's figures and the top level
for the server's own (connections, events, workers); it never relies on the top-level ``model``,
whose shape differs between server versions. A server without ``models`` (one model, an older
version) gets one section from the top-level figures.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from clients.blocking import Client

Stats = Mapping[str, Any]

TIMES = ("queue_time", "engine_time", "request_time")
"""The time histograms of a model's section, in the order a request meets them."""
PERCENTILES = ("count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms")


def show_stats(client: Client, timeout: float, as_json: bool = False) -> int:
    """Ask the server for its stats and print them; returns the exit status (0).

    Raises:
        ServerError, ConnectionLost, TimeoutError: as ``Client.stats`` raises them.
    """
    stats = client.stats(timeout=timeout)
    text = json.dumps(stats, indent=2, default=str) if as_json else \
        format_stats(stats, client.endpoint)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # read by `head` or the like, which stopped reading: that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


def format_stats(stats: Stats, where: str = "server") -> str:
    """The summary of a ``stats`` result: the server, then each model."""
    uptime_s = stats.get("uptime_s", 0.0)
    lines = server_lines(stats, where)
    for name, figures in models_of(stats):
        lines.extend(model_lines(name, figures, uptime_s))
    return "\n".join(lines)


def models_of(stats: Stats) -> list[tuple[str, Stats]]:
    """(name, figures) of each served model, by name; the top level as one model where the
    server gives no ``models`` section."""
    models = stats.get("models")
    if isinstance(models, Mapping) and models:
        return sorted(models.items())
    model = stats.get("model")
    if not isinstance(model, Mapping):
        return [("model", stats)]
    return [(str(model.get("name") or "model"), {**stats, "meaningful": model.get("meaningful")})]


# -- the server --------------------------------------------------------------------------------
def server_lines(stats: Stats, where: str) -> list[str]:
    """The server-wide part: readiness, uptime, connections, requests, events, workers."""
    ready = "ready" if stats.get("ready") else "NOT READY"
    lines = [f"{where}: {ready}, up {duration(stats.get('uptime_s', 0.0))}",
             f"  connections  {stats.get('connections_open', 0)} open, "
             f"{stats.get('connections_total', 0)} since start",
             f"  requests     {request_summary(stats.get('requests', {}))}"
             f"{by_op(stats.get('requests', {}))}",
             f"  queue        {stats.get('queue_depth', 0)} waiting, "
             f"{stats.get('in_flight', 0)} in flight",
             f"  events       {counts(stats.get('events', {})) or 'none'}"]
    if workers := worker_summary(stats.get("workers", [])):
        lines.append(f"  workers      {workers}")
    return lines


def worker_summary(workers: list[Stats]) -> str:
    """Each worker process once (the list has one entry per worker and model)."""
    seen: dict[Any, str] = {}
    for worker in workers:
        restarts = worker.get("restarts", 0)
        again = f", {restarts} restarts" if restarts else ""
        name = worker.get("worker")  # a number (--workers N), or a broker worker's name
        label = f"#{name}" if isinstance(name, int) else str(name)
        seen.setdefault(name, f"{label} pid {worker.get('pid')} {worker.get('device')} "
                              f"{worker.get('state')}{again}")
    return "; ".join(seen.values())


def broker_summary(broker: Stats) -> str:
    """The Redis layout's figures of one model in one line."""
    up = "up" if broker.get("up") else "DOWN"
    return (f"{broker.get('url')} {up}, {broker.get('serving_workers', 0)} serving workers, "
            f"{broker.get('stream_length', 0)} in the stream, {broker.get('pending', 0)} pending")


# -- each model --------------------------------------------------------------------------------
def model_lines(key: str, model: Stats, uptime_s: float) -> Iterator[str]:
    """One model's section: what it is, its requests, queue, batches, times and engine."""
    yield ""
    yield f"model {key}{model_title(key, model)}"
    requests = model.get("requests", {})
    yield f"  requests     {request_summary(requests)}{rate(requests, uptime_s)}"
    yield (f"  queue        {model.get('queue_depth', 0)} waiting, {model.get('in_flight', 0)} "
           f"in flight, {model.get('admitted', 0)} admitted")
    yield f"  batches      {batch_summary(model)}"
    yield from time_table(model)
    if isinstance(engine := model.get("engine"), Mapping) and engine.get("description"):
        yield f"  engine       {engine['description']}"
    if isinstance(broker := model.get("broker"), Mapping):
        yield f"  broker       {broker_summary(broker)}"


def batch_summary(model: Stats) -> str:
    """How many batches, their mean size and rows, and the batching mode and cap."""
    text = str(model.get("batches", 0))
    if model.get("batches"):
        text += (f", mean size {model.get('mean_batch_size', 0.0):.2f}, "
                 f"{model.get('batch_rows', 0)} engine rows")
    if isinstance(batching := model.get("batching"), Mapping) and batching.get("mode"):
        text += (f"; batching {batching['mode']} (at most {batching.get('max_batch_size')} "
                 "requests)")
    return text


def model_title(key: str, model: Stats) -> str:
    """``: TASK (NAME)``, then notes where the model is not ready or its outputs are not
    meaningful."""
    name = model.get("name")
    parts = [str(model["task"])] if model.get("task") else []
    if isinstance(name, str) and name != key:
        parts.append(f"({name})")
    notes = [] if model.get("ready", True) else ["NOT READY"]
    if model.get("meaningful") is False:
        notes.append("outputs NOT MEANINGFUL")
    title = " ".join(parts)
    return (f": {title}" if title else "") + (f"; {', '.join(notes)}" if notes else "")


def time_table(figures: Stats) -> Iterator[str]:
    """The queue, engine and request times: count, mean, percentiles and max, in ms."""
    if not any((figures.get(key) or {}).get("count") for key in TIMES):
        yield "  times        none yet"
        return
    yield "  times (ms)   " + "".join(f"{column.removesuffix('_ms'):>9}" for column in PERCENTILES)
    for key in TIMES:
        times = figures.get(key) or {}
        cells = [f"{times.get('count', 0):>9}"] + [f"{times.get(c, 0.0):>9.1f}"
                                                   for c in PERCENTILES[1:]]
        yield f"    {key.removesuffix('_time'):<10} " + "".join(cells)


# -- words and numbers -------------------------------------------------------------------------
def request_summary(requests: Mapping[str, Mapping[str, int]]) -> str:
    """``N ok, M failed (op code count, ...)`` over every op; ``none`` before the first."""
    ok = sum(outcomes.get("ok", 0) for outcomes in requests.values())
    errors = {f"{op} {code}": n for op, outcomes in requests.items()
              for code, n in outcomes.items() if code != "ok" and n}
    if not ok and not errors:
        return "none"
    failed = sum(errors.values())
    detail = f" ({counts(errors)})" if errors else ""
    return f"{ok} ok, {failed} failed{detail}"


def by_op(requests: Mapping[str, Mapping[str, int]]) -> str:
    """``; by op: qa N, ...``: every op's requests, whatever their outcome."""
    totals = {op: sum(outcomes.values()) for op, outcomes in requests.items()}
    return f"; by op: {counts(totals)}" if any(totals.values()) else ""


def rate(requests: Mapping[str, Mapping[str, int]], uptime_s: float) -> str:
    """``; R/s since start`` (every outcome counted), or nothing before the first request."""
    total = sum(sum(outcomes.values()) for outcomes in requests.values())
    return f"; {total / uptime_s:.3g}/s since start" if total and uptime_s > 0 else ""


def counts(figures: Mapping[str, int]) -> str:
    """``name N, ...`` for the figures above zero, largest first."""
    return ", ".join(f"{name} {n}" for name, n in sorted(figures.items(), key=lambda i: -i[1])
                     if n)


def duration(seconds: float) -> str:
    """A duration in the largest fitting units: ``42.0 s``, ``3 min 5 s``, ``2 h 10 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
