"""Load the QA server with many client processes and report latency and throughput.

    python stress_test.py --num_simultaneous_clients 5 --num_total_clients 100 --num_request_per_client 10

Each client is a separate process (no shared GIL with the others) with its own connection; it sends
its requests one after another and times each round trip. A short warm-up is not counted.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm

from client import Client
from protocol import ServerError

# A small built-in request mix of varied lengths (written for this project).
PAIRS = [
    ("Where does the ferry leave from?",
     "The morning ferry leaves from the north pier at seven and reaches the island an hour later."),
    ("Who designed the bridge?",
     "The suspension bridge, opened in 1932, was designed by the engineer Lena Brandt, whose firm "
     "also built two dams upstream. It carries four lanes of traffic and a footpath on each side."),
    ("What is the capital?", "Its capital, Valdora, sits on a plateau above the river delta."),
    ("How long did the expedition last?",
     " ".join(["The expedition crossed the ice sheet from west to east."] * 6
              + ["In all it lasted ninety-three days, four more than planned."])),
]


def run_client(args: tuple[str, int, int]) -> list[tuple[float, str]]:
    """One client process: returns (latency seconds, outcome code) per request."""
    host, port, count = args
    results: list[tuple[float, str]] = []
    with Client(host, port) as client:
        for n in range(count):
            question, context = PAIRS[n % len(PAIRS)]
            started = time.perf_counter()
            try:
                client.answer(question, context, timeout=120)
                code = "ok"
            except ServerError as exc:
                code = exc.code
            except Exception as exc:  # noqa: BLE001 - counted, not fatal
                code = type(exc).__name__
            results.append((time.perf_counter() - started, code))
    return results


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def report(results: list[tuple[float, str]], wall_s: float) -> dict[str, Any]:
    """Figures over every request (not per-client means)."""
    latencies = sorted(1000 * lat for lat, code in results if code == "ok")
    errors: dict[str, int] = {}
    for _, code in results:
        if code != "ok":
            errors[code] = errors.get(code, 0) + 1
    figures: dict[str, Any] = {"requests": len(results), "ok": len(latencies), "errors": errors,
                               "throughput_rps": len(latencies) / wall_s if wall_s else 0.0}
    if latencies:
        figures.update(mean_ms=statistics.fmean(latencies),
                       std_ms=statistics.pstdev(latencies),
                       **{f"p{q}_ms": percentile(latencies, q) for q in (50, 90, 95, 99)},
                       max_ms=latencies[-1])
    return figures


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 when every request succeeded."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9999)
    p.add_argument("--num_simultaneous_clients", type=int, default=5)
    p.add_argument("--num_total_clients", type=int, default=100)
    p.add_argument("--num_request_per_client", type=int, default=10)
    p.add_argument("--warmup", type=int, default=20, help="uncounted requests before the run")
    args = p.parse_args(argv)

    try:
        run_client((args.host, args.port, args.warmup))
    except OSError as exc:
        print(f"cannot reach {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    jobs = [(args.host, args.port, args.num_request_per_client)] * args.num_total_clients
    results: list[tuple[float, str]] = []
    started = time.perf_counter()
    with mp.get_context("spawn").Pool(args.num_simultaneous_clients) as pool, \
            tqdm(total=len(jobs) * args.num_request_per_client, unit="req") as bar:
        for client_results in pool.imap_unordered(run_client, jobs):
            results.extend(client_results)
            bar.update(len(client_results))
    figures = report(results, time.perf_counter() - started)
    print(format_report(figures, args.num_simultaneous_clients))
    return 0 if figures["ok"] == figures["requests"] else 1


def format_report(figures: dict[str, Any], clients: int) -> str:
    """The human-readable summary."""
    lines = [f"clients at once: {clients}   requests: {figures['requests']}   ok: {figures['ok']}   "
             f"errors: {figures['errors'] or 'none'}",
             f"throughput: {figures['throughput_rps']:.1f} requests/s"]
    if "mean_ms" in figures:
        lines.append("latency ms: mean {mean_ms:.1f} ± {std_ms:.1f}   p50 {p50_ms:.1f}   "
                     "p90 {p90_ms:.1f}   p95 {p95_ms:.1f}   p99 {p99_ms:.1f}   max {max_ms:.1f}"
                     .format(**figures))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
