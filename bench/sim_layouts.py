"""Server layouts on a simulated GPU (``--inference_engine_type sim``), side by side in one run:
how much of the device each layout keeps busy, on any machine.

    python bench/sim_layouts.py --model_dir saved_models/qa --rounds 5
    python bench/sim_layouts.py --layouts "1 process=" "2 workers=--workers 2" --json out.json

Each round measures every layout, in alternating order, on a fresh server with one simulated
device (its files in a folder of this benchmark's, so that it reads the device's busy seconds):

- **p50 at 1 client** (closed loop), against its ceiling: one request's device time at batch 1
  (the median over the mix) plus the tokenizer's time for one request (the ``tokenizers``
  library alone, taken in the same round), so "+x ms" is what the server adds;
- **requests/s at saturation** (bench/pipeload.py's lean pipelined load), against the device's
  **best-batch capacity**: requests/s of the mix were every window run in the cheapest batch
  per row of its own length bucket that the token budget allows (``--max_batch_tokens``; the
  server captures no CUDA graph beyond it);
- the devices' **busy share** during that load (busy seconds over the load's seconds, the mean
  over the devices the layout used), and the mean batch.

"+x ms over its ceiling" is what the server adds to one request. The ceiling is the curve's
wall time, which holds the simulated run's host parts (engines/sim_host.py), so they are not
among the "+x ms"; the device's busy share counts the device's part only.

The simulated device follows the GPU check's cost curve scaled to this machine's cores
(engines/sim_device.py), so the figures say how a layout would fill a GPU on a machine with
this many cores per GPU, not what any GPU serves.
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

from bench.figures import executor_breakdown, server_breakdown  # noqa: E402
from bench.frontend import tokenizer_floor_us, variant  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from bench.pipeload import add_load_options, run_pipelined  # noqa: E402
from bench.raw import task_requests  # noqa: E402
from bench.runs import run_closed_loop  # noqa: E402
from bench.servers import qa_model_dir, start_server, stop_servers  # noqa: E402
from clients.blocking import Client  # noqa: E402
from engines.model_dir import load_model_info  # noqa: E402
from engines.sim_device import SimDevice, SimSettings  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402
from settings.server_config import ServerConfig  # noqa: E402
from tasks import load_task  # noqa: E402

#: The servers' --length_buckets.
LENGTHS = "64,128,256,384"


def best_per_row_ms(device: SimDevice, length: int, max_tokens: int) -> float:
    """Device ms per row of the cheapest batch of ``length`` tokens the token budget allows,
    over the cost curve's row counts (one row always)."""
    rows = [r for r in device.curve.data["rows"] if r == 1 or r * length <= max_tokens]
    return min(device.device_ms(r, length) / r for r in rows)


def device_ceilings(model_dir: str, pairs: list[tuple[str, str]], device: SimDevice,
                    max_tokens: int) -> dict[str, float]:
    """The device's best-batch capacity in requests/s of the mix, and the median device time
    of one request alone at batch 1 (its windows as one batch), in ms."""
    task = load_task(model_dir, load_model_info(model_dir), ServerConfig(length_buckets=LENGTHS))
    best: list[float] = []  # per request: device ms with each window in the best batch
    alone: list[float] = []
    for request in task_requests(task, pairs):
        features = task.features(request)
        bucket = task.padded_length(features.max_len)  # as the servers' sessions pad it
        best.append(features.rows * best_per_row_ms(device, bucket, max_tokens))
        alone.append(device.device_ms(features.rows, bucket))
    return {"capacity_rps": 1e3 / statistics.mean(best),
            "alone_device_ms": statistics.median(alone)}


def measure_layout(name: str, flags: str, pairs: list[tuple[str, str]],
                   args: argparse.Namespace) -> dict[str, Any]:
    """One server of this layout on a fresh simulated device: p50 at 1 client, then the
    saturation load with the device's busy share during it."""
    with tempfile.TemporaryDirectory(prefix="sim_layouts_") as folder:
        settings = SimSettings(scale=args.sim_scale, directory=folder)
        server_flags = ["--sim_device_dir", folder, "--sim_scale", str(args.sim_scale),
                        "--length_buckets", LENGTHS,
                        "--max_batch_size", str(args.max_batch_size),
                        "--max_batch_tokens", str(args.max_batch_tokens), *shlex.split(flags)]
        proc, port = start_server("sim", args.model_dir, args.sessions, server_flags,
                                  timeout_s=120)
        try:
            one = run_closed_loop("127.0.0.1", port, clients=1,
                                  requests_per_client=args.one_client, pairs=pairs, warmup=4,
                                  progress=False)
            load = {"connections": args.connections, "pipeline": args.pipeline,
                    "processes": args.processes}
            run_pipelined("127.0.0.1", port, pairs, seconds=2.0, **load)  # warm-up
            devices = [SimDevice(int(path.name.rsplit("-", 1)[1]), settings)  # the server's
                       for path in sorted(Path(folder).glob("sim-device-*"))]
            with Client("127.0.0.1", port) as control:
                before, started = control.stats(timeout=30), time.monotonic()
                busy_before = [d.busy_s() for d in devices]
                sat = run_pipelined("127.0.0.1", port, pairs, seconds=args.seconds, **load)
                spent = [d.busy_s() - b for d, b in zip(devices, busy_before, strict=True)]
                elapsed = time.monotonic() - started
                busy = statistics.mean(spent) / elapsed
                after = control.stats(timeout=30)
            for device in devices:
                device.close()
        finally:
            stop_servers(proc, timeout_s=30)
    server = server_breakdown(before, after, op="qa")
    return {"layout": name, "flags": flags, "p50_ms": one["p50_ms"],
            "throughput_rps": sat["throughput_rps"], "errors": sat["errors"],
            "device_busy": busy, "mean_batch": server.get("mean_batch_size", 0.0),
            **executor_breakdown(before, after, elapsed)}


