"""Load-generating worker processes for bench/runs.py (and so stress_test.py; the parent side:
bench/loadrun.py).

The parent starts P worker processes (spawn context). Each holds several client connections
(``clients.blocking.Client`` over TCP, or ``clients.http.HttpClient`` where the spec has a
``url``: one request in flight per connection) and drives them from reply callbacks, so a
request costs one reader-thread wake-up on the client side and no extra thread hand-off:

- closed loop: each connection keeps ``pipeline`` requests in flight; a reply sends the next one.
  Slot threads take client tickets from a counter shared by every process, so ``total`` clients run
  ``concurrency`` at a time over the whole run: connect, send, disconnect, next. With a time budget,
  nothing new is sent once it is spent (no new request, no new client); requests already in flight
  are still answered and counted.
- open loop: one sender thread per process sends on a precomputed Poisson schedule without waiting
  for replies; each latency is measured from the request's *scheduled* time.

Workers talk to the parent through one queue: ``("ready", i, planned)``, ``("failed", i, why)``,
``("progress", i, n)`` and ``("done", i, payload)``. They start on one shared event, after the
parent's warm-up, so process start-up is never measured.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bench.answers import wrong_answer
from bench.recorder import Recorder, Reporter
from clients.blocking import Client
from clients.common import ConnectionLost
from clients.http import HttpClient
from protocol import ServerError

Pair = tuple[str, str]
Item = Pair | Mapping[str, Any]
"""One request of the mix: a (question, context) pair (a qa request), or the fields of the
spec's ``op`` (``{"texts": [...]}`` for embed, ``{"text": ...}`` for classify)."""
LoadClient = Client | HttpClient
"""A connection the load goes over: TCP (pipelined) or the HTTP API (one request at a time)."""
#: The ``client`` options an ``HttpClient`` takes (TLS itself follows the URL's scheme).
HTTP_OPTIONS = ("token", "tls_ca", "tls_cert", "tls_key")


@dataclass(frozen=True)
class ClosedSpec:
    """One worker's share of a closed-loop run."""

    host: str  # the TCP listener (with ``url``: the one the server's stats come from)
    port: int | None  # None: none (only with ``url``)
    pairs: Sequence[Item]
    slots: int  # connections this process keeps open at once
    requests_per_client: int
    pipeline: int
    timeout_s: float
    budget_s: float | None = None  # seconds from the start after which nothing new is sent
    op: str = "qa"  # the op of the mix's field maps
    model: str | None = None  # the served model every request names (None: the server's pick)
    #: Client's connection options (token, tls, tls_ca, ...): never printed, it may hold a token
    client: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: The reference answer of each item of ``pairs`` (bench/answers.py): a reply that
    #: disagrees counts as ``wrong_answer``. None: replies are not checked.
    expected: Sequence[Any] | None = field(default=None, repr=False)
    #: The HTTP API's base URL (``http://HOST:PORT``): requests go there, not over TCP
    url: str | None = None


@dataclass(frozen=True)
class OpenSpec:
    """One worker's share of an open-loop run."""

    host: str
    port: int | None
    pairs: Sequence[Item]
    connections: int
    rate: float  # this process's arrivals per second
    duration_s: float
    count: int | None  # most arrivals from this process; None: limited by duration only
    seed: int
    first_pair: int  # where this process starts in the request mix
    timeout_s: float
    op: str = "qa"
    model: str | None = None
    client: Mapping[str, Any] = field(default_factory=dict, repr=False)  # as ClosedSpec's
    expected: Sequence[Any] | None = field(default=None, repr=False)  # as ClosedSpec's
    url: str | None = None  # as ClosedSpec's


def connect(spec: ClosedSpec | OpenSpec) -> LoadClient:
    """A new connection of the spec's: to its ``url`` over HTTP, else over TCP.

    Raises:
        OSError: the server cannot be reached.
    """
    if spec.url is not None:
        return http_client(spec.url, spec.client)
    assert spec.port is not None, "a TCP run needs a port"
    return Client(spec.host, spec.port, **spec.client)


def http_client(url: str, options: Mapping[str, Any]) -> HttpClient:
    """An ``HttpClient`` to ``url`` with the ``Client`` options that apply over HTTP (the token
    and TLS files; TLS itself follows the URL's scheme)."""
    return HttpClient(url, **{k: v for k, v in options.items() if k in HTTP_OPTIONS})


def where(spec: ClosedSpec | OpenSpec) -> str:
    """The spec's server, in words."""
    return spec.url or f"{spec.host}:{spec.port}"


def send(client: LoadClient, item: Item, op: str = "qa",
         model: str | None = None) -> Future[dict[str, Any]]:
    """Send one request of the mix on ``client``: a pair as a qa request, a map as ``op``'s
    fields; naming ``model`` where given."""
    if isinstance(item, Mapping):
        return client.submit_op(op, item, model=model)
    question, context = item
    return client.submit(question, context, model=model)


def outcome(exc: BaseException, timed_out: bool = False) -> str:
    """The error code a failed request is counted under."""
    if isinstance(exc, ServerError):
        return exc.code
    if isinstance(exc, ConnectionLost | OSError):
        return "timeout" if timed_out else "connection_lost"
    return type(exc).__name__


def record(recorder: Recorder, seconds: float, now: float, exc: BaseException | None,
           timed_out: bool, expected: Sequence[Any] | None, index: int,
           future: Future[dict[str, Any]]) -> None:
    """Count one reply: a success, its error, or ``wrong_answer`` where it disagrees with the
    reference answer of mix item ``index``."""
    code = outcome(exc, timed_out) if exc is not None else \
        wrong_answer(expected, index, future.result())
    if code is None:
        recorder.ok(seconds, now)
    else:
        recorder.failed(code)


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


