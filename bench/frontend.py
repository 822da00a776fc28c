"""The front-end benchmark: the server's own CPU per request, against the tokenizer's alone.

    python bench/frontend.py --model_dir saved_models
    python bench/frontend.py --model_dir saved_models --seconds 20 --connections 8 --pipeline 32

A real server.py process serves the real QA task (real sockets, tokenizer and answer decoding)
with the zero-cost engine (``--inference_engine_type zero``: random logits at once), so all it
spends is its own work. Pipelined connections from client processes drive it to saturation for
``--seconds``. The figure that counts is the server's CPU time (user + system, of its process
and any children, read from /proc) divided by the requests it answered, because it does not
depend on how much CPU the load generator takes from the same machine. In the same run, the
floor: CPU per pair of the ``tokenizers`` library alone (one thread, the server's windowing) on
the same mix. docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine, start_server, stop_servers  # noqa: E402
from client import Client  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402
from stress_test import load_pairs, run_closed_loop  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        todo.extend(_children(current))
    return total


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (none where the kernel does not list them)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tokenizer_floor_us(model_dir: str, pairs: list[tuple[str, str]], max_seq_len: int = 384,
                       doc_stride: int = 128, min_seconds: float = 2.0) -> float:
    """CPU microseconds per (question, context) pair for the ``tokenizers`` library alone,
    windowed as the server does (only the context truncated, ``doc_stride`` overlap, offsets)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_seq_len, stride=doc_stride, strategy="only_second")
    for question, context in pairs:  # warm
        tokenizer.encode(question, context)
    done, started = 0, time.process_time()
    while (spent := time.process_time() - started) < min_seconds:
        for question, context in pairs:
            tokenizer.encode(question, context).overflowing  # noqa: B018 - windows, as served
        done += len(pairs)
    return 1e6 * spent / done


def answered(client: Client) -> int:
    """QA requests the server has answered successfully so far."""
    return int(client.stats(timeout=30)["requests"].get("qa", {}).get("ok", 0))


def measure_server(model_dir: str, pairs: list[tuple[str, str]], args: argparse.Namespace,
                   workers: int = 1) -> dict[str, Any]:
    """Saturate one zero-engine server with ``workers`` worker processes (1: none, all in the
    server's process); its CPU per request (front end and workers) and requests/s."""
    sessions = max(1, args.sessions // workers)  # the same engines in all, spread over workers
    proc, port = start_server("zero", model_dir, sessions, ["--workers", str(workers)])
    try:
        with Client("127.0.0.1", port) as control:
            requests_before, cpu_before = answered(control), process_tree_cpu_s(proc.pid)
            run = run_closed_loop("127.0.0.1", port, clients=args.connections,
                                  requests_per_client=10**7, pairs=pairs, pipeline=args.pipeline,
                                  processes=args.processes, warmup=50, progress=False,
                                  budget_s=args.seconds)
            cpu = process_tree_cpu_s(proc.pid) - cpu_before
            requests = answered(control) - requests_before
    finally:
        stop_servers(proc)
    return {"workers": workers, "sessions": sessions, "connections": args.connections,
            "pipeline": args.pipeline, "requests": requests, "server_cpu_s": cpu,
            "cpu_us_per_request": 1e6 * cpu / max(1, requests),
            "throughput_rps": run["throughput_rps"], "errors": run["errors"],
            "p50_ms": run["p50_ms"]}


def report(floor_us: float, rows: list[dict[str, Any]]) -> str:
    """The results as a table, each CPU figure also as a multiple of the floor."""
    lines = [f"tokenizer floor (tokenizers alone, 1 thread): {floor_us:8.1f} us CPU per pair",
             "layout                                    requests/s   server CPU/request   x floor"
             "   errors"]
    for row in rows:
        layout = (f"{row['workers']} worker{'s' if row['workers'] > 1 else ''}, "
                  f"{row['sessions']} session(s) each, {row['connections']}x{row['pipeline']} pipelined")
        lines.append(f"{layout:<41} {row['throughput_rps']:10.1f}   "
                     f"{row['cpu_us_per_request']:14.1f} us   {row['cpu_us_per_request'] / floor_us:7.2f}"
                     f"   {row['errors'] or 'none'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a folder from prepare_model.py "
                   "(only its tokenizer and input names are used)")
    p.add_argument("--data", help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of load")
    p.add_argument("--sessions", type=int, default=2, help="inference sessions in all, shared "
                   "out over the workers (2 sessions: 1 worker x 2, or 2 workers x 1)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--workers values "
                   "to measure, one server each (1: no worker processes)")
    p.add_argument("--connections", type=int, default=8, help="client connections")
    p.add_argument("--pipeline", type=int, default=16, help="requests in flight per connection")
    p.add_argument("--processes", type=int, default=2, help="load-generator processes")
    p.add_argument("--json", help="write every figure to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0."""
    args = parse_args(argv)
    pairs = load_pairs(args.data)
    info = machine()
    print(f"machine: {info}", flush=True)
    floor = tokenizer_floor_us(args.model_dir, pairs)
    rows = [measure_server(args.model_dir, pairs, args, workers) for workers in args.workers]
    print(report(floor, rows), flush=True)
    if len(rows) > 1:
        base = rows[0]["throughput_rps"]
        print("scaling: " + ", ".join(f"{row['workers']} workers {row['throughput_rps'] / base:.2f}x"
                                      for row in rows[1:]) + f" the requests/s of "
              f"{rows[0]['workers']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "argv": sys.argv[1:],
                                               "tokenizer_floor_us": floor, "server": rows},
                                              indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