def measure_rounds(args: argparse.Namespace, pairs: list[tuple[str, str]],
                   ceilings: dict[str, float]) -> list[dict[str, Any]]:
    """Every layout in each round, in alternating order, each beside the tokenizer's time."""
    rows = []
    for n in range(args.rounds):
        for name, flags in args.layouts if n % 2 == 0 else args.layouts[::-1]:
            tokenizer_ms = tokenizer_floor_us(args.model_dir, pairs, min_seconds=1.0) / 1e3
            row = measure_layout(name, flags, pairs, args)
            row.update(round=n + 1, tokenizer_ms=tokenizer_ms,
                       of_capacity=row["throughput_rps"] / ceilings["capacity_rps"],
                       over_ceiling_ms=row["p50_ms"] - ceilings["alone_device_ms"] - tokenizer_ms)
            print(f"  round {n + 1}, {name}: {row['throughput_rps']:.0f} req/s "
                  f"({row['of_capacity']:.2f} of capacity), device {row['device_busy']:.0%} "
                  f"busy, mean batch {row['mean_batch']:.1f}; p50 {row['p50_ms']:.2f} ms "
                  f"({row['over_ceiling_ms']:+.2f} over its ceiling)", flush=True)
            rows.append(row)
    return rows


#: The table's figures, in its column order, with their formats.
COLUMNS = (("throughput_rps", ".0f"), ("of_capacity", ".2f"), ("device_busy", ".2f"),
           ("mean_batch", ".1f"), ("p50_ms", ".2f"), ("over_ceiling_ms", "+.2f"))


def report(rows: list[dict[str, Any]], layouts: list[tuple[str, str]]) -> str:
    """Each layout's medians over the rounds, with the lowest and highest."""
    lines = ["| layout | req/s | of capacity | device busy | mean batch | p50 ms "
             "| over ceiling ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    def cell(mine: list[dict[str, Any]], key: str, fmt: str) -> str:
        values = [r[key] for r in mine]
        return (f"{format(statistics.median(values), fmt)} "
                f"({format(min(values), fmt)}–{format(max(values), fmt)})")

    for name, _ in layouts:
        mine = [r for r in rows if r["layout"] == name]
        cells = [cell(mine, key, fmt) for key, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models", help="a QA model folder or a "
                   "repository holding one (its tokenizer and input names only)")
    p.add_argument("--layouts", type=variant, nargs="+",
                   default=[("1 process", ""), ("--workers 2", "--workers 2")],
                   metavar="NAME=FLAGS", help="server layouts to compare, each NAME=FLAGS")
    p.add_argument("--rounds", type=int, default=5, help="rounds, in alternating order")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of saturation load")
    p.add_argument("--one_client", type=int, default=100, help="requests at 1 client")
    p.add_argument("--sessions", type=int, default=2, help="inference sessions per process")
    p.add_argument("--max_batch_size", type=int, default=32, help="the servers' batch cap")
    p.add_argument("--max_batch_tokens", type=int, default=16384, help="the servers' token "
                   "budget, and the capacity's")
    p.add_argument("--sim_scale", type=float, default=0.0, help="the device's speed (0: auto, "
                   "this machine's cores over the measured GPU's machine's)")
    add_load_options(p, connections=16, processes=1)
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    args.model_dir = qa_model_dir(args.model_dir)
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure, print the per-round lines and the table, write the JSON."""
    args = parse_args(argv)
    pairs = load_pairs(None)
    with tempfile.TemporaryDirectory() as folder:
        device = SimDevice(0, SimSettings(scale=args.sim_scale, directory=folder),
                           args.max_batch_tokens)
        ceilings = device_ceilings(args.model_dir, pairs, device, args.max_batch_tokens)
        described = device.describe()
        device.close()
    print(f"{described}\ncapacity {ceilings['capacity_rps']:.0f} req/s of the mix at the best "
          f"batches; one request alone {ceilings['alone_device_ms']:.2f} ms of device time",
          flush=True)
    rows = measure_rounds(args, pairs, ceilings)
    print(report(rows, args.layouts))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": described, "ceilings": ceilings,
                                               "args": {k: v for k, v in vars(args).items()},
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