# -- closed loop -------------------------------------------------------------------------------
class _ClosedDriver:
    """One client connection of a closed loop: ``count`` requests, ``pipeline`` in flight, none
    sent after ``deadline`` (``time.perf_counter()`` time)."""

    def __init__(self, client: LoadClient, spec: ClosedSpec, first_pair: int, recorder: Recorder,
                 deadline: float = math.inf) -> None:
        self._client, self._spec, self._first, self._rec = client, spec, first_pair, recorder
        self._deadline = deadline
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
            if time.perf_counter() >= self._deadline:
                self._left = 0  # the budget is spent: this client sends nothing more
                self._rec.budget_spent()
                return
            self._left -= 1
            self._outstanding += 1
            n, self._sent = self._sent, self._sent + 1
        spec = self._spec
        index = (self._first + n) % len(spec.pairs)
        started = time.perf_counter()
        try:
            future = send(self._client, spec.pairs[index], spec.op, spec.model)
        except Exception as exc:  # noqa: BLE001 - the connection is gone: the rest fail with it
            self._abandon(outcome(exc, self._timed_out), current=True)
            return
        future.add_done_callback(partial(self._on_reply, started, index))

    def _on_reply(self, started: float, index: int, future: Future[dict[str, Any]]) -> None:
        now = time.perf_counter()
        self._last_progress = now
        exc = future.exception()
        record(self._rec, now - started, now, exc, self._timed_out,
               self._spec.expected, index, future)
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


def _slot(spec: ClosedSpec, tickets: Any, recorder: Recorder, deadline: float) -> None:
    """One simultaneous client: connect, send its requests, disconnect; again while tickets last
    and the budget (``deadline``) is not spent."""
    while (number := _take_ticket(tickets)) is not None:
        if time.perf_counter() >= deadline:
            recorder.budget_spent()  # this client, and every one after it, never starts
            return
        recorder.client_started()
        try:
            client = connect(spec)
        except OSError:
            recorder.failed("connect_failed", spec.requests_per_client)
            continue
        with client:
            _ClosedDriver(client, spec, number * spec.requests_per_client, recorder,
                          deadline).run()


def closed_worker(spec: ClosedSpec, index: int, events: Any, go: Any, tickets: Any) -> None:
    """Process entry point of a closed-loop worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's; it ends the workers
    recorder = Recorder()
    events.put(("ready", index, None))
    go.wait()
    start = time.perf_counter()
    deadline = start + spec.budget_s if spec.budget_s else math.inf
    with Reporter(index, events, recorder):
        threads = [threading.Thread(target=_slot, args=(spec, tickets, recorder, deadline),
                                    name=f"slot-{n}") for n in range(spec.slots)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    events.put(("done", index, recorder.payload(start)))


# -- open loop ---------------------------------------------------------------------------------
class _OpenTracker:
    """Counts open-loop requests in flight and records each reply against its scheduled time."""

    def __init__(self, recorder: Recorder, timeout_s: float,
                 expected: Sequence[Any] | None = None) -> None:
        self._rec, self._timeout_s, self._expected = recorder, timeout_s, expected
        self._lock = threading.Lock()
        self._in_flight = 0
        self._all_sent = False
        self._idle = threading.Event()
        self._last_progress = time.perf_counter()
        self.timed_out = False

    def sent(self) -> None:
        with self._lock:
            self._in_flight += 1

    def on_reply(self, scheduled: float, index: int, future: Future[dict[str, Any]]) -> None:
        now = time.perf_counter()
        record(self._rec, now - scheduled, now, future.exception(), self.timed_out,
               self._expected, index, future)
        with self._lock:
            self._in_flight -= 1
            self._last_progress = now
            if self._in_flight == 0 and self._all_sent:
                self._idle.set()

    def wait(self, clients: Sequence[LoadClient]) -> None:
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


def _send_on_schedule(spec: OpenSpec, clients: Sequence[LoadClient], offsets: list[float],
                      start: float, tracker: _OpenTracker, recorder: Recorder) -> None:
    """Send request n at ``start + offsets[n]``, round robin over the connections."""
    pairs = spec.pairs
    for n, offset in enumerate(offsets):
        scheduled = start + offset
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        recorder.lags.append(max(0.0, time.perf_counter() - scheduled))
        index = (spec.first_pair + n) % len(pairs)
        try:
            future = send(clients[n % len(clients)], pairs[index], spec.op, spec.model)
        except Exception as exc:  # noqa: BLE001 - that connection is gone; counted
            recorder.failed(outcome(exc))
            continue
        tracker.sent()
        future.add_done_callback(partial(tracker.on_reply, scheduled, index))


def open_worker(spec: OpenSpec, index: int, events: Any, go: Any, tickets: Any) -> None:
    """Process entry point of an open-loop worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        clients = [connect(spec) for _ in range(spec.connections)]
    except OSError as exc:
        events.put(("failed", index, f"cannot connect to {where(spec)}: {exc}"))
        return
    offsets = poisson_offsets(spec.rate, spec.duration_s, spec.count, random.Random(spec.seed))
    recorder = Recorder()
    events.put(("ready", index, len(offsets)))
    go.wait()
    start = time.perf_counter()
    tracker = _OpenTracker(recorder, spec.timeout_s, spec.expected)
    with Reporter(index, events, recorder):
        _send_on_schedule(spec, clients, offsets, start, tracker, recorder)
        tracker.wait(clients)
    for client in clients:
        client.close()
    events.put(("done", index, recorder.payload(start)))
