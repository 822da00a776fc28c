"""HTTP against TCP, in one run, in interleaved rounds (docs/benchmarks.md, "The HTTP API").

    python bench/http_vs_tcp.py --rounds 5 --json http.json

(1) A real model (``--model_dir``, default saved_models/qa): requests/s at ``--clients``
    clients and p50 at 1 client, over TCP and over HTTP (``POST /ops/qa``: the same request
    and result), on one server process, each round in alternating order.
(2) The front end alone: a zero-engine server (random answers, no model run); the CPU seconds
    of the server's process per answered request over TCP and over HTTP, read from /proc, and
    p50 at 1 client (what each transport adds to a request's latency). With
    ``--loops``, more zero-engine servers whose HTTP API runs on another event loop
    (``QA_HTTP_LOOP``, e.g. asyncio against the default uvloop).
(3) Start-up: the default repository (``--repository``) with HTTP and with ``--http_port -1``,
    seconds from the process's start to the models' loading (imports and listeners, HTTP's
    share of the start) and to serving (the models' warm-up, whose timing runs vary by a
    second), and its resident memory once serving.
Each figure is the median of its rounds, with its spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.mix import load_mix  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import ROOT, start_server, stop_servers, subprocess_drain  # noqa: E402
from broker.local_server import free_port  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load(port: int, http: int | None, clients: int, requests: int, mix: list[Any]) -> dict:
    """One closed-loop run over TCP (``http`` None) or HTTP."""
    url = None if http is None else f"http://127.0.0.1:{http}"
    return run_closed_loop("127.0.0.1", None if url else port, clients=clients,
                           requests_per_client=max(1, requests // clients), pairs=mix,
                           warmup=2, progress=False, url=url)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def model_rounds(args: argparse.Namespace, mix: list[Any]) -> dict[str, Any]:
    """(1): requests/s at ``clients`` and p50 at 1, TCP and HTTP, interleaved."""
    http = free_port()
    proc, port = start_server("onnx", args.model_dir, 2, ["--http_port", str(http)])
    figures: dict[str, list[float]] = {}
    try:
        for n in range(args.rounds):
            order = [None, http] if n % 2 == 0 else [http, None]
            for via in order:
                name = "tcp" if via is None else "http"
                many = load(port, via, args.clients, args.requests, mix)
                one = load(port, via, 1, args.requests_one, mix)
                assert many["ok"] == many["requests"] and one["ok"] == one["requests"], many
                figures.setdefault(f"{name}_rps", []).append(many["throughput_rps"])
                figures.setdefault(f"{name}_p50_1_ms", []).append(one["p50_ms"])
            print(f"  round {n + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in
                                                  figures.items()), flush=True)
    finally:
        stop_servers(proc)
    ratio = [h / t for h, t in zip(figures["http_rps"], figures["tcp_rps"])]
    gap = [h - t for h, t in zip(figures["http_p50_1_ms"], figures["tcp_p50_1_ms"])]
    return {**{k: summary(v) for k, v in figures.items()}, "http_over_tcp_rps": summary(ratio),
            "http_minus_tcp_p50_1_ms": summary(gap), "raw": figures}


def zero_rounds(args: argparse.Namespace, mix: list[Any]) -> dict[str, Any]:
    """(2): the server's CPU per answered request, TCP and HTTP, on each event loop."""
    loops = ["uvloop", *[loop for loop in args.loops.split(",") if loop]]
    servers = {}
    for loop in loops:
        http = free_port()
        os.environ["QA_HTTP_LOOP"] = loop
        servers[loop] = (*start_server("zero", args.model_dir, 2, ["--http_port", str(http)]),
                         http)
    os.environ.pop("QA_HTTP_LOOP", None)
    figures: dict[str, list[float]] = {}
    try:
        for n in range(args.rounds):
            runs = [(loop, via) for loop in loops for via in ("tcp", "http")
                    if via == "http" or loop == "uvloop"]
            for loop, via in runs if n % 2 == 0 else runs[::-1]:
                proc, port, http = servers[loop]
                before = cpu_seconds(proc.pid)
                result = load(port, http if via == "http" else None, args.zero_clients,
                              args.zero_requests, mix)
                used = cpu_seconds(proc.pid) - before
                assert result["ok"] == result["requests"], result["errors"]
                key = "tcp" if via == "tcp" else f"http_{loop}"
                figures.setdefault(f"{key}_cpu_ms", []).append(1000 * used / result["ok"])
                figures.setdefault(f"{key}_rps", []).append(result["throughput_rps"])
                one = load(port, http if via == "http" else None, 1, args.requests_one, mix)
                figures.setdefault(f"{key}_p50_1_ms", []).append(one["p50_ms"])
            print(f"  round {n + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in
                                                  figures.items() if "cpu" in k), flush=True)
    finally:
        stop_servers(*(proc for proc, _, _ in servers.values()))
    out: dict[str, Any] = {k: summary(v) for k, v in figures.items()}
    for loop in loops:
        out[f"http_{loop}_over_tcp_cpu"] = summary(
            [h / t for h, t in zip(figures[f"http_{loop}_cpu_ms"], figures["tcp_cpu_ms"])])
        out[f"http_{loop}_minus_tcp_p50_1_ms"] = summary(
            [h - t for h, t in zip(figures[f"http_{loop}_p50_1_ms"], figures["tcp_p50_1_ms"])])
    out["raw"] = figures
    return out


