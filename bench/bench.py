"""The benchmark: raw-engine ceiling vs. the server, in one run, on one machine and model.

    python bench/bench.py --model_dir saved_models                # both engines, the defaults below
    python bench/bench.py --engines onnx --concurrency 1,8 --quick

(1) Raw-engine ceiling: the engine called directly in-process with batches of 1, 2, 4, ... 64 of the
    request mix, tokenization and answer decoding included; pairs/s for each batch size.
(2) The server (a real `server.py` process) under stress_test.py's closed-loop load at each
    concurrency, for each engine.
It prints one table with each server figure divided by the best raw-engine figure, and p50 at
concurrency 1 minus the raw batch-1 latency, and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stress_test import load_pairs, run_closed_loop  # noqa: E402


def raw_ceiling(kind: str, model_dir: str, pairs: list[tuple[str, str]], batch_sizes: list[int],
                min_pairs: int, threads: int) -> list[dict[str, Any]]:
    """Pairs/s of the engine called in-process, per batch size (tokenize + run + decode)."""
    from engines import load_engine
    from engines.model_dir import load_model_info
    from engines.qa import QAConfig, QATask

    info = load_model_info(model_dir)
    task = QATask.from_dir(model_dir, QAConfig(handle_impossible_answer=info.squad2),
                           input_names=info.input_names)
    engine = load_engine(kind, model_dir, threads=threads)
    rows = []
    for size in batch_sizes:
        batches = max(2, -(-min_pairs // size))
        _run_batches(task, engine, pairs, size, 1, offset=0)  # warm-up for this shape family
        started = time.perf_counter()
        _run_batches(task, engine, pairs, size, batches, offset=size)
        elapsed = time.perf_counter() - started
        rows.append({"engine": kind, "batch_size": size, "pairs": batches * size,
                     "pairs_per_s": batches * size / elapsed,
                     "batch_latency_ms": 1000 * elapsed / batches})
        print(f"  raw {kind} batch {size:>3}: {rows[-1]['pairs_per_s']:7.1f} pairs/s, "
              f"{rows[-1]['batch_latency_ms']:8.1f} ms/batch", flush=True)
    return rows


def _run_batches(task: Any, engine: Any, pairs: list[tuple[str, str]], size: int, count: int,
                 offset: int) -> None:
    for b in range(count):
        chosen = [pairs[(offset + b * size + i) % len(pairs)] for i in range(size)]
        features = [task.preprocess(q, c) for q, c in chosen]
        task.answer_batch(features, engine.run(task.collate(features)))


def start_server(kind: str, model_dir: str, sessions: int, extra: list[str]) -> tuple[Any, int]:
    """A real server process on a free port; returns (process, port)."""
    cmd = [sys.executable, "server.py", "--port", "0", "--model_dir", model_dir,
           "--inference_engine_type", kind, "--num_inference_sessions", str(sessions),
           "--log_level", "INFO", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    for line in proc.stderr:
        if match := re.search(r"serving on [\d.]+:(\d+)", line):
            subprocess_drain(proc)
            return proc, int(match.group(1))
    raise RuntimeError(f"server did not start (exit {proc.wait()})")


def subprocess_drain(proc: Any) -> None:
    """Keep reading the server's log in the background so it never blocks."""
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


def server_runs(kind: str, model_dir: str, pairs: list[tuple[str, str]], levels: list[int],
                sessions: int, min_requests: int, extra: list[str]) -> list[dict[str, Any]]:
    """Closed-loop load at each concurrency against one server process."""
    proc, port = start_server(kind, model_dir, sessions, extra)
    rows = []
    try:
        for clients in levels:
            per_client = max(4, -(-min_requests // clients))
            result = run_closed_loop("127.0.0.1", port, clients=clients,
                                     requests_per_client=per_client, pairs=pairs,
                                     warmup=2 * sessions, progress=False)
            result.update(engine=kind, concurrency=clients)
            rows.append(result)
            print(f"  server {kind} c={clients:>3}: {result['throughput_rps']:7.1f} req/s, "
                  f"p50 {result['p50_ms']:7.1f} ms, p99 {result['p99_ms']:7.1f} ms, "
                  f"errors {result['errors'] or 0}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return rows


def summary_table(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> str:
    """The one table: server figures against the best raw-engine figure of the same engine."""
    lines = ["| engine | clients | req/s | / best raw | p50 ms | p99 ms | p99/p50 | mean batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in server:
        best = max(r["pairs_per_s"] for r in raw if r["engine"] == row["engine"])
        batch = row.get("server", {}).get("mean_batch_size", float("nan"))
        lines.append(f"| {row['engine']} | {row['concurrency']} | {row['throughput_rps']:.1f} | "
                     f"{row['throughput_rps'] / best:.2f} | {row['p50_ms']:.1f} | "
                     f"{row['p99_ms']:.1f} | {row['p99_ms'] / row['p50_ms']:.2f} | {batch:.2f} |")
    lines += ["", "| engine | best raw pairs/s (batch) | raw batch-1 ms | server p50 at 1 client "
              "ms | difference ms |", "|---|---:|---:|---:|---:|"]
    for kind in dict.fromkeys(r["engine"] for r in raw):
        mine = [r for r in raw if r["engine"] == kind]
        best = max(mine, key=lambda r: r["pairs_per_s"])
        one = next((r for r in mine if r["batch_size"] == 1), None)
        lone = next((s for s in server if s["engine"] == kind and s["concurrency"] == 1), None)
        if one and lone:
            lines.append(f"| {kind} | {best['pairs_per_s']:.1f} ({best['batch_size']}) | "
                         f"{one['batch_latency_ms']:.1f} | {lone['p50_ms']:.1f} | "
                         f"{lone['p50_ms'] - one['batch_latency_ms']:+.1f} |")
    return "\n".join(lines)


def raw_table(raw: list[dict[str, Any]]) -> str:
    """Raw-engine ceiling per batch size."""
    lines = ["| engine | batch | pairs/s | ms per batch |", "|---|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['batch_size']} | {r['pairs_per_s']:.1f} | "
              f"{r['batch_latency_ms']:.1f} |" for r in raw]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    import onnxruntime
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "commit": commit, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default="saved_models")
    p.add_argument("--engines", default="onnx,pytorch")
    p.add_argument("--batch_sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--sessions", type=int, default=2, help="server --num_inference_sessions")
    p.add_argument("--raw_pairs", type=int, default=128, help="pairs per batch size (at least)")
    p.add_argument("--server_requests", type=int, default=256, help="requests per concurrency")
    p.add_argument("--raw_threads", type=int, default=0, help="engine threads (0: all cores)")
    p.add_argument("--server_args", default="", help="extra server.py flags, space-separated")
    p.add_argument("--data", default=None, help="request mix (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--json", default="bench/results/latest.json", help="where to write figures")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run everything and print the tables; returns the exit status."""
    args = parse_args(argv)
    if args.quick:
        args.raw_pairs, args.server_requests = 8, 16
    pairs = load_pairs(args.data)
    kinds = args.engines.split(",")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    threads = args.raw_threads or os.cpu_count() or 1
    info = machine()
    print(f"machine: {info}", flush=True)
    raw = [row for kind in kinds for row in
           raw_ceiling(kind, args.model_dir, pairs, sizes, args.raw_pairs, threads)]
    server = [row for kind in kinds for row in
              server_runs(kind, args.model_dir, pairs, levels, args.sessions,
                          args.server_requests, args.server_args.split())]
    print("\n" + raw_table(raw) + "\n\n" + summary_table(raw, server))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args), "raw": raw, "server": server},
                              indent=2))
    print(f"\nfigures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
