"""In-process serving statistics: counters, histograms and recent-sample percentiles.

One ``ServerStats`` per server, and one per served model whose every count also goes to the
server's (its ``parent``): updated from reader and session threads, each under its lock. They are
the single source of truth for both the ``stats`` protocol op and the Prometheus exporter.
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
from collections import Counter, deque
from typing import Any

from telemetry.memory import process_memory

#: Histogram bucket upper bounds in seconds (Prometheus-style, cumulative when exported).
TIME_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Recent samples kept per timing for percentiles.
RESERVOIR = 8192
#: Events counted by ``count_event``: connections refused at the cap, closed for idling, for a
#: frame arriving too slowly, or for not reading replies (for the send timeout, or past the
#: outbox cap); closed for failing to authenticate
#: (a wrong token, or another request first) or for not authenticating in time, or for a TLS
#: handshake that failed or did not finish in time; sessions, and worker processes, replaced
#: after dying; a front end's broker lost, and found again (``--broker``).
EVENTS = ("connection_refused", "idle_timeout", "frame_timeout", "send_timeout",
          "outbox_overflow", "auth_failed", "auth_timeout", "tls_handshake_failed", "session_restart",
          "worker_restart", "executor_restart", "broker_lost", "broker_reconnect")


class Timing:
    """Count, sum, fixed buckets, and the most recent samples of one duration (seconds).

    Not thread-safe by itself: ``ServerStats`` holds the lock.
    """

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.maximum = 0.0
        self.buckets = [0] * (len(TIME_BUCKETS) + 1)  # the last one is +Inf
        self.recent: deque[float] = deque(maxlen=RESERVOIR)

    def observe(self, seconds: float) -> None:
        """Record one duration."""
        self.count += 1
        self.total += seconds
        self.maximum = max(self.maximum, seconds)
        self.buckets[bisect.bisect_left(TIME_BUCKETS, seconds)] += 1
        self.recent.append(seconds)

    def to_raw(self) -> dict[str, Any]:
        """Every figure as plain data, for another process to ``absorb``."""
        return {"count": self.count, "total": self.total, "maximum": self.maximum,
                "buckets": list(self.buckets), "recent": list(self.recent)}

    def absorb(self, raw: dict[str, Any], share: float = 1.0) -> None:
        """Add another timing's figures (from ``to_raw``) to this one; of its recent samples,
        only the newest ``share`` of the reservoir, so that several absorbed timings each keep
        their part of the percentiles."""
        self.count += raw["count"]
        self.total += raw["total"]
        self.maximum = max(self.maximum, raw["maximum"])
        self.buckets = [a + b for a, b in zip(self.buckets, raw["buckets"])]
        keep = max(1, int(RESERVOIR * share))
        self.recent.extend(raw["recent"][-keep:])

    def summary(self) -> dict[str, float]:
        """Count, mean and max over all samples; p50/p90/p99 over the recent ones (milliseconds)."""
        ordered = sorted(self.recent)
        out = {"count": self.count, "mean_ms": 1000 * self.total / self.count if self.count else 0.0,
               "max_ms": 1000 * self.maximum}
        for q in (50, 90, 99):
            out[f"p{q}_ms"] = 1000 * _nearest_rank(ordered, q) if ordered else 0.0
        return out


def _nearest_rank(ordered: list[float], q: float) -> float:
    index = min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))
    return ordered[int(index)]


class ServerStats:
    """Everything the server counts. Every method is thread-safe.

    Requests are counted by ``(op, outcome)``, outcome being "ok" or the error code. A ``qa``
    request is *admitted* when it enters the queue and *finished* when its reply is written or it
    is dropped because its client left; ``in_flight`` is the difference.
    """

    def __init__(self, op: str = "qa", parent: ServerStats | None = None) -> None:
        self.op = op  # the op of the model requests these statistics count
        self.parent = parent  # a served model's statistics also count in the server's
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.admitted = 0
        self.finished = 0
        self.batches = 0
        self.batch_sizes: Counter[int] = Counter()  # requests per batch -> batches
        self.batch_rows = 0  # windows run, summed over batches
        self.queue_time = Timing()  # admitted -> taken by a session
        self.engine_time = Timing()  # one engine.run per batch
        self.request_time = Timing()  # admitted -> reply written
        self.connections_open = 0
        self.connections_total = 0
        self.events: Counter[str] = Counter()  # see EVENTS

    def count(self, op: str, outcome: str) -> None:
        """A request answered without entering the queue (ping, stats, or refused at the door)."""
        with self._lock:
            self.requests[(op, outcome)] += 1
        if self.parent is not None:
            self.parent.count(op, outcome)

    def count_event(self, event: str) -> None:
        """Something an operator should see counted (one of ``EVENTS``)."""
        with self._lock:
            self.events[event] += 1
        if self.parent is not None:
            self.parent.count_event(event)

    def on_admitted(self) -> None:
        """A request entered the queue."""
        with self._lock:
            self.admitted += 1
        if self.parent is not None:
            self.parent.on_admitted()

    def on_refused(self) -> None:
        """Undo ``on_admitted``: the queue refused the request after all."""
        with self._lock:
            self.admitted -= 1
        if self.parent is not None:
            self.parent.on_refused()

    def on_finished(self, outcome: str, seconds: float | None, op: str | None = None) -> None:
        """An admitted request (of ``op``, default this one's) was answered (``seconds`` since
        admission) or dropped (None)."""
        op = op or self.op
        with self._lock:
            self.finished += 1
            self.requests[(op, outcome)] += 1
            if seconds is not None:
                self.request_time.observe(seconds)
        if self.parent is not None:
            self.parent.on_finished(outcome, seconds, op)

    def on_batch(self, size: int, rows: int, queue_waits: list[float], engine_s: float) -> None:
        """A session ran one batch of ``size`` requests (``rows`` windows)."""
        with self._lock:
            self.batches += 1
            self.batch_sizes[size] += 1
            self.batch_rows += rows
            self.engine_time.observe(engine_s)
            for wait in queue_waits:
                self.queue_time.observe(wait)
        if self.parent is not None:
            self.parent.on_batch(size, rows, queue_waits, engine_s)

    def on_connection(self, opened: bool) -> None:
        """A connection opened (True) or closed (False)."""
        with self._lock:
            self.connections_open += 1 if opened else -1
            self.connections_total += 1 if opened else 0

    @property
    def in_flight(self) -> int:
        """Admitted qa requests not yet answered or dropped."""
        with self._lock:
            return self.admitted - self.finished

    def batch_figures(self) -> dict[str, Any]:
        """What a worker process reports to the front end: its batches, queue and engine times
        and events, as plain data for ``absorb``, and the memory of the process that reports
        (``memory``: ``rss_mb``, ``pss_mb``; read where it runs, so a remote worker's too)."""
        memory = process_memory()
        with self._lock:
            return {"batches": self.batches, "batch_sizes": dict(self.batch_sizes),
                    "batch_rows": self.batch_rows, "queue_time": self.queue_time.to_raw(),
                    "engine_time": self.engine_time.to_raw(), "events": dict(self.events),
                    "memory": memory}

    def absorb(self, figures: dict[str, Any], share: float = 1.0) -> None:
        """Add a worker's ``batch_figures`` to these statistics (on a ``copy``, for a view
        summed over workers); ``share``: its part of the recent samples (see Timing.absorb)."""
        with self._lock:
            self.batches += figures["batches"]
            self.batch_sizes.update({int(k): v for k, v in figures["batch_sizes"].items()})
            self.batch_rows += figures["batch_rows"]
            self.queue_time.absorb(figures["queue_time"], share)
            self.engine_time.absorb(figures["engine_time"], share)
            self.events.update(figures["events"])

    def copy(self) -> ServerStats:
        """An independent copy of every figure."""
        with self._lock:
            twin = ServerStats(self.op)
            for name, value in vars(self).items():
                if name not in ("_lock", "parent"):
                    setattr(twin, name, copy.deepcopy(value))
            return twin

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy of every figure (msgpack and JSON friendly)."""
        with self._lock:
            by_op: dict[str, dict[str, int]] = {}
            for (op, outcome), n in sorted(self.requests.items()):
                by_op.setdefault(op, {})[outcome] = n
            sizes = sum(s * n for s, n in self.batch_sizes.items())
            return {
                "uptime_s": time.monotonic() - self.started,
                "requests": by_op,
                "admitted": self.admitted,
                "in_flight": self.admitted - self.finished,
                "batches": self.batches,
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "mean_batch_size": sizes / self.batches if self.batches else 0.0,
                "batch_rows": self.batch_rows,
                "queue_time": self.queue_time.summary(),
                "engine_time": self.engine_time.summary(),
                "request_time": self.request_time.summary(),
                "connections_open": self.connections_open,
                "connections_total": self.connections_total,
                "events": {event: self.events[event] for event in EVENTS},
            }
