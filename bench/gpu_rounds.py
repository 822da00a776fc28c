"""Rounds of one server's GPU figures, each beside one request alone, for a target's median over
runs (the GPU check takes each figure once, bench/gpu_check.py).

    python3 bench/gpu_rounds.py --model_dir bench/models/bert-base-random --rounds 5 --out DIR
    python3 bench/gpu_rounds.py --device cpu --precision fp32 --model_dir DIR   # the dry run

One engine is loaded here (not with ``--no_alone``) and one server.py started, with the same
graph and precision (``--server_flags`` adds to the server's, e.g. ``--workers 4``). Each round
then takes, in this order:

1. one request of the mix alone, through the whole task at batch 1 in this process (tokenizing,
   the engine, decoding: bench/engine_grid.py's ``request_batch1``; null with ``--no_alone``);
2. the server's p50 at 1 client (closed loop);
3. its mean batch at ``--clients`` closed-loop clients (64: issue 32's target);
4. its requests/s at saturation under the GPU check's lean pipelined load, with NVML's figures.

It prints every round, then the median and the spread (lowest to highest) of each figure and of
p50 minus the request alone, and writes ``OUT/gpu_rounds.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engine_grid import request_at_batch_1  # noqa: E402
from bench.gpu_check_servers import saturate  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.nvml import NvmlSampler  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import qa_model_dir, start_server, stop_servers  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: The figures of a round that the summary gives medians of.
FIGURES = ("alone_ms", "p50_ms", "over_alone_ms", "clients_mean_batch", "saturated_rps",
           "saturated_mean_batch")


def one_round(engine: Any, model_dir: str, port: int, pairs: list[tuple[str, str]],
              sampler: NvmlSampler, args: argparse.Namespace) -> dict[str, Any]:
    """One round's figures (module docstring's order; without an engine, no request alone:
    its figures are None)."""
    alone = request_at_batch_1(engine, model_dir, args.request_runs)["p50_ms"] \
        if engine is not None else None
    one = run_closed_loop("127.0.0.1", port, clients=1, requests_per_client=args.one_client,
                          pairs=pairs, warmup=4, progress=False)
    many = run_closed_loop("127.0.0.1", port, clients=args.clients,
                           requests_per_client=args.per_client, pairs=pairs,
                           processes=args.load_processes, progress=False)
    sat = saturate(port, pairs, sampler, args.dry)
    return {"alone_ms": alone, "p50_ms": one["p50_ms"],
            "over_alone_ms": None if alone is None else one["p50_ms"] - alone,
            "clients_mean_batch": many["server"].get("mean_batch_size", 0.0),
            "clients_rps": many.get("throughput_rps"), "saturated_rps": sat["throughput_rps"],
            "saturated_mean_batch": sat["mean_batch"],
            "errors": count(one["errors"]) + count(many["errors"]) + count(sat["errors"]),
            **{k: v for k, v in sat.items() if k.startswith("gpu_")}}


def count(errors: dict[str, int]) -> int:
    """How many errors a run had, from its counts by code."""
    return sum(errors.values())


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each figure's median, lowest and highest over the rounds (figures never taken, such as
    the request alone with ``--no_alone``, left out)."""
    out = {}
    for name in FIGURES:
        values = [r[name] for r in rounds if r[name] is not None]
        if values:
            out[name] = {"median": statistics.median(values), "low": min(values),
                         "high": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Load the engine, start the server, run the rounds, print and write them."""
    args = parse_args(argv)
    from engines import load_engine

    model_dir = qa_model_dir(args.model_dir)
    engine = None if args.no_alone else load_engine(
        "pytorch", model_dir, device=args.device, precision=args.precision, graph=args.graph)
    if engine is not None:
        print(f"here: {engine.describe()}", flush=True)
    flags = ["--device", args.device, "--precision", args.precision, "--pytorch_graph",
             args.graph, "--length_buckets", "64,128,256,384", *shlex.split(args.server_flags)]
    proc, port = start_server("pytorch", model_dir, args.sessions, flags, timeout_s=180)
    pairs, sampler, rounds = load_pairs(None), NvmlSampler(), []
    try:
        for n in range(args.rounds):
            rounds.append(one_round(engine, model_dir, port, pairs, sampler, args))
            r = rounds[-1]
            alone = "" if r["alone_ms"] is None else \
                f"alone {r['alone_ms']:.2f} ms, p50 over it {r['over_alone_ms']:+.2f} ms, "
            print(f"round {n + 1}: {alone}p50 {r['p50_ms']:.2f} ms, mean batch "
                  f"{r['clients_mean_batch']:.1f} at {args.clients} clients, "
                  f"{r['saturated_rps']:.0f} req/s saturated (mean batch "
                  f"{r['saturated_mean_batch']:.1f}), errors {r['errors']}", flush=True)
    finally:
        stop_servers(proc, timeout_s=30)
        if engine is not None:
            engine.close()
    figures = summary(rounds)
    for name, f in figures.items():
        print(f"{name}: median {f['median']:.2f} (from {f['low']:.2f} to {f['high']:.2f})")
    record = {"device": engine.describe() if engine else args.device, "flags": flags,
              "sessions": args.sessions, "clients": args.clients,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": rounds, "summary": figures}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_rounds.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", required=True, help="a prepared QA model (or repository)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the dry run)")
    p.add_argument("--precision", default="fp16", help="fp16, bf16 or fp32")
    p.add_argument("--graph", default=None,
                   help="--pytorch_graph for both (default: cudagraphs on CUDA, else traced)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients for mean batch")
    p.add_argument("--sessions", type=int, default=2, help="the server's inference sessions")
    p.add_argument("--server_flags", default="", help="more flags for the server, e.g. "
                   "'--workers 4'")
    p.add_argument("--no_alone", action="store_true",
                   help="no engine here: skip the request alone (its figures are NaN)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    args.dry = args.device == "cpu"
    args.graph = args.graph or ("traced" if args.dry else "cudagraphs")
    args.request_runs = 5 if args.dry else 100
    args.one_client = 10 if args.dry else 200
    args.per_client = 2 if args.dry else 20
    args.load_processes = 1 if args.dry else 4
    return args


if __name__ == "__main__":
    sys.exit(main())
