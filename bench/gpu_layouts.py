"""Server layouts on one GPU, side by side in one run: each layout's server started once and
kept, then rounds in alternating order, each taking every layout's p50 at 1 client and its
requests/s at saturation (the GPU check's lean pipelined load, with NVML's figures and the
executors' batch figures), against the engine alone's best-batch capacity from a cost curve
(the GPU check's grid, ``--cost_curve``).

    python3 bench/gpu_layouts.py --model_dir bench/models/bert-base-random \
        --cost_curve docs/results/2026-11-27-h100/cost_curve.json --rounds 5 --out $OUT \
        --layouts "--workers 4=--workers 4" "executor, 4 workers=--workers 4 --executors on"
    python3 bench/gpu_layouts.py --device cpu --model_dir DIR ...   # the dry run, any machine

The servers are alive together (each idle while another is measured), so one costs a start
once; the capacity is bench/sim_layouts.py's (every window in the cheapest batch per row of its
own length bucket within the token budget), read off the cost curve at scale 1.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.frontend import variant  # noqa: E402
from bench.gpu_check_servers import saturate  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.nvml import NvmlSampler  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import qa_model_dir, start_server, stop_servers  # noqa: E402
from bench.sim_layouts import LENGTHS, device_ceilings  # noqa: E402
from engines.sim_device import SimDevice, SimSettings  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: Each round's figures that the summary gives medians of.
FIGURES = ("p50_ms", "throughput_rps", "of_capacity", "mean_batch", "gpu_util_pct",
           "executor_rows_per_batch", "executor_idle_share")


def capacity(curve: str, model_dir: str, max_tokens: int) -> dict[str, float]:
    """The engine alone's best-batch capacity (requests/s of the mix) and one request's
    device time alone, from the cost curve at scale 1."""
    with tempfile.TemporaryDirectory() as folder:
        device = SimDevice(0, SimSettings(curve=curve, scale=1.0, directory=folder), max_tokens)
        try:
            return device_ceilings(model_dir, load_pairs(None), device, max_tokens)
        finally:
            device.close()


def one_round(name: str, port: int, pairs: list[tuple[str, str]], sampler: NvmlSampler,
              args: argparse.Namespace, ceilings: dict[str, float]) -> dict[str, Any]:
    """One layout's figures in one round."""
    one = run_closed_loop("127.0.0.1", port, clients=1, requests_per_client=args.one_client,
                          pairs=pairs, warmup=4, progress=False)
    sat = saturate(port, pairs, sampler, args.dry)
    errors = sum(one["errors"].values()) + sum(sat["errors"].values())
    return {"layout": name, "p50_ms": one["p50_ms"],
            "of_capacity": sat["throughput_rps"] / ceilings["capacity_rps"], **sat,
            "errors": errors}


def summary(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per layout, each figure's median, lowest and highest over the rounds."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in rows if r["layout"] == name]
        out[name] = {key: {"median": statistics.median(v), "low": min(v), "high": max(v)}
                     for key in FIGURES if (v := [r[key] for r in mine if key in r])}
    return out


def table(figures: dict[str, dict[str, Any]]) -> str:
    """The medians, lowest to highest in brackets."""
    columns = (("throughput_rps", ".0f"), ("of_capacity", ".2f"), ("gpu_util_pct", ".0f"),
               ("mean_batch", ".1f"), ("executor_rows_per_batch", ".1f"), ("p50_ms", ".2f"))
    lines = ["| layout | req/s | of capacity | GPU util % | mean batch (sessions') "
             "| rows per device batch (executor) | p50 at 1 client, ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, mine in figures.items():
        cells = [f"{format(mine[k]['median'], f)} ({format(mine[k]['low'], f)}–"
                 f"{format(mine[k]['high'], f)})" if k in mine else "-" for k, f in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Start every layout's server, run the rounds, print and write them."""
    args = parse_args(argv)
    model_dir = qa_model_dir(args.model_dir)
    ceilings = capacity(args.cost_curve, model_dir, args.max_batch_tokens)
    print(f"capacity {ceilings['capacity_rps']:.0f} req/s of the mix at the best batches "
          f"(from {args.cost_curve}); one request alone {ceilings['alone_device_ms']:.2f} ms "
          f"of device time", flush=True)
    base = ["--device", args.device, "--precision", args.precision, "--pytorch_graph",
            args.graph, "--length_buckets", LENGTHS, "--max_batch_tokens",
            str(args.max_batch_tokens)]
    servers: dict[str, tuple[Any, int]] = {}
    pairs, sampler, rows = load_pairs(None), NvmlSampler(), []
    try:
        for name, flags in args.layouts:
            servers[name] = start_server("pytorch", model_dir, args.sessions,
                                         [*base, *shlex.split(flags)], timeout_s=240)
            print(f"started {name}", flush=True)
        for n in range(args.rounds):
            for name, _ in args.layouts if n % 2 == 0 else args.layouts[::-1]:
                row = one_round(name, servers[name][1], pairs, sampler, args, ceilings)
                rows.append({**row, "round": n + 1})
                print(f"  round {n + 1}, {name}: {row['throughput_rps']:.0f} req/s "
                      f"({row['of_capacity']:.2f} of capacity), GPU "
                      f"{row.get('gpu_util_pct', float('nan')):.0f}%, mean batch "
                      f"{row['mean_batch']:.1f}, rows per device batch "
                      f"{row.get('executor_rows_per_batch', float('nan')):.1f}; p50 "
                      f"{row['p50_ms']:.2f} ms; errors {row['errors']}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_servers(proc, timeout_s=30)
    figures = summary(rows, [name for name, _ in args.layouts])
    print(table(figures))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_flags": base,
              "ceilings": ceilings, "cost_curve": args.cost_curve, "rows": rows,
              "summary": figures}
    (out / "gpu_layouts.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", required=True, help="a prepared QA model (or repository)")
    p.add_argument("--cost_curve", required=True, help="the GPU check's cost_curve.json")
    p.add_argument("--layouts", type=variant, nargs="+", required=True, metavar="NAME=FLAGS",
                   help="server layouts to compare, each NAME=FLAGS")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the dry run)")
    p.add_argument("--precision", default="fp16", help="fp16, bf16 or fp32")
    p.add_argument("--graph", default=None,
                   help="--pytorch_graph (default: cudagraphs on CUDA, else traced)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sessions", type=int, default=2, help="inference sessions per process")
    p.add_argument("--max_batch_tokens", type=int, default=16384)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    args.dry = args.device == "cpu"
    args.graph = args.graph or ("traced" if args.dry else "cudagraphs")
    args.precision = "fp32" if args.dry else args.precision
    args.one_client = 10 if args.dry else 100
    return args


if __name__ == "__main__":
    sys.exit(main())
