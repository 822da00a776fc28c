"""A worker's entry in the ``stats`` op and /metrics, whichever backend serves."""

from __future__ import annotations

from typing import Any

from telemetry.stats import Timing


def summarize_worker(worker: dict[str, Any]) -> dict[str, Any]:
    """A worker's entry as the ``stats`` op shows it: plain counts, engine time percentiles
    and, with executors, its jobs' timings there (``executor_link``: queued, run and hop); from
    its last answer when it did not answer this query in time."""
    out = {key: worker[key] for key in ("worker", "pid", "device", "state", "in_flight",
                                        "restarts")}
    if "host" in worker:  # a broker's worker, on a machine of its own
        out["host"] = worker["host"]
    out["answered_stats"] = worker.get("figures") is not None
    figures = worker["known_figures"]  # this query's answer, else the worker's last one
    if figures is not None:
        engine_time = Timing()
        engine_time.absorb(figures["engine_time"])
        if figures.get("memory"):  # read in the worker's own process
            out["memory_mb"] = figures["memory"]
        out.update(batches=figures["batches"], batch_rows=figures["batch_rows"],
                   queue_depth=figures.get("queue_depth", 0),
                   engine_seconds=engine_time.total, engine_time=engine_time.summary())
        if figures.get("executor_link"):  # --executors on: its jobs' timings there
            out["executor_link"] = {name: _summary(raw)
                                    for name, raw in figures["executor_link"].items()}
        fresh = worker.get("figures") is not None  # answered this query: not a stale share
        if fresh and figures.get("device_busy") is not None:  # its engine knows it
            out["device_busy"] = figures["device_busy"]
    earlier = worker.get("earlier_figures")  # its slot's replaced processes (--workers N)
    if earlier is not None:
        out.update(earlier_batches=earlier["batches"],
                   earlier_engine_seconds=earlier["engine_time"]["total"])
    return out


def _summary(raw: dict[str, Any]) -> dict[str, float]:
    """A ``Timing.to_raw`` as its summary (count, mean, max and percentiles, ms)."""
    timing = Timing()
    timing.absorb(raw)
    return timing.summary()
