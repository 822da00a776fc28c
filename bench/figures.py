"""Figures for the load generator: the server's breakdown over a run, percentiles, summaries,
and a run's rounds taken to their medians.

Pure functions over plain data (no sockets, no processes), shared by bench/loadrun.py,
bench/runs.py and bench/bench.py.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

#: Percentiles kept in every report (``percentiles_ms``), for the distribution plot.
DISTRIBUTION = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9, 100.0)
#: The server's timings (``stats`` op): per request, per batch, per request.
TIMINGS = ("queue_time", "engine_time", "request_time")


def served_model(stats: dict[str, Any], model: str | None, op: str | None) -> str | None:
    """The served model a run's requests went to, by the server's ``stats``: ``model`` where it
    names one, else the only model serving ``op``; None where the stats do not tell (a server
    of one model without per-model figures, or no such model)."""
    entries = stats.get("models", {})
    if model is not None:
        return model if model in entries else None
    serving = [name for name, entry in entries.items() if entry.get("op") == op]
    return serving[0] if len(serving) == 1 else None


def server_breakdown(before: dict[str, Any] | None, after: dict[str, Any] | None,
                     model: str | None = None, op: str | None = None) -> dict[str, Any]:
    """The server's figures over the run: counters differenced, mean times derived exactly.

    The figures are those of the model the run's requests went to (``served_model``), so a
    repository's other models do not count in them; the server's own where the stats do not
    tell which. A timing's mean over the run is ``(count_after * mean_after - count_before *
    mean_before) / (count_after - count_before)``; its ``recent_p50_ms``/``recent_p99_ms`` are
    the server's percentiles over its most recent samples, taken after the run.
    """
    if not before or not after:
        return {}
    config = after.get("config", {})
    name = served_model(after, model, op)
    if name is not None and name not in before.get("models", {}):
        name = None
    was, now = (before["models"][name], after["models"][name]) if name else (before, after)
    batches = now["batches"] - was["batches"]
    sizes = {k: n - was["batch_size_histogram"].get(k, 0)
             for k, n in now["batch_size_histogram"].items()}
    sizes = {k: n for k, n in sizes.items() if n}
    out: dict[str, Any] = {
        "sessions": config.get("num_inference_sessions"),
        "max_batch_size": config.get("max_batch_size"),
        "engine_type": config.get("inference_engine_type"),
        "engine": now.get("engine", {}), "served_model": name,
        "model": _description(now) if name else after.get("model", {}),
        "requests": _counter_diff(was["requests"], now["requests"]),
        "admitted": now["admitted"] - was["admitted"],
        "connections_opened": (after.get("connections_total", 0)
                               - before.get("connections_total", 0)),
        "batches": batches,
        "batch_rows": now["batch_rows"] - was["batch_rows"],
        "batch_size_histogram": sizes,
        "mean_batch_size": sum(int(k) * n for k, n in sizes.items()) / batches if batches else 0.0,
        "queue_depth": now.get("queue_depth"), "in_flight": now.get("in_flight"),
        "config": config,
    }
    out["rows_per_batch"] = out["batch_rows"] / batches if batches else 0.0
    for timing in TIMINGS:
        out[timing] = _timing_diff(was[timing], now[timing])
    return out


def _description(entry: dict[str, Any]) -> dict[str, Any]:
    """A model's description from its per-model stats entry."""
    return {key: entry[key] for key in ("name", "source", "meaningful", "warning") if key in entry}


