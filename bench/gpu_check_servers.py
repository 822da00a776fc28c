"""The GPU check's server step, one server at a time: a real server.py (bench/servers.py), its p50
at 1 client under stress_test.py's closed loop (bench/runs.py), then its requests/s at
saturation under the lean pipelined load (bench/pipeload.py) with NVML sampled during it
(bench/nvml.py), and its mean batch over each, from its own ``stats``."""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.figures import executor_breakdown, server_breakdown
from bench.gpu_check_report import Budget, picked
from bench.nvml import NvmlSampler
from bench.pipeload import run_pipelined
from bench.runs import run_closed_loop
from bench.servers import start_server, stop_servers
from clients.blocking import Client

#: (requests, seconds at most) at 1 client; (connections, requests in flight on each, load
#: processes, seconds) at saturation: a GPU run's, then the dry run's.
ONE_CLIENT = {False: (200, 6.0), True: (10, 3.0)}
SATURATION = {False: (32, 8, 4, 8.0), True: (4, 4, 1, 1.0)}
#: The settings each row records as the server ran them (the default server chose them).
CHOSEN = ("inference_engine_type", "precision", "pytorch_graph", "workers", "executors",
          "num_inference_sessions")
#: Most seconds a server may take to start (loading, tracing, warming every bucket); the dry
#: run's too, as a busy CPU machine took over 60 s to trace and warm one (a budget bounds both).
START_S = {False: 120.0, True: 120.0}


def measure_server(engine: str, model_dir: str, flags: list[str], pairs: list[tuple[str, str]],
                   sampler: NvmlSampler, args: argparse.Namespace,
                   budget: Budget) -> dict[str, Any]:
    """One server's figures: what it runs, p50 at 1 client, the saturation run's.

    Raises:
        RuntimeError: it did not start, or a load process failed.
    """
    started = time.perf_counter()
    proc, port = start_server(None if engine == "default" else engine, model_dir,
                              args.sessions, flags,
                              timeout_s=min(START_S[args.dry], max(5.0, budget.left())))
    row: dict[str, Any] = {"flags": flags, "start_s": round(time.perf_counter() - started, 1)}
    try:
        with Client("127.0.0.1", port) as client:
            stats = client.stats(timeout=30)
        described = stats["engine"]
        row.update(precision=described.get("precision"), describe=described.get("description"),
                   chosen={k: stats["config"].get(k) for k in CHOSEN})
        requests, seconds = ONE_CLIENT[args.dry]
        one = run_closed_loop("127.0.0.1", port, clients=1, requests_per_client=requests,
                              pairs=pairs, warmup=2 * args.sessions, progress=False,
                              budget_s=seconds)
        row["one_client"] = {"p50_ms": one["p50_ms"], "p90_ms": one["p90_ms"],
                             "requests": one["requests"], "errors": one["errors"],
                             "mean_batch": one["server"].get("mean_batch_size")}
        row["saturation"] = saturate(port, pairs, sampler, args.dry)
    finally:
        stop_servers(proc, timeout_s=30)
    row["elapsed_s"] = round(time.perf_counter() - started, 1)
    sat = row["saturation"]
    gpu = f", GPU {sat['gpu_util_pct']:.0f}%" if "gpu_util_pct" in sat else ""
    if "executor_batches" in sat:
        gpu += (f", executor batches {sat['executor_rows_per_batch']:.1f} rows from "
                f"{sat['executor_jobs_per_batch']:.1f} jobs, "
                f"{sat['executor_engine_ms_per_batch']:.2f} ms in the engine each, loop idle "
                f"{sat['executor_idle_share']:.0%}")
    label = " ".join([picked(row) if engine == "default" else engine, *flags])
    print(f"  {label}: p50 {row['one_client']['p50_ms']:.2f} ms at 1 client; "
          f"{sat['throughput_rps']:.1f} req/s saturated, mean batch {sat['mean_batch']:.2f}"
          f"{gpu} ({row['elapsed_s']:.0f} s)", flush=True)
    return row


def saturate(port: int, pairs: list[tuple[str, str]], sampler: NvmlSampler,
             dry: bool) -> dict[str, Any]:
    """Requests/s under the lean pipelined load after a short warm-up, the mean batch (the
    server's stats, before and after) and NVML's figures during it."""
    connections, pipeline, processes, seconds = SATURATION[dry]
    load = {"connections": connections, "pipeline": pipeline, "processes": processes}
    run_pipelined("127.0.0.1", port, pairs, seconds=min(2.0, seconds / 4), **load)  # warm-up
    with Client("127.0.0.1", port) as client:
        before, began = client.stats(timeout=30), time.monotonic()
        with sampler:
            result = run_pipelined("127.0.0.1", port, pairs, seconds=seconds, **load)
        after = client.stats(timeout=30)
        between = time.monotonic() - began  # the load's processes start and stop in it too
    server = server_breakdown(before, after, op="qa")
    return {**load, "seconds": seconds, "throughput_rps": result["throughput_rps"],
            "ok": result["ok"], "errors": result["errors"],
            "mean_batch": server.get("mean_batch_size", 0.0),
            "load_cpu_s": result["load_cpu_s"], **executor_breakdown(before, after, between),
            **sampler.summary()}
