"""The parent side of the load generator: worker processes, warm-up, server snapshots.

``measure`` starts the workers of bench/loadgen.py, warms the server up (uncounted), takes the
server's ``stats`` before and after, collects every worker's payload and returns the figures.
The stats come over TCP; a run over the HTTP API (a spec's ``url``) without a TCP port has no
server breakdown.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from bench.figures import server_breakdown, summarize
from bench.loadgen import ClosedSpec, LoadClient, OpenSpec, connect, send
from clients.blocking import Client
from protocol import ServerError


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
        total: Requests expected, for the progress bar (None: what the workers announce; 0: not
            known, a bar that counts without an end).
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
    with tqdm(total=total or None, unit="req", disable=not progress, dynamic_ncols=True) as bar:
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
        The run's figures (``settings``, ``started``: local date and time, ``summarize``'s
        figures, ``server``: the breakdown) and the workers' raw payloads.

    Raises:
        ConnectionError: The server (or, from a worker, a connection) cannot be reached.
    """
    first = specs[0]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with ExitStack() as stack:
        control: Client | None = None  # the server's stats, over TCP
        if first.port is not None:
            with _reaching(f"{first.host}:{first.port}"):
                control = stack.enter_context(Client(first.host, first.port, **first.client))
        load: LoadClient | None = control  # the warm-up goes where the load goes
        if first.url is not None:
            with _reaching(first.url):
                load = stack.enter_context(connect(first))
        assert load is not None, "a spec without a port has a url"
        payloads, before = run_workers(
            target, specs, tickets=tickets, warm_up=lambda: _warm_up(load, first, warmup),
            before=lambda: _server_stats(control), total=total, progress=progress)
        after = _settled_stats(control, before)
    return {"settings": settings, "started": started, **summarize(payloads),
            "server": server_breakdown(before, after, settings.get("model"),
                                       settings.get("op"))}, payloads


@contextmanager
def _reaching(where: str) -> Iterator[None]:
    """Connecting to ``where``: OSError becomes ConnectionError, saying where."""
    try:
        yield
    except OSError as exc:
        raise ConnectionError(f"cannot reach {where}: {exc or type(exc).__name__}") from exc


def _warm_up(client: LoadClient, spec: ClosedSpec | OpenSpec, count: int) -> None:
    """Send ``count`` uncounted requests of the spec's mix, 8 in flight at a time; their errors
    are ignored."""
    pairs = spec.pairs
    for first in range(0, count, 8):
        futures = [send(client, pairs[n % len(pairs)], spec.op, spec.model)
                   for n in range(first, min(count, first + 8))]
        for future in futures:
            try:
                future.result(timeout=120)
            except ServerError:
                pass


def _server_stats(client: Client | None) -> dict[str, Any] | None:
    """The server's ``stats`` result, or None without a TCP connection (``client``), from a
    server without that op or no longer reachable (a server that died mid-run: the run's own
    figures still count)."""
    if client is None:
        return None
    try:
        return client.stats(timeout=30)
    except (ServerError, OSError):  # ConnectionLost and TimeoutError included
        return None


def _settled_stats(client: Client | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stats after the run, once the server has counted the last replies (at most 2 s)."""
    deadline = time.monotonic() + 2.0
    while (after := _server_stats(client)) is not None and before is not None:
        if after["in_flight"] <= before["in_flight"] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return after