def _counter_diff(before: dict[str, dict[str, int]],
                  after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out = {}
    for op, outcomes in after.items():
        diff = {k: n - before.get(op, {}).get(k, 0) for k, n in outcomes.items()}
        if diff := {k: n for k, n in diff.items() if n}:
            out[op] = diff
    return out


def _timing_diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    count = after["count"] - before["count"]
    total = after["count"] * after["mean_ms"] - before["count"] * before["mean_ms"]
    return {"count": count, "mean_ms": total / count if count else math.nan,
            "recent_p50_ms": after["p50_ms"], "recent_p99_ms": after["p99_ms"]}


def check_positive(**values: float) -> None:
    """Raise ValueError naming the first value that is not > 0."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, not {value}")


def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` spread as evenly as possible over ``parts``."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def process_count(processes: int | None, work: int) -> int:
    """Worker processes: as asked, else one per core; never more than units of ``work``."""
    procs = processes if processes is not None else min(work, os.cpu_count() or 1)
    return max(1, min(procs, work))


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (NaN when empty)."""
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def summarize(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures over every request of every worker: counts, errors by code, throughput, latency.

    Latency figures (milliseconds) are over the successful requests.
    """
    latencies = sorted(1000 * x for p in payloads for x in p["latencies"])
    errors: Counter[str] = Counter()
    for p in payloads:
        errors.update(p["errors"])
    wall = max((p["wall_s"] for p in payloads), default=0.0)
    n = len(latencies)
    mean = math.fsum(latencies) / n if n else math.nan
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in latencies) / n) if n else math.nan
    return {"requests": sum(p["requests"] for p in payloads), "ok": n,
            "errors": dict(sorted(errors.items())), "wall_s": wall,
            "throughput_rps": n / wall if wall > 0 else 0.0, "mean_ms": mean, "std_ms": std,
            **{f"p{q}_ms": percentile(latencies, q) for q in (50, 90, 95, 99)},
            "max_ms": latencies[-1] if latencies else math.nan,
            "percentiles_ms": {f"{q:g}": percentile(latencies, q) for q in DISTRIBUTION}}


def summarize_lags(payloads: list[dict[str, Any]]) -> dict[str, float]:
    """How late the open-loop senders were against their schedule (milliseconds)."""
    lags = sorted(1000 * x for p in payloads for x in p["lags"])
    return {"mean_ms": math.fsum(lags) / len(lags) if lags else math.nan,
            "p99_ms": percentile(lags, 99), "max_ms": lags[-1] if lags else math.nan}


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None, tuples as lists: plain JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def executor_breakdown(before: dict[str, Any] | None, after: dict[str, Any] | None,
                       seconds: float) -> dict[str, float]:
    """The executors' figures over a run of ``seconds`` (``--executors on``), summed over
    devices: batches, the mean rows and jobs per batch, the share of batches holding the rows
    of several worker processes, the mean wall ms in the engine per batch, and the share of
    the run the executors' loops waited with nothing to run; empty without executors."""
    was = {e["device"]: e for e in (before or {}).get("executors", [])}
    now = (after or {}).get("executors", [])
    if not now:
        return {}
    sums = {key: sum(e.get(key, 0) - was.get(e["device"], {}).get(key, 0) for e in now)
            for key in ("batches", "rows", "jobs", "shared_batches", "engine_s", "idle_s")}
    batches = max(1, sums["batches"])
    return {"executor_batches": sums["batches"],
            "executor_engine_ms_per_batch": round(1e3 * sums["engine_s"] / batches, 3),
            "executor_idle_share": round(sums["idle_s"] / (seconds * len(now)), 3),
            "executor_rows_per_batch": round(sums["rows"] / batches, 2),
            "executor_jobs_per_batch": round(sums["jobs"] / batches, 2),
            "executor_shared_share": round(sums["shared_batches"] / batches, 3)}


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, engine, mode, concurrency): its rounds' medians of requests/s, p50
    and p99 (the other figures are the median-throughput round's), each round's requests/s
    in ``rounds_rps``."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["model"], row["engine"], row["batching"], row["concurrency"])
        groups.setdefault(key, []).append(row)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["throughput_rps"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        for figure in ("throughput_rps", "p50_ms", "p99_ms"):
            row[figure] = statistics.median(r[figure] for r in group)
        row["rounds_rps"] = [r["throughput_rps"] for r in group]
        out.append(row)
    return out