def timed_start(repository: str, http: bool) -> tuple[Any, float, float]:
    """A server of ``repository`` started with HTTP or ``--http_port -1``: (its process,
    seconds from its start to the log's ``loading`` line, which follows the listeners' start,
    and to ``serving on``)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--port", "0",
                             "--model_dir", repository, "--http_port",
                             str(free_port()) if http else "-1"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    started, loading = time.monotonic(), None
    assert proc.stderr is not None
    for line in proc.stderr:
        if loading is None and " loading " in line:
            loading = time.monotonic() - started
        if "serving on" in line:
            subprocess_drain(proc)
            return proc, loading or 0.0, time.monotonic() - started
    raise RuntimeError(f"the server exited {proc.wait()} before serving")


def startup_rounds(args: argparse.Namespace) -> dict[str, Any]:
    """(3): seconds to the models' loading (the listeners started) and to serving, and
    resident MB once serving, with HTTP and without."""
    figures: dict[str, list[float]] = {}
    for n in range(args.rounds):
        order = ["http", "no_http"] if n % 2 == 0 else ["no_http", "http"]
        for name in order:
            proc, loading, serving = timed_start(args.repository, name == "http")
            figures.setdefault(f"{name}_to_loading_s", []).append(loading)
            figures.setdefault(f"{name}_start_s", []).append(serving)
            time.sleep(1.0)
            figures.setdefault(f"{name}_rss_mb", []).append(rss_mb(proc.pid))
            stop_servers(proc)
            proc.wait()
        print(f"  round {n + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in figures.items()),
              flush=True)
    out: dict[str, Any] = {k: summary(v) for k, v in figures.items()}
    for figure in ("to_loading_s", "start_s", "rss_mb"):
        out[f"{figure}_delta"] = summary([h - b for h, b in zip(figures[f"http_{figure}"],
                                                                figures[f"no_http_{figure}"])])
    out["raw"] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default="saved_models/qa")
    parser.add_argument("--repository", default="saved_models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=192, help="per run at --clients")
    parser.add_argument("--requests_one", type=int, default=200, help="per run at 1 client")
    parser.add_argument("--zero_clients", type=int, default=8)
    parser.add_argument("--zero_requests", type=int, default=2000)
    parser.add_argument("--loops", default="asyncio", help="other event loops for (2)")
    parser.add_argument("--parts", default="model,zero,startup")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    mix = load_mix("qa")
    out: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv}
    parts = args.parts.split(",")
    for part, run in (("model", lambda: model_rounds(args, mix)),
                      ("zero", lambda: zero_rounds(args, mix)),
                      ("startup", lambda: startup_rounds(args))):
        if part in parts:
            print(f"{part}:", flush=True)
            out[part] = run()
            print(json.dumps({k: v for k, v in out[part].items() if k != "raw"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
