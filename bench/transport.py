"""The transport's own cost: a Unix socket against TCP loopback, on one zero-engine server.

    python bench/transport.py --model_dir saved_models/qa
    python bench/transport.py --model_dir saved_models/qa --rounds 5 --seconds 10 --json t.json

One server.py process with ``--inference_engine_type zero`` (random logits at once, no model)
serves the real QA task on 127.0.0.1 over TCP and on ``--unix_socket`` at the same time, so both
transports meet the same process, tokenizer and answer decoding: only the socket differs. For
each transport it measures

- 1 client, sequential: ``--requests`` requests one at a time, latency p50 and p99, for
  ``ping`` (framing and the socket alone) and for ``qa`` (the whole front end);
- saturation: ``--connections`` connections, ``--pipeline`` requests in flight on each, from
  ``--processes`` load-generator processes, for ``--seconds``: requests/s.

Runs alternate between the transports, the order reversing each round, so that drift on a
shared machine favours neither; each figure is the median over ``--rounds``.
docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.pipeload import add_load_options  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import start_server, stop_servers  # noqa: E402
from clients.blocking import Client  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: The request timed one at a time: short, so that the transport's share shows.
QUESTION, CONTEXT = "Who wrote the notes?", "Ada wrote the notes in 1843."
TRANSPORTS = ("tcp", "unix")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def sequential(host: str, port: int, op: str, requests: int) -> dict[str, float]:
    """One client, one request at a time: round-trip latency in ms (p50, p99, mean)."""
    with Client(host, port) as client:
        call = (lambda: client.ping()) if op == "ping" else \
            (lambda: client.answer(QUESTION, CONTEXT))
        for _ in range(max(10, requests // 10)):  # warm: connection, caches, branch predictors
            call()
        took = []
        for _ in range(requests):
            started = time.perf_counter()
            call()
            took.append(1000 * (time.perf_counter() - started))
    return {"p50_ms": percentile(took, 0.5), "p99_ms": percentile(took, 0.99),
            "mean_ms": statistics.fmean(took)}


def saturation(host: str, port: int, pairs: list[tuple[str, str]],
               args: argparse.Namespace) -> dict[str, Any]:
    """Pipelined connections for ``args.seconds``: requests/s, p50 and errors."""
    run = run_closed_loop(host, port, clients=args.connections, requests_per_client=10**7,
                          pairs=pairs, pipeline=args.pipeline, processes=args.processes,
                          warmup=50, progress=False, budget_s=args.seconds)
    return {"throughput_rps": run["throughput_rps"], "p50_ms": run["p50_ms"],
            "errors": run["errors"]}


def one_round(addresses: dict[str, tuple[str, int]], order: list[str],
              pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Every measure once per transport, alternating the transports within each measure."""
    figures: dict[str, Any] = {name: {} for name in order}
    for op in ("ping", "qa"):
        for name in order:
            figures[name][op] = sequential(*addresses[name], op, args.requests)
    for name in order:
        figures[name]["saturation"] = saturation(*addresses[name], pairs, args)
    return figures


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds, per transport."""
    def median(name: str, part: str, key: str) -> float:
        return statistics.median(r[name][part][key] for r in rounds)

    return {name: {"ping_p50_ms": median(name, "ping", "p50_ms"),
                   "ping_p99_ms": median(name, "ping", "p99_ms"),
                   "qa_p50_ms": median(name, "qa", "p50_ms"),
                   "qa_p99_ms": median(name, "qa", "p99_ms"),
                   "saturation_rps": median(name, "saturation", "throughput_rps"),
                   "errors": [r[name]["saturation"]["errors"] for r in rounds]}
            for name in TRANSPORTS}


def report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The medians as a table, with Unix's figures as a ratio of TCP's."""
    tcp, unix = summary["tcp"], summary["unix"]
    rows = [("1 client, ping p50 (ms)", "ping_p50_ms"), ("1 client, ping p99 (ms)", "ping_p99_ms"),
            ("1 client, qa p50 (ms)", "qa_p50_ms"), ("1 client, qa p99 (ms)", "qa_p99_ms"),
            (f"saturation, {args.connections}x{args.pipeline} pipelined (requests/s)",
             "saturation_rps")]
    lines = [f"{'median of ' + str(args.rounds) + ' rounds':<46} {'TCP':>10} {'Unix':>10} "
             f"{'Unix/TCP':>9}"]
    for label, key in rows:
        lines.append(f"{label:<46} {tcp[key]:10.3f} {unix[key]:10.3f} "
                     f"{unix[key] / tcp[key]:9.2f}")
    errors = [e for name in TRANSPORTS for e in summary[name]["errors"] if e]
    lines.append(f"errors: {errors or 'none'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models/qa", help="a QA model folder from "
                   "prepare_model.py (only its tokenizer and input names are used)")
    p.add_argument("--data", help="request mix at saturation (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are their medians")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per "
                   "transport, op and round")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of saturation per "
                   "transport and round")
    p.add_argument("--sessions", type=int, default=2, help="server --num_inference_sessions")
    add_load_options(p, connections=8, processes=2)
    p.add_argument("--json", help="write every figure to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0."""
    args = parse_args(argv)
    pairs = load_pairs(args.data)
    info = machine()
    print(f"machine: {info}", flush=True)
    with tempfile.TemporaryDirectory(prefix="qa-bench-", dir="/tmp") as folder:
        path = f"{folder}/qa.sock"
        proc, port = start_server("zero", args.model_dir, args.sessions, ["--unix_socket", path])
        try:
            addresses = {"tcp": ("127.0.0.1", port), "unix": (f"unix://{path}", 0)}
            rounds = [one_round(addresses, list(TRANSPORTS)[::1 if i % 2 == 0 else -1], pairs, args)
                      for i in range(args.rounds)]
        finally:
            stop_servers(proc)
    summary = summarize(rounds)
    print(report(summary, args), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "argv": sys.argv[1:],
                                               "summary": summary, "rounds": rounds},
                                              indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
