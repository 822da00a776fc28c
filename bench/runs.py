"""The load itself, as a library: closed-loop, open-loop and sweep runs against a running server,
and their JSON record. stress_test.py is the command over it; the benchmarks (bench/*.py) and
the tuner call it directly.

    from bench.mix import load_pairs
    from bench.runs import run_closed_loop

    result = run_closed_loop("127.0.0.1", 9999, clients=8, requests_per_client=50,
                             pairs=load_pairs(None), progress=False)

Each run starts worker processes (bench/loadgen.py), warms the server up, takes its ``stats``
before and after (bench/loadrun.py) and returns every figure (bench/figures.py). With ``url``
(``http://HOST:PORT``), the requests go to the HTTP API's ``POST /ops/{op}`` instead, one in
flight per connection, and the stats still come over TCP from ``host``/``port`` (None: no
server breakdown).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.figures import check_positive, json_safe, process_count, split_evenly, summarize_lags
from bench.loadgen import ClosedSpec, Item, OpenSpec, closed_worker, open_worker
from bench.loadrun import measure

#: A sweep level's time budget (seconds): four levels take about a minute.
DEFAULT_LEVEL_SECONDS = 12.0


def run_closed_loop(host: str, port: int | None, *, clients: int, requests_per_client: int,
                    pairs: Sequence[Item], pipeline: int = 1, processes: int | None = None,
                    warmup: int = 0, progress: bool = True, total_clients: int | None = None,
                    timeout_s: float = 120.0, budget_s: float | None = None, op: str = "qa",
                    model: str | None = None, client: Mapping[str, Any] | None = None,
                    expected: Sequence[Any] | None = None,
                    url: str | None = None) -> dict[str, Any]:
    """Closed loop: ``clients`` connections at a time, each sending as soon as a reply is in.

    Args:
        host, port: The server's TCP listener (``port`` None: none, with ``url`` only).
        clients: Connections open at once (``--num_simultaneous_clients``).
        requests_per_client: Requests each connection sends before it disconnects.
        pairs: The request mix, used round robin: (question, context) pairs, or the field maps
            of ``op`` (``load_mix``).
        pipeline: Requests each connection keeps in flight.
        processes: Worker processes; default ``min(clients, cpu count)``.
        warmup: Uncounted requests sent first, on a separate connection.
        progress: Show a progress bar.
        total_clients: Connections over the whole run (default ``clients``); as one finishes,
            the next starts.
        timeout_s: Seconds without a reply after which a connection's requests count as timeout.
        budget_s: Seconds after the start when nothing new is sent (no request, no client);
            requests in flight then are still answered and counted. None: no time limit.
        op: The op of the mix's field maps (pairs are qa requests).
        model: The served model every request names; None: the one serving the op.
        client: ``Client``'s connection options for every connection: ``token`` (a server with
            ``--auth_token_file``), ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``.
        expected: The reference answer of each item of ``pairs`` (bench/answers.py); a reply
            that disagrees counts as the error ``wrong_answer``. None: not checked.
        url: Send the requests to this HTTP API (``http://`` or ``https://HOST:PORT``) instead
            of TCP; ``client``'s token goes as a bearer token. ``pipeline`` must then be 1.

    Returns:
        ``{"settings", "started", "requests", "ok", "errors": {code: n}, "wall_s",
        "throughput_rps", "mean_ms", "std_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms",
        "percentiles_ms", "clients_run", "stopped_by": "budget" | "count", "server": {breakdown}}``;
        latency figures are over the successful requests.

    Raises:
        ConnectionError: The server cannot be reached.
        ValueError: A setting out of range, or ``pipeline`` > 1 with ``url``.
    """
    total_clients = clients if total_clients is None else total_clients
    check_positive(clients=clients, requests_per_client=requests_per_client, pipeline=pipeline,
                    total_clients=total_clients, pairs=len(pairs))
    _check_transport(port, url)
    if url is not None and pipeline != 1:
        raise ValueError("HTTP clients keep one request in flight per connection: pipeline "
                         "must be 1 with a url")
    procs = process_count(processes, clients)
    if budget_s is not None:
        check_positive(budget_s=budget_s)
    specs = [ClosedSpec(host, port, tuple(pairs), slots, requests_per_client, pipeline, timeout_s,
                        budget_s, op, model, dict(client or {}), expected, url)
             for slots in split_evenly(clients, procs)]
    settings = {"mode": "closed", "clients": clients, "total_clients": total_clients,
                "requests_per_client": requests_per_client, "pipeline": pipeline,
                "budget_s": budget_s, "processes": procs, "warmup": warmup, "pairs": len(pairs),
                "op": op, "model": model, "url": url}
    total = total_clients * requests_per_client
    result, payloads = measure(closed_worker, specs, settings=settings, warmup=warmup,
                               tickets=total_clients, total=0 if budget_s else total,
                               progress=progress)  # a budget may end it short of the count
    result["clients_run"] = sum(p["clients"] for p in payloads)
    result["stopped_by"] = "budget" if any(p["cut_short"] for p in payloads) else "count"
    return result


def run_open_loop(host: str, port: int | None, *, rate: float, duration_s: float,
                  pairs: Sequence[Item], processes: int | None = None, warmup: int = 0,
                  progress: bool = True, connections: int | None = None,
                  max_requests: int | None = None, timeout_s: float = 120.0,
                  seed: int = 0, op: str = "qa", model: str | None = None,
                  client: Mapping[str, Any] | None = None,
                  expected: Sequence[Any] | None = None,
                  url: str | None = None) -> dict[str, Any]:
    """Open loop: Poisson arrivals at ``rate`` requests/s in total, sent whatever the replies do.

    Each latency runs from the request's scheduled send time, so a server (or a sender) that
    falls behind shows up in the figures instead of slowing the load down.

    Args:
        rate: Arrivals per second over all processes.
        duration_s: Arrivals stop after this many seconds (``math.inf``: use ``max_requests``).
        pairs: The request mix, used round robin (as for ``run_closed_loop``).
        processes: Worker processes; default ``min(connections, cpu count)``.
        warmup: Uncounted requests sent first, on a separate connection.
        progress: Show a progress bar.
        connections: Connections requests are spread over (default: one per process).
        max_requests: Stop after this many arrivals in total (the first limit reached wins).
        timeout_s: Seconds without a reply, once all are sent, after which the rest time out.
        seed: Seeds the arrival times (process i uses ``seed + i``).
        op, model, client, expected, url: As for ``run_closed_loop``. Over HTTP, a
            connection's requests wait their turn in the client, and the wait counts in
            their latency: give it enough ``connections``.

    Returns:
        As ``run_closed_loop``, plus ``send_lag`` (how late sends were against the schedule).

    Raises:
        ConnectionError: The server cannot be reached.
    """
    check_positive(rate=rate, duration_s=duration_s, pairs=len(pairs))
    _check_transport(port, url)
    procs = process_count(processes, connections or os.cpu_count() or 1)
    connections = max(connections or procs, procs)
    counts = split_evenly(max_requests, procs) if max_requests is not None else [None] * procs
    specs = [OpenSpec(host, port, tuple(pairs), conns, rate / procs, duration_s, count, seed + i,
                      i * len(pairs) // procs, timeout_s, op, model, dict(client or {}),
                      expected, url)
             for i, (conns, count) in enumerate(zip(split_evenly(connections, procs), counts,
                                                    strict=True))]
    settings = {"mode": "open", "rate": rate, "duration_s": duration_s,
                "max_requests": max_requests, "connections": connections, "processes": procs,
                "warmup": warmup, "seed": seed, "pairs": len(pairs), "op": op, "model": model,
                "url": url}
    result, payloads = measure(open_worker, specs, settings=settings, warmup=warmup, tickets=0,
                               total=None, progress=progress)
    result["send_lag"] = summarize_lags(payloads)
    return result


def run_sweep(host: str, port: int | None, *, levels: Sequence[int], requests_per_client: int,
              pairs: Sequence[Item], total_clients: int = 0, pipeline: int = 1,
              processes: int | None = None, warmup: int = 0, progress: bool = True,
              timeout_s: float = 120.0, level_seconds: float | None = DEFAULT_LEVEL_SECONDS,
              on_run: Callable[[dict[str, Any]], None] | None = None, op: str = "qa",
              model: str | None = None, client: Mapping[str, Any] | None = None,
              url: str | None = None) -> list[dict[str, Any]]:
    """One closed-loop run per concurrency level (warm-up before the first only).

    Each level runs up to ``max(level, total_clients)`` client connections of
    ``requests_per_client`` requests, and sends nothing new after ``level_seconds`` (None: no
    time limit); whichever limit comes first ends it (the run's ``stopped_by``). ``op``,
    ``model``, ``client`` and ``url`` as for ``run_closed_loop``.
    """
    runs = []
    for n, level in enumerate(levels):
        runs.append(run_closed_loop(
            host, port, clients=level, requests_per_client=requests_per_client, pairs=pairs,
            pipeline=pipeline, processes=processes, warmup=warmup if n == 0 else 0,
            progress=progress, total_clients=max(level, total_clients), timeout_s=timeout_s,
            budget_s=level_seconds, op=op, model=model, client=client, url=url))
        if on_run is not None:
            on_run(runs[-1])
    return runs


def _check_transport(port: int | None, url: str | None) -> None:
    """Refuse a run with nowhere to send: no TCP port and no url."""
    if port is None and url is None:
        raise ValueError("a run needs a TCP port or a url")


def write_json(path: str | Path, runs: list[dict[str, Any]], argv: Sequence[str]) -> None:
    """Every run, with its settings and server breakdown; NaN becomes null."""
    document = {"tool": "stress_test.py", "argv": list(argv),
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": runs}
    Path(path).write_text(json.dumps(json_safe(document), indent=2) + "\n", encoding="utf-8")
