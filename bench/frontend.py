"""The front-end benchmark: the server's own CPU per request, against the tokenizer's alone.

    python bench/frontend.py --model_dir saved_models
    python bench/frontend.py --model_dir saved_models --seconds 20 --connections 8 --pipeline 32

A real server.py process serves the real QA task (real sockets, tokenizer and answer decoding)
with the zero-cost engine (``--inference_engine_type zero``: random logits at once), so all it
spends is its own work. Pipelined connections from client processes drive it to saturation for
``--seconds``: by default the lean generator of bench/pipeload.py, which leaves the server
about 100 µs per request more of the two cores they share than stress_test.py's clients
(``--load client``) do; that is about 10% more requests/s for 2 workers, whose processes use
both cores, and nothing for one process, which its GIL holds back first. The figure that
counts is the server's CPU time (user + system, of its process and any children, read from
/proc) divided by the requests it answered, because it does not depend on how much CPU the
load generator takes from the same machine. Beside each server, the
floor: CPU per pair of the ``tokenizers`` library alone (one thread, the server's windowing) on
the same mix, measured just before it, so that each figure is divided by a floor taken at the
same host speed (this shared machine's speed drifts by a quarter from one hour to the next).
``--rounds`` repeats the layouts in alternating order; the summary gives the median multiple of
the floor per layout, and the median over the rounds of each round's requests/s ratio. Each
server's ``cores`` is its CPU time over the wall time of the load (from its first request to its
last reply): how much of the machine it kept busy (one process is held near 1.4 cores by its
GIL on the 2-core CI machine).
``--variants`` compares server flags in the same rounds, e.g.
``--variants 'batch=--cpu_scheduling batch' 'normal=--cpu_scheduling normal'``.
docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.pipeload import add_load_options, run_pipelined  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import qa_model_dir, start_server, stop_servers  # noqa: E402
from clients.blocking import Client  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

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
                   workers: int = 1, variant: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """Saturate one zero-engine server with ``workers`` worker processes (1: none, all in the
    server's process) and the flags of ``variant`` (name, flags); its CPU per request (front
    end and workers) and requests/s."""
    sessions = max(1, args.sessions // workers)  # the same engines in all, spread over workers
    proc, port = start_server("zero", model_dir, sessions,
                              ["--workers", str(workers), *shlex.split(variant[1])])
    try:
        with Client("127.0.0.1", port) as control:
            for question, context in pairs[:16]:  # warm-up, before the count starts
                control.answer(question, context, timeout=60)
            requests_before, cpu_before = answered(control), process_tree_cpu_s(proc.pid)
            run = drive(port, pairs, args)
            cpu = process_tree_cpu_s(proc.pid) - cpu_before
            requests = answered(control) - requests_before
    finally:
        stop_servers(proc)
    return {"workers": workers, "variant": variant[0], "server_args": variant[1],
            "sessions": sessions, "connections": args.connections,
            "pipeline": args.pipeline, "load": args.load, "requests": requests,
            "server_cpu_s": cpu, "server_cores": cpu / run["wall_s"] if run["wall_s"] > 0 else 0.0,
            "cpu_us_per_request": 1e6 * cpu / max(1, requests),
            "throughput_rps": run["throughput_rps"], "errors": run["errors"],
            "p50_ms": run["p50_ms"]}


def drive(port: int, pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """``--seconds`` of pipelined load: the lean generator (bench/pipeload.py), or with
    ``--load client`` stress_test.py's clients."""
    if args.load == "lean":
        return run_pipelined("127.0.0.1", port, pairs, connections=args.connections,
                             pipeline=args.pipeline, processes=args.processes,
                             seconds=args.seconds)
    return run_closed_loop("127.0.0.1", port, clients=args.connections, requests_per_client=10**7,
                           pairs=pairs, pipeline=args.pipeline, processes=args.processes,
                           progress=False, budget_s=args.seconds)  # measure_server warmed it


def _layout(row: dict[str, Any]) -> str:
    """A row's variant (if named) and worker count, in words."""
    workers = f"{row['workers']} worker{'s' if row['workers'] > 1 else ''}"
    return f"{row['variant']}, {workers}" if row.get("variant") else workers


