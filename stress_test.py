"""Load a running server and report latency and throughput over every request (the load itself:
bench/runs.py).

    python stress_test.py --num_simultaneous_clients 5 --num_total_clients 100  # 1,000 requests
    python stress_test.py --sweep 1,5,20,50 --json runs.json --plot runs.png   # about a minute
    python stress_test.py --rate 50 --duration 30            # open loop: Poisson arrivals
    python stress_test.py --task embed --texts_per_request 8   # embed requests of 8 texts
    python stress_test.py --url http://127.0.0.1:8000 --port 9999  # the HTTP API, stats by TCP

Closed loop (the default): ``--num_total_clients`` client connections,
``--num_simultaneous_clients`` at a time, each sending ``--num_request_per_client`` requests
(``--pipeline`` in flight). Open loop (``--rate``): requests arrive at random (Poisson) at a fixed
total rate whatever the server does, and latency counts from each request's scheduled time.
A sweep (``--sweep``) runs a closed loop per level, each stopped by its time budget
(``--level_seconds``) or its request count, whichever comes first. Clients run in
``--processes`` worker processes, several connections each. The server's own breakdown comes
from its ``stats`` op. ``--task`` picks the op (qa, embed, classify) and ``--model`` the served
model; embed and classify requests take their texts from the same mix (its questions and
contexts). ``--url`` sends the requests to the HTTP API (``POST /ops/{op}``) instead, one in
flight per connection; the server's breakdown then comes over TCP where ``--host`` or ``--port``
is given, and is left out otherwise. See docs/load_testing.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.loadgen import http_client
from bench.mix import DEFAULT_DATA, TASKS, load_mix
from bench.plots import plot_runs
from bench.report import format_report, format_tables
from bench.runs import (
    DEFAULT_LEVEL_SECONDS,
    run_closed_loop,
    run_open_loop,
    run_sweep,
    write_json,
)
from clients.blocking import Client
from clients.endpoint import describe
from console.catalog import routed_to
from console.cli import add_tls_arguments, tls_options
from protocol import BadRequest, ServerError, Unauthorized
from settings.cli import HelpFormatter
from settings.tokens import add_token_options, token_from


# -- CLI ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--host", help="the server's address, or unix:///PATH for its Unix socket "
                   "(server.py --unix_socket) (default: 127.0.0.1; with --url: the URL's host)")
    p.add_argument("--port", type=int, help="the server's TCP port (default: 9999; with --url: "
                   "9999 where --host is given, else none: no server stats)")
    p.add_argument("--url", help="send the requests to the server's HTTP API at this URL, "
                   "http://HOST:PORT (or https://, trusting --tls_ca), one in flight per "
                   "connection; --host/--port then name its TCP listener, for the server's stats")
    p.add_argument("--num_simultaneous_clients", type=int, default=5,
                   help="connections at once (open loop: connections requests are spread over)")
    p.add_argument("--num_total_clients", type=int, default=100,
                   help="connections over the whole closed-loop run (a sweep level: at most "
                        "max(level, this))")
    p.add_argument("--num_request_per_client", type=int, default=10,
                   help="requests each connection sends before it disconnects")
    p.add_argument("--warmup", type=int, default=20,
                   help="uncounted requests first (a sweep: before its first level only)")
    p.add_argument("--processes", type=int, help="worker processes (default: min(clients, cores))")
    p.add_argument("--pipeline", type=int, default=1, help="requests in flight per connection")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s in total")
    p.add_argument("--duration", type=float,
                   help="open loop: seconds of arrivals (default: stop after num_total_clients"
                        " x num_request_per_client requests)")
    p.add_argument("--sweep", help="closed loop at each of these concurrencies, e.g. 1,5,20,50")
    p.add_argument("--level_seconds", type=float,
                   help="sweep: a level sends nothing new after this many seconds; replies to "
                        "requests already sent are awaited and counted. A level ends at this "
                        "budget or after max(level, num_total_clients) x num_request_per_client "
                        f"requests, whichever comes first; 0: no budget (default: "
                        f"{DEFAULT_LEVEL_SECONDS:g})")
    p.add_argument("--task", choices=TASKS, default="qa",
                   help="the requests: qa (question and context), embed (texts) or classify "
                        "(a text); embed and classify take the mix's questions and contexts as "
                        "texts")
    p.add_argument("--model", help="the served model every request names (needed where several "
                                   "serve the task; the server's `models` op lists them)")
    p.add_argument("--texts_per_request", type=int,
                   help="embed: texts in each request (default: 1)")
    p.add_argument("--data", help="JSON-lines (or JSON list) of {question, context} objects; "
                                  "for embed and classify, {text} objects too "
                                  "(default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--json", help="write every figure of every run to this file")
    p.add_argument("--plot", help="draw latency percentiles and throughput to this PNG")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds without any reply after which the rest count as timeout")
    p.add_argument("--seed", type=int, default=0, help="seed of the open loop's arrival times")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_token_options(p)
    add_tls_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, checked; adds ``levels`` (the sweep's) and ``pairs`` (the mix:
    the requests of ``--task``)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.token = token_from(args, p)
    _check_url(p, args)
    if not args.tls and (args.tls_ca or args.tls_cert or args.tls_key):
        p.error("--tls_ca, --tls_cert and --tls_key need --tls (or an https:// --url)")
    if args.rate is not None and (args.sweep or args.pipeline != 1):
        p.error("--rate (open loop) does not go with --sweep or --pipeline")
    if args.duration is not None and args.rate is None:
        p.error("--duration needs --rate")
    if args.level_seconds is not None and not args.sweep:
        p.error("--level_seconds needs --sweep")
    if args.level_seconds is not None and args.level_seconds < 0:
        p.error("--level_seconds must be 0 (no budget) or more")
    if args.level_seconds is None:
        args.level_seconds = DEFAULT_LEVEL_SECONDS
    if args.texts_per_request is not None and args.task != "embed":
        p.error("--texts_per_request needs --task embed")
    if args.texts_per_request is None:
        args.texts_per_request = 1
    try:
        args.levels = [int(n) for n in args.sweep.split(",")] if args.sweep else []
        args.pairs = load_mix(args.task, args.data, args.texts_per_request)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    return args


def _check_url(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check ``--url`` and fill in ``--host`` and ``--port``: with a URL, the TCP listener the
    server's stats come from, if either is given (``port`` None: none)."""
    if args.url is None:
        args.host, args.port = args.host or "127.0.0.1", args.port or 9999
        return
    try:
        parts = urlsplit(args.url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        p.error(f"--url {args.url}: {exc}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        p.error(f"--url {args.url}: give http://HOST:PORT or https://HOST:PORT")
    if args.pipeline != 1:
        p.error("--url: HTTP clients keep one request in flight per connection (HTTP/1.1 "
                "without pipelining): --pipeline must be 1; raise --num_simultaneous_clients")
    if args.tls and parts.scheme != "https":
        p.error("--tls with --url needs an https:// URL")
    args.tls = parts.scheme == "https"  # the TCP listener serves the same TLS
    if args.host is not None or args.port is not None:
        args.host, args.port = args.host or parts.hostname, args.port or 9999
    else:
        args.host = parts.hostname


def check_served(host: str, port: int | None, task: str, model: str | None,
                 client: Mapping[str, Any] | None = None, url: str | None = None) -> None:
    """Refuse a run whose every request the server would refuse (``bad_request``): ``model``
    not served or serving another op, or no model, or several and none named, serving ``task``.
    A server older than the ``models`` op is not checked. With ``url``, the models come from
    the HTTP API's ``GET /info``.

    Raises:
        ValueError: what is wrong, with what the server serves.
        ConnectionError: the server cannot be reached, or refused the token (or the lack of one).
    """
    where = url or f"{host}:{port}"
    try:
        if url is not None:
            with http_client(url, client or {}) as http:
                models = http.models(timeout=30)
        else:
            assert port is not None, "a TCP run needs a port"
            with Client(host, port, **(client or {})) as control:
                models = control.models(timeout=30)
    except BadRequest:
        return
    except Unauthorized as exc:
        raise ConnectionError(f"{where} refused the connection: {exc.message} "
                              "(--token, --token_file)") from None
    except (OSError, ValueError, ServerError) as exc:  # ValueError: TLS options out of place
        raise ConnectionError(f"cannot reach {where}: {exc}") from exc
    target = routed_to(models, task, model)
    if target is not None and target["op"] == task:
        return
    served = ", ".join(f"{m['name']} ({m['op']})" for m in models) or "nothing"
    if target is not None:
        why = f"model {model!r} serves {target['op']} requests, not {task}"
    elif model is not None:
        why = f"no model {model!r} here"
    elif any(m["op"] == task for m in models):
        why = f"several models serve {task} requests: name one with --model"
    else:
        why = f"no model here serves {task} requests"
    raise ValueError(f"{why} (served: {served})")


def _runs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """Run what the options ask for, appending each result to ``runs`` and printing it."""
    client = {"token": args.token, **tls_options(args)}
    check_served(args.host, args.port, args.task, args.model, client, args.url)
    if args.url is not None:
        print(_http_line(args, client), flush=True)
    common = {"pairs": args.pairs, "processes": args.processes, "warmup": args.warmup,
              "progress": not args.no_progress, "timeout_s": args.timeout, "op": args.task,
              "model": args.model, "client": client, "url": args.url}

    def record(result: dict[str, Any]) -> None:
        result["settings"]["data"] = str(args.data or DEFAULT_DATA)
        result["settings"]["texts_per_request"] = args.texts_per_request
        runs.append(result)
        print(_task_line(args) + format_report(result) + ("\n" if args.levels else ""),
              flush=True)

    if args.rate is not None:
        total = args.num_total_clients * args.num_request_per_client
        record(run_open_loop(
            args.host, args.port, rate=args.rate, connections=args.num_simultaneous_clients,
            duration_s=args.duration if args.duration is not None else math.inf,
            max_requests=None if args.duration is not None else total, seed=args.seed, **common))
    elif args.levels:
        run_sweep(args.host, args.port, levels=args.levels, total_clients=args.num_total_clients,
                  requests_per_client=args.num_request_per_client, pipeline=args.pipeline,
                  level_seconds=args.level_seconds or None, on_run=record, **common)
        print(format_tables(runs))
    else:
        record(run_closed_loop(
            args.host, args.port, clients=args.num_simultaneous_clients,
            total_clients=args.num_total_clients, requests_per_client=args.num_request_per_client,
            pipeline=args.pipeline, **common))


def _http_line(args: argparse.Namespace, client: Mapping[str, Any]) -> str:
    """The line that says the load goes over HTTP, and where the server's stats come from;
    a TCP listener that cannot be reached is dropped (``args.port`` becomes None)."""
    head = f"over HTTP: {args.url}, one request in flight per connection; "
    if args.port is None:
        return head + ("no server stats (they come over TCP: give --host or --port of its "
                       "TCP listener)")
    where = describe(args.host, args.port)
    try:
        with Client(args.host, args.port, **client) as control:
            control.stats(timeout=10)
    except (OSError, ValueError, ServerError) as exc:
        args.port = None
        return head + f"no server stats (cannot read them over TCP from {where}: {exc})"
    return head + f"server stats over TCP from {where}"


def _task_line(args: argparse.Namespace) -> str:
    """The report's first line when the requests are not the default qa ones of any model."""
    if args.task == "qa" and args.model is None:
        return ""
    texts = f", {args.texts_per_request} texts per request" if args.task == "embed" else ""
    model = f"model {args.model}" if args.model else "the model serving it"
    return f"task: {args.task}, {model}{texts}\n"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 when every request succeeded, 1 otherwise, 2 if the server is out of
    reach."""
    args = parse_args(argv)
    runs: list[dict[str, Any]] = []
    status = 0
    try:
        _runs(args, runs)
    except (ConnectionError, ValueError) as exc:
        print(f"stress_test: {exc}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("stress_test: interrupted", file=sys.stderr)
        status = 130
    if runs and args.json:
        write_json(args.json, runs, sys.argv[1:] if argv is None else argv)
        print(f"wrote every figure of {len(runs)} run(s) to {Path(args.json).resolve()}")
    if runs and args.plot:
        plot_runs(args.plot, runs)
        print(f"wrote the plot to {Path(args.plot).resolve()}")
    if status == 0 and any(r["ok"] != r["requests"] for r in runs):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
