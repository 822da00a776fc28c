"""Per-worker figures for the ``stats`` op and /metrics, whichever backend serves."""

from __future__ import annotations

import os
from typing import Any

from telemetry.stats import ServerStats, Timing
from workers.local import LocalBackend
from workers.processes import ProcessBackend


def worker_figures(backend: LocalBackend | ProcessBackend | None,
                   stats: ServerStats) -> list[dict[str, Any]]:
    """One entry per worker: state, pid, device, requests held, restarts and (when known) its
    batch figures. The in-process backend is worker 0 of this process."""
    if isinstance(backend, ProcessBackend):
        return backend.worker_figures()
    if backend is None:
        return []
    figures = stats.batch_figures()
    figures["queue_depth"] = backend.queue_depth
    engine = backend.describe().get("engine", {})
    snapshot_events = figures["events"]
    return [{"worker": 0, "pid": os.getpid(), "device": engine.get("device", backend.device),
             "state": "serving" if backend.ready else "starting",
             "in_flight": stats.snapshot()["in_flight"],
             "restarts": snapshot_events.get("session_restart", 0), "figures": figures}]


def summarize_worker(worker: dict[str, Any]) -> dict[str, Any]:
    """A worker's entry as the ``stats`` op shows it: plain counts, engine time percentiles
    (from its last answer when it did not answer this query in time)."""
    out = {key: worker[key] for key in ("worker", "pid", "device", "state", "in_flight",
                                        "restarts")}
    out["answered_stats"] = worker.get("figures") is not None
    figures = worker.get("known_figures") or worker.get("figures")  # else its last answer
    if figures is not None:
        engine_time = Timing()
        engine_time.absorb(figures["engine_time"])
        out.update(batches=figures["batches"], batch_rows=figures["batch_rows"],
                   queue_depth=figures.get("queue_depth", 0),
                   engine_seconds=engine_time.total, engine_time=engine_time.summary())
    return out