def report(rows: list[dict[str, Any]]) -> str:
    """The results as a table, each CPU figure also as a multiple of the floor taken beside it;
    then the median multiple per layout and the requests/s ratios of each round."""
    lines = ["round  layout                                    requests/s   server CPU/request"
             "      floor   x floor   cores   errors"]
    for row in rows:
        layout = (f"{_layout(row)}, {row['sessions']} session(s) each, "
                  f"{row['connections']}x{row['pipeline']} pipelined")
        lines.append(f"{row['round']:>5}  {layout:<41} {row['throughput_rps']:10.1f}   "
                     f"{row['cpu_us_per_request']:14.1f} us {row['floor_us']:7.1f} us"
                     f"   {row['x_floor']:7.2f}   {row['server_cores']:5.2f}"
                     f"   {row['errors'] or 'none'}")
    for layout in dict.fromkeys(_layout(row) for row in rows):
        multiples = [row["x_floor"] for row in rows if _layout(row) == layout]
        cores = [row["server_cores"] for row in rows if _layout(row) == layout]
        lines.append(f"{layout}: median {statistics.median(multiples):.2f}x the floor "
                     f"({', '.join(f'{m:.2f}' for m in multiples)}), "
                     f"{statistics.median(cores):.2f} cores busy")
    for variant in dict.fromkeys(row.get("variant", "") for row in rows):
        ours = [row for row in rows if row.get("variant", "") == variant]
        for workers, ratios in scaling_ratios(ours).items():
            lines.append(f"scaling{f' ({variant})' if variant else ''}: {workers} workers "
                         f"{statistics.median(ratios):.2f}x the requests/s of "
                         f"{ours[0]['workers']} (median; rounds: "
                         f"{', '.join(f'{r:.2f}' for r in ratios)})")
    return "\n".join(lines)


def scaling_ratios(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Per worker count after the first: each round's requests/s over the first count's."""
    base = rows[0]["workers"]
    first = {row["round"]: row["throughput_rps"] for row in rows if row["workers"] == base}
    ratios: dict[int, list[float]] = {}
    for row in rows:
        if row["workers"] != base:
            ratios.setdefault(row["workers"], []).append(row["throughput_rps"]
                                                          / first[row["round"]])
    return ratios


def measure_rounds(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every layout (variant x workers) in each round, in alternating order, each beside a
    floor of its own."""
    layouts = [(variant, workers) for variant in args.variants for workers in args.workers]
    rows = []
    for n in range(args.rounds):
        for variant, workers in layouts if n % 2 == 0 else layouts[::-1]:
            floor = tokenizer_floor_us(args.model_dir, pairs, min_seconds=args.floor_seconds)
            row = measure_server(args.model_dir, pairs, args, workers, variant)
            row.update({"round": n + 1, "floor_us": floor,
                        "x_floor": row["cpu_us_per_request"] / floor})
            print(f"  round {n + 1}, {_layout(row)}: {row['throughput_rps']:.0f} "
                  f"requests/s, {row['x_floor']:.2f}x the floor", flush=True)
            rows.append(row)
    return rows


def variant(text: str) -> tuple[str, str]:
    """``NAME=FLAGS`` (``--variants``) as (name, flags)."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, not {text!r}")
    return name, flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a QA model folder from "
                   "prepare_model.py, or a repository holding one (only its tokenizer and input "
                   "names are used)")
    p.add_argument("--data", help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of load")
    p.add_argument("--sessions", type=int, default=2, help="inference sessions in all, shared "
                   "out over the workers (2 sessions: 1 worker x 2, or 2 workers x 1)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--workers values "
                   "to measure, one server each (1: no worker processes)")
    add_load_options(p, connections=8, processes=2)
    p.add_argument("--load", choices=("lean", "client"), default="lean", help="the load "
                   "generator: lean (bench/pipeload.py, a few tens of µs of CPU per request) or "
                   "client (stress_test.py's clients, about 150 µs), on the same cores as the "
                   "server")
    p.add_argument("--variants", type=variant, nargs="+", default=[("", "")],
                   metavar="NAME=FLAGS", help="server flags to compare, each measured with "
                   "every --workers value in every round, e.g. 'batch=--cpu_scheduling batch' "
                   "'normal=--cpu_scheduling normal' (default: the server's defaults)")
    p.add_argument("--rounds", type=int, default=1, help="times to measure every layout, in "
                   "alternating order")
    p.add_argument("--floor_seconds", type=float, default=2.0, help="CPU seconds of each "
                   "tokenizer floor")
    p.add_argument("--json", help="write every figure to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0."""
    args = parse_args(argv)
    args.model_dir = qa_model_dir(args.model_dir)
    pairs = load_pairs(args.data)
    info = machine()
    print(f"machine: {info}", flush=True)
    rows = measure_rounds(args, pairs)
    print(report(rows), flush=True)
    if args.json:
        floor = statistics.median(row["floor_us"] for row in rows)
        Path(args.json).write_text(json.dumps({"machine": info, "argv": sys.argv[1:],
                                               "tokenizer_floor_us": floor, "server": rows},
                                              indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
