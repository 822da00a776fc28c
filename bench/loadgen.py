"""Load-generating worker processes for ``stress_test.py``, and the figures over their requests.

The parent starts P worker processes (spawn context). Each holds several client connections
(``client.Client``) and drives them from reply callbacks, so a request costs one reader-thread
wake-up on the client side and no extra thread hand-off:

- closed loop: each connection keeps ``pipeline`` requests in flight; a reply sends the next one.
  Slot threads take client tickets from a counter shared by every process, so ``total`` clients run
  ``concurrency`` at a time over the whole run: connect, send, disconnect, next.
- open loop: one sender thread per process sends on a precomputed Poisson schedule without waiting
  for replies; each latency is measured from the request's *scheduled* time.

Workers talk to the parent through one queue: ``("ready", i, planned)``, ``("failed", i, why)``,
``("progress", i, n)`` and ``("done", i, payload)``. They start on one shared event, after the
parent's warm-up, so process start-up is never measured.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from client import Client, ConnectionLost
from protocol import ServerError

Pair = tuple[str, str]
#: Percentiles kept in every report (``percentiles_ms``), for the distribution plot.
DISTRIBUTION = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9, 100.0)
#: The server's timings (``stats`` op): per request, per batch, per request.
TIMINGS = ("queue_time", "engine_time", "request_time")


@dataclass(frozen=True)
class ClosedSpec:
    """One worker's share of a closed-loop run."""

    host: str
    port: int
    pairs: Sequence[Pair]
    slots: int  # connections this process keeps open at once
    requests_per_client: int
    pipeline: int
    timeout_s: float


@dataclass(frozen=True)
class OpenSpec:
    """One worker's share of an open-loop run."""

    host: str
    port: int
    pairs: Sequence[Pair]
    connections: int
    rate: float  # this process's arrivals per second
    duration_s: float
    count: int | None  # most arrivals from this process; None: limited by duration only
    seed: int
    first_pair: int  # where this process starts in the request mix
    timeout_s: float


def outcome(exc: BaseException, timed_out: bool = False) -> str:
    """The error code a failed request is counted under."""
    if isinstance(exc, ServerError):
        return exc.code
    if isinstance(exc, ConnectionLost | OSError):
        return "timeout" if timed_out else "connection_lost"
    return type(exc).__name__


