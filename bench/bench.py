"""The benchmark: raw-engine ceiling vs. the server, in one run, on one machine and model.

    python bench/bench.py --model_dir saved_models                # both engines, the defaults below
    python bench/bench.py --engines onnx --concurrency 1,8 --quick

(1) Raw-engine ceiling: the engine called directly in-process with batches of 1, 2, 4, ... 64 of the
    request mix, tokenization and answer decoding included; pairs/s for each batch size. Also the
    server's own layout without the server: --sessions engines in as many threads, batch 1. The
    best of these is the ceiling the server is held to.
(2) The server (a real `server.py` process) under stress_test.py's closed-loop load at each
    concurrency, for each engine and each --batching mode (auto and off, side by side).
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

from settings.cli import HelpFormatter  # noqa: E402
from stress_test import load_pairs, run_closed_loop  # noqa: E402


def raw_ceiling(kind: str, model_dir: str, pairs: list[tuple[str, str]], batch_sizes: list[int],
                min_pairs: int, threads: int, device: str = "auto",
                precision: str = "fp32") -> list[dict[str, Any]]:
    """Pairs/s of the engine called in-process, per batch size (tokenize + run + decode)."""
    from engines import load_engine
    from engines.model_dir import load_model_info
    from tasks.qa import QAConfig, QATask

    info = load_model_info(model_dir)
    task = QATask.from_dir(model_dir, QAConfig(handle_impossible_answer=info.squad2),
                           input_names=info.input_names)
    engine = load_engine(kind, model_dir, threads=threads, device=device, precision=precision)
    rows = []
    for size in batch_sizes:
        batches = max(2, -(-min_pairs // size))
        _run_batches(task, engine, pairs, size, 1, offset=0)  # warm-up for this shape family
        started = time.perf_counter()
        latencies = _run_batches(task, engine, pairs, size, batches, offset=size)
        elapsed = time.perf_counter() - started
        layout = f"1 engine x {threads or 'auto'} thread(s)" + \
            (f", {precision}" if precision != "fp32" else "")
        rows.append(_raw_row(kind, layout, size, batches * size, elapsed, latencies))
    return rows


def raw_parallel(kind: str, model_dir: str, pairs: list[tuple[str, str]], engines: int,
                 min_pairs: int) -> dict[str, Any]:
    """Pairs/s of ``engines`` engines called directly from as many threads, batch 1, cores shared
    out as the server does: the ceiling for the server's own session layout."""
    import threading

    from engines import load_engine
    from engines.model_dir import load_model_info
    from tasks.qa import QAConfig, QATask

    info = load_model_info(model_dir)
    task = QATask.from_dir(model_dir, QAConfig(handle_impossible_answer=info.squad2),
                           input_names=info.input_names)
    threads = max(1, (os.cpu_count() or 1) // engines)
    loaded = [load_engine(kind, model_dir, threads=threads) for _ in range(engines)]
    per_engine = -(-min_pairs // engines)
    latencies: list[list[float]] = [[] for _ in loaded]
    for engine in loaded:
        _run_batches(task, engine, pairs, 1, 2, offset=0)  # warm-up

    def work(n: int) -> None:
        latencies[n] = _run_batches(task, loaded[n], pairs, 1, per_engine, offset=n * per_engine)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(engines)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    return _raw_row(kind, f"{engines} engines x {threads} thread(s), parallel", 1,
                    per_engine * engines, elapsed, sum(latencies, []))


def _raw_row(kind: str, layout: str, size: int, pairs: int, elapsed: float,
             latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    row = {"engine": kind, "layout": layout, "batch_size": size, "pairs": pairs,
           "pairs_per_s": pairs / elapsed, "batch_latency_ms": 1000 * elapsed * size / pairs,
           "p50_batch_ms": 1000 * ordered[len(ordered) // 2]}
    print(f"  raw {kind} [{layout}] batch {size:>3}: {row['pairs_per_s']:7.1f} pairs/s, "
          f"mean {row['batch_latency_ms']:8.1f} ms/batch, p50 {row['p50_batch_ms']:8.1f} ms",
          flush=True)
    return row


def _run_batches(task: Any, engine: Any, pairs: list[tuple[str, str]], size: int, count: int,
                 offset: int) -> list[float]:
    """Tokenize, run and decode ``count`` batches; seconds per batch."""
    seconds = []
    for b in range(count):
        started = time.perf_counter()
        chosen = [pairs[(offset + b * size + i) % len(pairs)] for i in range(size)]
        features = [task.preprocess(q, c) for q, c in chosen]
        task.answer_batch(features, engine.run(task.collate(features)))
        seconds.append(time.perf_counter() - started)
    return seconds


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
                sessions: int, min_requests: int, extra: list[str],
                modes: list[str]) -> list[dict[str, Any]]:
    """Closed-loop load at each concurrency, one server process per batching mode.

    A mode may carry more server flags after a colon (``auto:--workers 2``): servers of
    different layouts then run side by side. All servers start first (an idle one costs
    nothing); at each level the modes run one after the other, in alternating order, so that
    drift on a shared machine does not favour one."""
    servers = {mode: start_server(kind, model_dir, sessions, [*extra, *_mode_flags(mode)])
               for mode in modes}
    rows = []
    try:
        for n, clients in enumerate(levels):
            for mode in modes if n % 2 == 0 else modes[::-1]:
                rows.append(_one_level(kind, mode, servers[mode][1], clients, pairs, sessions,
                                       min_requests))
    finally:
        stop_servers(*(proc for proc, _ in servers.values()))
    return rows


def stop_servers(*procs: Any) -> None:
    """SIGTERM every server (or worker) process, then wait for each to drain and exit."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=120)


def _mode_flags(mode: str) -> list[str]:
    """``auto`` -> ``--batching auto``; ``auto:--workers 2`` -> that plus ``--workers 2``."""
    batching, _, flags = mode.partition(":")
    return ["--batching", batching, *flags.split()]


def _one_level(kind: str, mode: str, port: int, clients: int, pairs: list[tuple[str, str]],
               sessions: int, min_requests: int) -> dict[str, Any]:
    per_client = max(4, -(-min_requests // clients))
    result = run_closed_loop("127.0.0.1", port, clients=clients, requests_per_client=per_client,
                             pairs=pairs, warmup=2 * sessions, progress=False)
    result.update(engine=kind, concurrency=clients, batching=mode)
    print(f"  server {kind} batching={mode} c={clients:>3}: {result['throughput_rps']:7.1f} req/s, "
          f"p50 {result['p50_ms']:7.1f} ms, p99 {result['p99_ms']:7.1f} ms, "
          f"errors {result['errors'] or 0}", flush=True)
    return result


def summary_table(raw: list[dict[str, Any]], server: list[dict[str, Any]]) -> str:
    """The one table: server figures against the best raw-engine figure of the same engine."""
    lines = ["| engine | batching | clients | req/s | / best raw | p50 ms | p99 ms | p99/p50 | "
             "mean batch |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in server:
        best = max(r["pairs_per_s"] for r in raw if r["engine"] == row["engine"])
        batch = row.get("server", {}).get("mean_batch_size", float("nan"))
        lines.append(f"| {row['engine']} | {row['batching']} | {row['concurrency']} | "
                     f"{row['throughput_rps']:.1f} | "
                     f"{row['throughput_rps'] / best:.2f} | {row['p50_ms']:.1f} | "
                     f"{row['p99_ms']:.1f} | {row['p99_ms'] / row['p50_ms']:.2f} | {batch:.2f} |")
    lines += ["", "| engine | best raw pairs/s (layout, batch) | raw batch-1 p50 ms | server p50 "
              "at 1 client ms | difference ms |", "|---|---|---:|---:|---:|"]
    for kind in dict.fromkeys(r["engine"] for r in raw):
        mine = [r for r in raw if r["engine"] == kind]
        best = max(mine, key=lambda r: r["pairs_per_s"])
        one = next((r for r in mine if r["batch_size"] == 1 and "parallel" not in r["layout"]),
                   None)
        lone = next((s for s in server if s["engine"] == kind and s["concurrency"] == 1
                     and s["batching"] == server[0]["batching"]), None)
        if one and lone:
            lines.append(f"| {kind} | {best['pairs_per_s']:.1f} ({best['layout']}, "
                         f"{best['batch_size']}) | {one['p50_batch_ms']:.1f} | {lone['p50_ms']:.1f} "
                         f"| {lone['p50_ms'] - one['p50_batch_ms']:+.1f} |")
    return "\n".join(lines)


def batching_table(server: list[dict[str, Any]], base: str = "off") -> str:
    """Each batching mode's throughput and p50 against ``base`` at the same engine and clients."""
    lines = [f"| engine | batching | clients | req/s vs {base} | p50 vs {base} |",
             "|---|---|---:|---:|---:|"]
    for row in server:
        ref = next((r for r in server if r["batching"] == base and r["engine"] == row["engine"]
                    and r["concurrency"] == row["concurrency"]), None)
        if ref is None or row is ref:
            continue
        lines.append(f"| {row['engine']} | {row['batching']} | {row['concurrency']} | "
                     f"{row['throughput_rps'] / ref['throughput_rps']:.2f} | "
                     f"{row['p50_ms'] / ref['p50_ms']:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def raw_table(raw: list[dict[str, Any]]) -> str:
    """Raw-engine ceiling per batch size."""
    lines = ["| engine | layout | batch | pairs/s | mean ms per batch | p50 ms per batch |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['layout']} | {r['batch_size']} | {r['pairs_per_s']:.1f} | "
              f"{r['batch_latency_ms']:.1f} | {r['p50_batch_ms']:.1f} |" for r in raw]
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a folder from prepare_model.py")
    p.add_argument("--engines", default="onnx,pytorch", help="engines to measure, comma-separated")
    p.add_argument("--batch_sizes", default="1,2,4,8,16,32,64",
                   help="raw-engine batch sizes, comma-separated")
    p.add_argument("--concurrency", default="1,8,32,64",
                   help="server client counts, comma-separated")
    p.add_argument("--sessions", type=int, default=2, help="server --num_inference_sessions")
    p.add_argument("--batching", default="auto,off",
                   help="server --batching modes to run side by side (first is the default's); "
                   "a mode may add server flags after a colon: 'auto,auto:--workers 2'")
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
    raw = []
    for kind in kinds:
        raw += raw_ceiling(kind, args.model_dir, pairs, sizes, args.raw_pairs, threads)
        if args.sessions > 1:
            raw.append(raw_parallel(kind, args.model_dir, pairs, args.sessions, args.raw_pairs))
    modes = args.batching.split(",")
    server = [row for kind in kinds for row in
              server_runs(kind, args.model_dir, pairs, levels, args.sessions,
                          args.server_requests, args.server_args.split(), modes)]
    server.sort(key=lambda r: (kinds.index(r["engine"]), modes.index(r["batching"]),
                               r["concurrency"]))
    print("\n" + raw_table(raw) + "\n\n" + summary_table(raw, server) + "\n\n"
          + batching_table(server))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args), "raw": raw, "server": server},
                              indent=2))
    print(f"\nfigures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
