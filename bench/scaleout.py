"""The broker benchmark: what the hop through Redis costs, and how workers scale behind it.

    python bench/scaleout.py --model_dir saved_models          # qa and embed, ~7 min
    python bench/scaleout.py --model_dir saved_models --quick

Starts a throwaway redis-server (broker/local_server.py), then, in one run, for each task of
``--tasks`` (its model: the repository's model of that task, or ``--model_dir`` itself):

(1) Latency at 1 client, for each engine (for qa also ``zero``: no model, so the hop is all
    there is; and the model's ``onnx``): the in-process server (``server.py``) against a front
    end (``--broker``) with one worker (``--role worker``), same sessions and threads,
    ``--sets`` independent copies of each; one client alternates between the layouts request by
    request; the p50 of each layout per set and over all sets, and their difference.
(2) Scaling on the model: a front end with 1, then 2 workers (``--num_inference_sessions 1
    --threads_per_session 1`` each), closed-loop load at ``--clients``, alternating 1, 2, 1, 2;
    requests/s of 2 over 1, and the CPU per request of the front end and of redis-server. Beside
    it the raw-engine ceiling: the engine called in-process,
    batch 1, one thread, and two engines of one thread in parallel (the task's text work
    included).
(3) For qa, CPU per request of each part (front end, worker, redis-server) with the zero-cost
    engine under pipelined load: what a front end costs when nothing waits on a model.
Writes every figure as JSON; docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine, raw_ceiling, raw_parallel  # noqa: E402
from bench.frontend import process_tree_cpu_s  # noqa: E402
from bench.loadgen import send  # noqa: E402
from bench.mix import load_mix, load_pairs  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import start_server, stop_servers, task_model_dir  # noqa: E402
from broker.local_server import RedisServer  # noqa: E402
from clients.blocking import Client  # noqa: E402
from protocol.errors import ServerError  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: Where the workers' logs go (bench/results/scaleout-logs/worker-PID.log).
LOGS = ROOT / "bench" / "results" / "scaleout-logs"


def start_worker(url: str, model_dir: str, kind: str, extra: list[str]) -> subprocess.Popen[str]:
    """A ``--role worker`` process logging to ``LOGS``; returns once it serves."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = tempfile.NamedTemporaryFile("w+", dir=LOGS, suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "server.py", "--role", "worker", "--broker", url, "--model_dir",
         model_dir, "--inference_engine_type", kind, "--log_level", "INFO", *extra],
        cwd=ROOT, stderr=log, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while not re.search(r"worker \S+ serving", Path(log.name).read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start (exit {proc.poll()}); see {log.name}")
        time.sleep(0.1)
    return proc


def wait_workers(port: int, count: int, timeout: float = 60) -> None:
    """Until the front end on ``port`` counts ``count`` serving workers and is ready."""
    deadline = time.monotonic() + timeout
    with Client("127.0.0.1", port) as client:
        while True:
            stats = client.stats(timeout=10)
            if stats["broker"]["serving_workers"] == count and stats["ready"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} workers never served: {stats['broker']}")
            time.sleep(0.2)


def one_client_latency(task: str, kind: str, model_dir: str, url: str, items: list[Any],
                       requests: int, sets: int, flags: list[str]) -> list[dict[str, Any]]:
    """Latency at 1 client, in-process against front end + 1 worker, request by request.

    ``sets`` independent copies of each layout (set ``i``: an in-process server, and a front
    end with a worker of its own under key prefix ``bench-i``). In each set one client sends
    the mix's requests to both layouts in turn, which one first alternating, ``requests`` to
    each: a burst of noise from a neighbour on the machine then falls on both layouts alike,
    where it fell on one of them in round-by-round runs. Several sets, because two identical
    processes here differ by about 1 ms of p50 (each process's engine runs at its own speed).
    """
    direct, fronts, workers = [], [], []
    try:
        for n in range(sets):
            prefix = ["--broker_prefix", f"bench-{n}"]
            direct.append(start_server(kind, model_dir, 2, flags))
            fronts.append(start_server(kind, model_dir, 2, ["--broker", url, *prefix, *flags]))
            workers.append(start_worker(url, model_dir, kind, [*prefix, *flags]))
        for _, port in fronts:
            wait_workers(port, 1)
        return [_interleaved(task, kind, index + 1, direct[index][1], fronts[index][1], items,
                             requests) for index in range(sets)]
    finally:
        stop_servers(*(proc for proc, _ in direct + fronts), *workers)


def _interleaved(task: str, kind: str, index: int, direct_port: int, front_port: int,
                 items: list[Any], requests: int) -> dict[str, Any]:
    """One set: ``requests`` to each layout, alternating request by request."""
    ms: dict[str, list[float]] = {"in-process": [], "redis": []}
    errors = 0
    with Client("127.0.0.1", direct_port) as direct, Client("127.0.0.1", front_port) as front:
        for item in items[:8]:  # warm-up, not counted
            send(direct, item, task).result(timeout=120)
            send(front, item, task).result(timeout=120)
        for n in range(requests):
            item = items[n % len(items)]
            order = [("in-process", direct), ("redis", front)]
            for layout, client in order if n % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                try:
                    send(client, item, task).result(timeout=120)
                except ServerError:
                    errors += 1
                    continue
                ms[layout].append(1000 * (time.perf_counter() - started))
    row = {"task": task, "engine": kind, "set": index, "errors": errors, "ms": ms,
           **{f"{layout}_p50_ms": statistics.median(values) if values else float("nan")
              for layout, values in ms.items()}}
    print(f"  {task} {kind} set {index}: in-process p50 {row['in-process_p50_ms']:.2f} ms, "
          f"through Redis {row['redis_p50_ms']:.2f} ms, errors {errors}", flush=True)
    return row


def scaling_rounds(task: str, model_dir: str, redis_server: RedisServer, items: list[Any],
                   clients: int, requests: int) -> list[dict[str, Any]]:
    """Requests/s of a front end with 1 and 2 one-thread workers, alternating 1, 2, 1, 2; and
    the CPU per request of the front end's process and of redis-server."""
    url = redis_server.url
    assert redis_server.process is not None
    flags = ["--num_inference_sessions", "1", "--threads_per_session", "1"]
    prefix = ["--broker_prefix", f"scaling-{task}"]
    front, port = start_server("onnx", model_dir, 1, ["--broker", url, *prefix])
    first = start_worker(url, model_dir, "onnx", [*flags, *prefix])
    rows, second = [], None
    try:
        for n, count in enumerate((1, 2, 1, 2)):
            if count == 2:
                second = start_worker(url, model_dir, "onnx", [*flags, *prefix])
            elif second is not None:
                stop_servers(second)
                second = None
            wait_workers(port, count)
            pids = (front.pid, redis_server.process.pid)
            cpu = [process_tree_cpu_s(p) for p in pids]
            result = run_closed_loop("127.0.0.1", port, clients=clients,
                                     requests_per_client=max(4, requests // clients),
                                     pairs=items, warmup=8, progress=False, op=task)
            per = [1e6 * (process_tree_cpu_s(p) - c) / max(1, result["ok"])
                   for p, c in zip(pids, cpu, strict=True)]
            rows.append({"task": task, "round": n + 1, "workers": count,
                         "rps": result["throughput_rps"], "p50_ms": result["p50_ms"],
                         "errors": result["errors"], "front_end_cpu_us": per[0],
                         "redis_cpu_us": per[1]})
            print(f"  {task} scaling round {n + 1}: {count} worker(s) "
                  f"{result['throughput_rps']:.1f} req/s, p50 {result['p50_ms']:.1f} ms, errors "
                  f"{result['errors'] or 0}, CPU per request: front end {per[0]:.0f} us, redis "
                  f"{per[1]:.0f} us", flush=True)
    finally:
        stop_servers(front, first, *([second] if second else []))
    return rows


def cpu_per_request(model_dir: str, redis_server: RedisServer, pairs: list[tuple[str, str]],
                    requests: int) -> dict[str, Any]:
    """CPU per request of a front end, a zero-engine worker and redis-server, driven hard
    (16 connections, 8 pipelined each): what each part costs, with nothing to wait for."""
    assert redis_server.process is not None
    prefix = ["--broker_prefix", "cpu"]
    front, port = start_server("zero", model_dir, 1, ["--broker", redis_server.url, *prefix])
    worker = start_worker(redis_server.url, model_dir, "zero", prefix)
    try:
        wait_workers(port, 1)
        pids = {"front end": front.pid, "worker": worker.pid, "redis": redis_server.process.pid}
        before = {name: process_tree_cpu_s(pid) for name, pid in pids.items()}
        result = run_closed_loop("127.0.0.1", port, clients=16, requests_per_client=max(
            8, requests // 16), pairs=pairs, pipeline=8, warmup=16, progress=False)
        per = {name: 1e6 * (process_tree_cpu_s(pid) - before[name]) / max(1, result["ok"])
               for name, pid in pids.items()}
    finally:
        stop_servers(front, worker)
    print(f"  CPU per request at {result['throughput_rps']:.0f} req/s (zero engine): " +
          ", ".join(f"{name} {us:.0f} us" for name, us in per.items()), flush=True)
    return {"rps": result["throughput_rps"], "errors": result["errors"], "cpu_us": per}


def report(latency: list[dict[str, Any]], scaling: list[dict[str, Any]],
           raw: list[dict[str, Any]], cpu: dict[str, Any] | None) -> str:
    """Markdown tables of one run."""
    lines = ["| task | engine | set | in-process p50 ms | through Redis p50 ms | difference ms |",
             "|---|---|---|---:|---:|---:|"]
    for task, kind in dict.fromkeys((r["task"], r["engine"]) for r in latency):
        rows = [r for r in latency if (r["task"], r["engine"]) == (task, kind)]
        for r in rows:
            lines.append(f"| {task} | {kind} | {r['set']} | {r['in-process_p50_ms']:.2f} | "
                         f"{r['redis_p50_ms']:.2f} | "
                         f"{r['redis_p50_ms'] - r['in-process_p50_ms']:+.2f} |")
        direct, redis = pooled_p50s(rows)
        lines.append(f"| {task} | {kind} | all, pooled | {direct:.2f} | {redis:.2f} | "
                     f"**{redis - direct:+.2f}** |")
    lines += ["", "| task | round | workers | req/s | p50 ms | front-end CPU/request | redis "
              "CPU/request |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['task']} | {r['round']} | {r['workers']} | {r['rps']:.1f} | "
              f"{r['p50_ms']:.1f} | {r['front_end_cpu_us']:.0f} µs | {r['redis_cpu_us']:.0f} µs |"
              for r in scaling]
    lines.append("")
    for task in dict.fromkeys(r["task"] for r in scaling):
        one, two = (statistics.mean(r["rps"] for r in scaling
                                    if r["task"] == task and r["workers"] == n) for n in (1, 2))
        lines.append(f"{task}: 2 workers / 1 worker: **{two / one:.2f}x** (mean of the rounds)")
    lines += ["", "| task | raw engine (in-process, batch 1) | requests/s |", "|---|---|---:|"]
    lines += [f"| {r['task']} | {r['layout']} | {r['pairs_per_s']:.1f} |" for r in raw]
    if cpu is not None:
        lines += ["", f"CPU per request, qa, zero engine, {cpu['rps']:.0f} req/s: " + ", ".join(
            f"{name} {us:.0f} µs" for name, us in cpu["cpu_us"].items())]
    return "\n".join(lines)


def pooled_p50s(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """p50 in process and through Redis, ms, over every request of ``rows`` (sets pooled)."""
    direct, redis = (statistics.median(v for r in rows for v in r["ms"][layout])
                     for layout in ("in-process", "redis"))
    return direct, redis


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a model repository from "
                   "prepare_model.py (or one model folder, with one task in --tasks)")
    p.add_argument("--tasks", default="qa,embed", help="the tasks measured, each on its model")
    p.add_argument("--sets", type=int, default=4, help="independent copies of each layout "
                   "for the 1-client latency")
    p.add_argument("--requests", type=int, default=165,
                   help="1-client requests to each layout of each set (the mix's pairs in "
                        "turn; a multiple of its 55 sends each pair equally often)")
    p.add_argument("--clients", type=int, default=8, help="clients for the scaling rounds")
    p.add_argument("--scaling_requests", type=int, default=400, help="requests per scaling round")
    p.add_argument("--cpu_requests", type=int, default=8000, help="requests for the CPU figures")
    p.add_argument("--data", default=None, help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--json", default="bench/results/scaleout.json", help="where to write figures")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    return p.parse_args(argv)


def measure_task(task: str, model_dir: str, redis_server: RedisServer,
                 args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One task's latency rows (each engine) and scaling rounds."""
    items = load_mix(task, args.data)
    latency = []
    for kind in ("zero", "onnx") if task == "qa" else ("onnx",):
        latency += one_client_latency(task, kind, model_dir, redis_server.url, items,
                                      args.requests, args.sets, [])
    scaling = scaling_rounds(task, model_dir, redis_server, items, args.clients,
                             args.scaling_requests)
    return latency, scaling


def raw_rows(task: str, model_dir: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The raw engine's ceilings for ``task``: one engine of one thread, and two in parallel."""
    items, least = load_mix(task, args.data), 32 if args.quick else 128
    rows = raw_ceiling("onnx", model_dir, items, [1], least, 1)
    rows.append(raw_parallel("onnx", model_dir, items, 2, least))
    return [{**row, "task": task} for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    folders = {task: task_model_dir(args.model_dir, task) for task in tasks}
    if args.quick:
        args.sets, args.requests = 2, 30
        args.scaling_requests, args.cpu_requests = 40, 256
    latency, scaling, cpu = [], [], None
    with tempfile.TemporaryDirectory() as folder:
        redis_server = RedisServer(Path(folder))
        redis_server.start()
        try:
            for task in tasks:
                rows, rounds = measure_task(task, folders[task], redis_server, args)
                latency, scaling = latency + rows, scaling + rounds
            if "qa" in folders:
                cpu = cpu_per_request(folders["qa"], redis_server, load_pairs(args.data),
                                      args.cpu_requests)
        finally:
            redis_server.stop()
    raw = [row for task in tasks for row in raw_rows(task, folders[task], args)]
    text = report(latency, scaling, raw, cpu)
    print(text)
    out = {"machine": machine(), "args": vars(args), "models": folders, "latency": latency,
           "scaling": scaling, "raw": raw, "cpu": cpu, "report": text}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