def poisson_offsets(rate: float, duration_s: float, count: int | None,
                    rng: random.Random) -> list[float]:
    """Send times, in seconds from the start, of a Poisson process of ``rate`` arrivals/s.

    It stops at ``duration_s`` or after ``count`` arrivals, whichever comes first.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    if count is None and not math.isfinite(duration_s):
        raise ValueError("an open-loop run needs a duration or a request count")
    offsets: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and (count is None or len(offsets) < count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


class Recorder:
    """One worker's outcomes: latencies of successes, errors by code. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latencies = array("d")
        self.lags = array("d")
        self.errors: Counter[str] = Counter()
        self.completed = 0
        self.last = 0.0

    def ok(self, seconds: float, now: float) -> None:
        with self._lock:
            self.latencies.append(seconds)
            self.completed += 1
            self.last = max(self.last, now)

    def failed(self, code: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self.errors[code] += n
            self.completed += n
            self.last = max(self.last, time.perf_counter())

    def payload(self, start: float) -> dict[str, Any]:
        """What goes back to the parent; ``wall_s`` runs from the start to the last outcome."""
        with self._lock:
            end = self.last or time.perf_counter()
            return {"latencies": self.latencies, "lags": self.lags, "errors": dict(self.errors),
                    "requests": self.completed, "wall_s": max(0.0, end - start)}


class _Reporter:
    """Sends this worker's progress to the parent every 0.2 s while in a ``with`` block."""

    def __init__(self, index: int, events: Any, recorder: Recorder) -> None:
        self._index, self._events, self._recorder = index, events, recorder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        reported = 0
        while not self._stop.wait(0.2):
            done = self._recorder.completed
            if done > reported:
                self._events.put(("progress", self._index, done - reported))
                reported = done

    def __enter__(self) -> _Reporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- closed loop -------------------------------------------------------------------------------
class _ClosedDriver:
    """One client connection of a closed loop: ``count`` requests, ``pipeline`` in flight."""

    def __init__(self, client: Client, spec: ClosedSpec, first_pair: int,
                 recorder: Recorder) -> None:
        self._client, self._spec, self._first, self._rec = client, spec, first_pair, recorder
        self._lock = threading.Lock()
        self._left = spec.requests_per_client
        self._sent = 0
        self._outstanding = 0
        self._done = threading.Event()
        self._timed_out = False
        self._last_progress = time.perf_counter()

    def run(self) -> None:
        """Send the first ``pipeline`` requests; replies send the rest. Returns when all are in."""
        for _ in range(min(self._spec.pipeline, self._left)):
            self._send()
        self._check_done()
        while not self._done.wait(0.5):
            if time.perf_counter() - self._last_progress > self._spec.timeout_s:
                self._timed_out = True
                self._client.close()  # pending requests fail, and are counted as "timeout"
                self._done.wait(10)
                return

    def _send(self) -> None:
        with self._lock:
            if self._left == 0:
                return
            self._left -= 1
            self._outstanding += 1
            n, self._sent = self._sent, self._sent + 1
        question, context = self._spec.pairs[(self._first + n) % len(self._spec.pairs)]
        started = time.perf_counter()
        try:
            future = self._client.submit(question, context)
        except Exception as exc:  # noqa: BLE001 - the connection is gone: the rest fail with it
            self._abandon(outcome(exc, self._timed_out), current=True)
            return
        future.add_done_callback(partial(self._on_reply, started))

    def _on_reply(self, started: float, future: Future[dict[str, Any]]) -> None:
        now = time.perf_counter()
        self._last_progress = now
        exc = future.exception()
        if exc is None:
            self._rec.ok(now - started, now)
        else:
            self._rec.failed(outcome(exc, self._timed_out))
        with self._lock:
            self._outstanding -= 1
        if isinstance(exc, ConnectionLost):
            self._abandon(outcome(exc, self._timed_out), current=False)
        else:
            self._send()
        self._check_done()

    def _abandon(self, code: str, *, current: bool) -> None:
        """Count every request not yet sent (and the current one) as failed with ``code``."""
        with self._lock:
            n, self._left = self._left + current, 0
            self._outstanding -= current
        self._rec.failed(code, n)
        self._check_done()

    def _check_done(self) -> None:
        with self._lock:
            if self._left == 0 and self._outstanding == 0:
                self._done.set()


def _take_ticket(tickets: Any) -> int | None:
    """The next client's number, or None when every client of the run has started."""
    with tickets.get_lock():
        if tickets.value <= 0:
            return None
        tickets.value -= 1
        return int(tickets.value)


def _slot(spec: ClosedSpec, tickets: Any, recorder: Recorder) -> None:
    """One simultaneous client: connect, send its requests, disconnect; again while tickets last."""
    while (number := _take_ticket(tickets)) is not None:
        try:
            client = Client(spec.host, spec.port)
        except OSError:
            recorder.failed("connect_failed", spec.requests_per_client)
            continue
        with client:
            _ClosedDriver(client, spec, number * spec.requests_per_client, recorder).run()


def closed_worker(spec: ClosedSpec, index: int, events: Any, go: Any, tickets: Any) -> None:
    """Process entry point of a closed-loop worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's; it ends the workers
    recorder = Recorder()
    events.put(("ready", index, None))
    go.wait()
    start = time.perf_counter()
    with _Reporter(index, events, recorder):
        threads = [threading.Thread(target=_slot, args=(spec, tickets, recorder), name=f"slot-{n}")
                   for n in range(spec.slots)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    events.put(("done", index, recorder.payload(start)))


# -- open loop ---------------------------------------------------------------------------------
class _OpenTracker:
    """Counts open-loop requests in flight and records each reply against its scheduled time."""

    def __init__(self, recorder: Recorder, timeout_s: float) -> None:
        self._rec, self._timeout_s = recorder, timeout_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._all_sent = False
        self._idle = threading.Event()
        self._last_progress = time.perf_counter()
        self.timed_out = False

    def sent(self) -> None:
        with self._lock:
            self._in_flight += 1

    def on_reply(self, scheduled: float, future: Future[dict[str, Any]]) -> None:
        now = time.perf_counter()
        exc = future.exception()
        if exc is None:
            self._rec.ok(now - scheduled, now)
        else:
            self._rec.failed(outcome(exc, self.timed_out))
        with self._lock:
            self._in_flight -= 1
            self._last_progress = now
            if self._in_flight == 0 and self._all_sent:
                self._idle.set()

    def wait(self, clients: list[Client]) -> None:
        """Wait for every reply; after ``timeout_s`` without one, close and count the rest."""
        with self._lock:
            self._all_sent = True
            self._last_progress = time.perf_counter()
            if self._in_flight == 0:
                self._idle.set()
        while not self._idle.wait(0.5):
            if time.perf_counter() - self._last_progress > self._timeout_s:
                self.timed_out = True
                for client in clients:
                    client.close()
                self._idle.wait(10)
                return


def _send_on_schedule(spec: OpenSpec, clients: list[Client], offsets: list[float], start: float,
                      tracker: _OpenTracker, recorder: Recorder) -> None:
    """Send request n at ``start + offsets[n]``, round robin over the connections."""
    pairs = spec.pairs
    for n, offset in enumerate(offsets):
        scheduled = start + offset
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        recorder.lags.append(max(0.0, time.perf_counter() - scheduled))
        question, context = pairs[(spec.first_pair + n) % len(pairs)]
        try:
            future = clients[n % len(clients)].submit(question, context)
        except Exception as exc:  # noqa: BLE001 - that connection is gone; counted
            recorder.failed(outcome(exc))
            continue
        tracker.sent()
        future.add_done_callback(partial(tracker.on_reply, scheduled))


def open_worker(spec: OpenSpec, index: int, events: Any, go: Any, tickets: Any) -> None:
    """Process entry point of an open-loop worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        clients = [Client(spec.host, spec.port) for _ in range(spec.connections)]
    except OSError as exc:
        events.put(("failed", index, f"cannot connect to {spec.host}:{spec.port}: {exc}"))
        return
    offsets = poisson_offsets(spec.rate, spec.duration_s, spec.count, random.Random(spec.seed))
    recorder = Recorder()
    events.put(("ready", index, len(offsets)))
    go.wait()
    start = time.perf_counter()
    tracker = _OpenTracker(recorder, spec.timeout_s)
    with _Reporter(index, events, recorder):
        _send_on_schedule(spec, clients, offsets, start, tracker, recorder)
        tracker.wait(clients)
    for client in clients:
        client.close()
    events.put(("done", index, recorder.payload(start)))


# -- the parent side: processes, warm-up, server snapshots ------------------------------------
def run_workers(target: Callable[..., None], specs: Sequence[ClosedSpec | OpenSpec], *,
                tickets: int, warm_up: Callable[[], None], before: Callable[[], Any],
                total: int | None, progress: bool) -> tuple[list[dict[str, Any]], Any]:
    """Start one process per spec, warm up, snapshot, release them together, collect payloads.

    Args:
        target: ``closed_worker`` or ``open_worker``.
        specs: One spec per process.
        tickets: Client connections for the whole run (closed loop), shared by every process.
        warm_up: Called while the workers start; not measured.
        before: Called once every worker is ready, just before the start; its value is returned.
        total: Requests expected, for the progress bar (None: what the workers announce).
        progress: Show a tqdm progress bar.

    Raises:
        ConnectionError: A worker could not connect.
        RuntimeError: A worker died.
    """
    ctx = mp.get_context("spawn")
    events, go, counter = ctx.Queue(), ctx.Event(), ctx.Value("q", tickets)
    procs = [ctx.Process(target=target, args=(spec, i, events, go, counter), daemon=True,
                         name=f"loadgen-{i}") for i, spec in enumerate(specs)]
    for proc in procs:
        proc.start()
    finished = False
    try:
        warm_up()
        planned = _await_ready(events, procs)
        snapshot = before()
        go.set()
        payloads = _collect(events, procs, total if total is not None else sum(planned), progress)
        finished = True
    finally:
        for proc in procs:
            proc.join(timeout=10 if finished else 0)
            if proc.is_alive():
                proc.terminate()
    return payloads, snapshot


def _next_event(events: Any, procs: list[Any],
                waiting_for: set[int]) -> tuple[str, int, Any] | None:
    """The next worker message, or None after a quiet second; raises if a worker died."""
    try:
        return events.get(timeout=1.0)
    except queue.Empty:
        dead = [i for i in waiting_for if procs[i].exitcode not in (None, 0)]
        if dead:
            code = procs[dead[0]].exitcode
            raise RuntimeError(f"load worker {dead[0]} died (exit {code})") from None
        return None


def _await_ready(events: Any, procs: list[Any]) -> list[int]:
    waiting = set(range(len(procs)))
    planned = [0] * len(procs)
    deadline = time.monotonic() + 120
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError("load workers did not start within 120 s")
        if (event := _next_event(events, procs, waiting)) is None:
            continue
        kind, index, data = event
        if kind == "failed":
            raise ConnectionError(data)
        if kind == "ready":
            waiting.discard(index)
            planned[index] = data or 0
    return planned


def _collect(events: Any, procs: list[Any], total: int, progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    payloads: dict[int, dict[str, Any]] = {}
    waiting = set(range(len(procs)))
    with tqdm(total=total, unit="req", disable=not progress, dynamic_ncols=True) as bar:
        while waiting:
            if (event := _next_event(events, procs, waiting)) is None:
                continue
            kind, index, data = event
            if kind == "progress":
                bar.update(data)
            elif kind == "done":
                payloads[index] = data
                waiting.discard(index)
        bar.n = sum(p["requests"] for p in payloads.values())
        bar.refresh()
    return [payloads[i] for i in range(len(procs))]


def measure(target: Callable[..., None], specs: Sequence[ClosedSpec | OpenSpec], *,
            settings: dict[str, Any], warmup: int, tickets: int, total: int | None,
            progress: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run: warm up, snapshot the server's stats, run the workers, snapshot again.

    Returns:
        The run's figures (``settings``, ``summarize``'s figures, ``server``: the breakdown) and
        the workers' raw payloads.

    Raises:
        ConnectionError: The server (or, from a worker, a connection) cannot be reached.
    """
    host, port, pairs = specs[0].host, specs[0].port, specs[0].pairs
    try:
        control = Client(host, port)
    except OSError as exc:
        raise ConnectionError(f"cannot reach {host}:{port}: {exc}") from exc
    with control:
        payloads, before = run_workers(
            target, specs, tickets=tickets, warm_up=lambda: _warm_up(control, pairs, warmup),
            before=lambda: _server_stats(control), total=total, progress=progress)
        after = _settled_stats(control, before)
    return {"settings": settings, **summarize(payloads),
            "server": server_breakdown(before, after)}, payloads


def _warm_up(client: Client, pairs: Sequence[Pair], count: int) -> None:
    """Send ``count`` uncounted requests, 8 in flight at a time; their errors are ignored."""
    for first in range(0, count, 8):
        futures = [client.submit(*pairs[n % len(pairs)])
                   for n in range(first, min(count, first + 8))]
        for future in futures:
            try:
                future.result(timeout=120)
            except ServerError:
                pass


def _server_stats(client: Client) -> dict[str, Any] | None:
    """The server's ``stats`` result, or None from a server without that op."""
    try:
        return client.stats(timeout=30)
    except ServerError:
        return None


def _settled_stats(client: Client, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stats after the run, once the server has counted the last replies (at most 2 s)."""
    deadline = time.monotonic() + 2.0
    while (after := _server_stats(client)) is not None and before is not None:
        if after["in_flight"] <= before["in_flight"] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return after


def server_breakdown(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The server's figures over the run: counters differenced, mean times derived exactly.

    A timing's mean over the run is ``(count_after * mean_after - count_before * mean_before) /
    (count_after - count_before)``; its ``recent_p50_ms``/``recent_p99_ms`` are the server's
    percentiles over its most recent samples, taken after the run.
    """
    if not before or not after:
        return {}
    config = after.get("config", {})
    batches = after["batches"] - before["batches"]
    sizes = {k: n - before["batch_size_histogram"].get(k, 0)
             for k, n in after["batch_size_histogram"].items()}
    sizes = {k: n for k, n in sizes.items() if n}
    out: dict[str, Any] = {
        "sessions": config.get("num_inference_sessions"),
        "max_batch_size": config.get("max_batch_size"),
        "engine_type": config.get("inference_engine_type"),
        "engine": after.get("engine", {}), "model": after.get("model", {}),
        "requests": _counter_diff(before["requests"], after["requests"]),
        "admitted": after["admitted"] - before["admitted"],
        "connections_opened": (after.get("connections_total", 0)
                               - before.get("connections_total", 0)),
        "batches": batches,
        "batch_rows": after["batch_rows"] - before["batch_rows"],
        "batch_size_histogram": sizes,
        "mean_batch_size": sum(int(k) * n for k, n in sizes.items()) / batches if batches else 0.0,
        "queue_depth": after.get("queue_depth"), "in_flight": after.get("in_flight"),
        "config": config,
    }
    out["rows_per_batch"] = out["batch_rows"] / batches if batches else 0.0
    for name in TIMINGS:
        out[name] = _timing_diff(before[name], after[name])
    return out


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


# -- figures -----------------------------------------------------------------------------------
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
