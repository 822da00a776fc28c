"""One engine alone on fixed inputs, over the cost curve's grid of batch shapes: bench/gpu_check.py
runs it once per engine variant, each in its own process (its own CUDA context, freed when it
ends; a crash or a hang costs that variant only).

    python bench/engine_grid.py --model_dir bench/models/bert-base-random --engine pytorch \\
        --graph traced --device cuda --precision fp16 --out /tmp/part.json

Each cell: ``--warmup`` untimed runs, then timed runs until ``--runs`` or, past ``--min_runs``,
``--cell_s`` seconds. A run is ``engine.run`` on one fixed batch (random token ids, no padding):
inputs copied in, outputs copied back to host memory, as the server calls it. Cells go from the
smallest batch to the largest; one that would end past ``--deadline`` (a Unix time) is skipped,
and said, as is every larger one. The part written (rewritten after every cell, so that a kill
loses none) holds the cells and skipped cells of engines/cost_curve.py's schema, the engine's own
description, its load time, and (``--request_runs``) one request of the mix through the whole
task at batch 1 (tokenizing, the engine, decoding), the reference for the server at 1 client.
A CUDA-graph cell also holds ``host_ms``, its run's host parts timed one by one
(bench/host_parts.py), which a simulated device spends on the host (engines/sim_host.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.cost_curve import LENGTHS, ROWS  # noqa: E402
from bench.figures import percentile  # noqa: E402
from bench.host_parts import host_parts_ms  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: Bound on a prediction's error: a cell must fit this many times its predicted time.
MARGIN = 1.5
#: Runs each host part of a CUDA-graph cell is timed over (bench/host_parts.py).
HOST_PART_RUNS = 10


def fixed_feeds(names: Sequence[str], rows: int, length: int, vocab: int) -> dict[str, np.ndarray]:
    """The same batch every time for a shape: random token ids between [CLS] and [SEP], every
    position attended, the second half of each row its second segment."""
    rng = np.random.default_rng(rows * 1000 + length)
    ids = rng.integers(1000, max(1001, vocab), size=(rows, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    segments = np.zeros((rows, length), dtype=np.int64)
    segments[:, length // 2:] = 1
    every = {"input_ids": ids, "attention_mask": np.ones((rows, length), dtype=np.int64),
             "token_type_ids": segments}
    return {name: every[name] for name in names}


def time_cell(engine: Any, feeds: Mapping[str, np.ndarray], warmup: int, runs: int,
              min_runs: int, cell_s: float) -> dict[str, Any]:
    """One cell's figures: wall per run (median, p90) and the process's CPU per run."""
    for _ in range(warmup):
        engine.run(feeds)
    walls: list[float] = []
    started, cpu = time.perf_counter(), time.process_time()
    while len(walls) < runs and (len(walls) < min_runs or
                                 time.perf_counter() - started < cell_s):
        began = time.perf_counter()
        engine.run(feeds)
        walls.append(time.perf_counter() - began)
    cpu_ms = 1e3 * (time.process_time() - cpu) / len(walls)
    return {"runs": len(walls), "wall_ms": {"median": 1e3 * statistics.median(walls),
                                            "p90": 1e3 * percentile(sorted(walls), 90)},
            "host_cpu_ms": cpu_ms}


class Grid:
    """The measured and skipped cells of one variant, written to ``out`` as they come."""

    def __init__(self, out: Path, variant: dict[str, Any]) -> None:
        self.out, self.variant = out, variant
        self.part: dict[str, Any] = {"variant": variant, "cells": [], "skipped": []}

    def add(self, rows: int, length: int, figures: dict[str, Any]) -> None:
        """A measured cell."""
        self.part["cells"].append({**self.variant, "rows": rows, "length": length, **figures})
        self.write()

    def skip(self, rows: int, length: int, why: str) -> None:
        """A cell not measured, and why."""
        self.part["skipped"].append({**self.variant, "rows": rows, "length": length, "why": why})
        self.write()

    def write(self) -> None:
        """Rewrite the part file whole (a kill between two cells loses nothing measured)."""
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.part, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.out)


def measure(engine: Any, grid: Grid, args: argparse.Namespace, max_len: int, vocab: int) -> None:
    """Every shape of the grid, smallest batches first, within ``args.deadline``."""
    shapes = sorted(((r, n) for r in args.rows for n in args.lengths),
                    key=lambda s: (s[0] * s[1], s[1]))
    per_token_s: list[float] = []  # seconds per token of each cell measured, in order
    short = ""
    for rows, length in shapes:
        if length > max_len:
            grid.skip(rows, length, f"the model serves at most {max_len} tokens per row")
            continue
        # linear in tokens from the last few cells: cautious (a small batch costs more per
        # token), and one cell slowed by a neighbour on the machine does not decide alone
        recent = statistics.median(per_token_s[-3:]) if per_token_s else 0.0
        predicted = MARGIN * (args.warmup + args.min_runs) * recent * rows * length + args.cell_s
        if short or time.time() + predicted > args.deadline:
            short = short or f"the check's time ran short (about {predicted:.0f} s needed)"
            grid.skip(rows, length, short)
            continue
        feeds = fixed_feeds(engine.input_names, rows, length, vocab)
        figures = time_cell(engine, feeds, args.warmup, args.runs, args.min_runs, args.cell_s)
        parts = host_parts_ms(engine, feeds, HOST_PART_RUNS)  # CUDA graphs only
        grid.add(rows, length, {**figures, "host_ms": parts} if parts else figures)
        per_token_s.append(figures["wall_ms"]["median"] / 1e3 / (rows * length))
        print(f"  {rows:>3} x {length:>3}: {figures['wall_ms']['median']:9.2f} ms median, "
              f"{figures['host_cpu_ms']:8.2f} ms CPU, {figures['runs']} runs", flush=True)


def request_at_batch_1(engine: Any, model_dir: str, runs: int) -> dict[str, float]:
    """One request of the mix through the whole task at batch 1 (bench/raw.py's path):
    tokenizing, the engine, decoding; p50 and mean ms."""
    from bench.mix import load_pairs
    from bench.raw import load_raw_task, run_batches, task_requests

    task = load_raw_task(model_dir)
    requests = task_requests(task, load_pairs(None))
    run_batches(task, engine, requests, 1, 2, offset=0)  # warm
    seconds = run_batches(task, engine, requests, 1, runs, offset=2)
    return {"p50_ms": 1e3 * statistics.median(seconds), "mean_ms": 1e3 * statistics.mean(seconds),
            "runs": runs}


def model_shape(model_dir: str) -> tuple[int, int]:
    """The longest row the folder serves, and its vocabulary size (30522 where unknown)."""
    from engines.model_dir import load_model_info

    config = Path(model_dir) / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size", 30522) if config.is_file() else 30522
    return load_model_info(model_dir).max_seq_len, int(vocab)


def main(argv: list[str] | None = None) -> int:
    """Measure one variant; exit 0 with the part written, also when the engine did not load."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from engines import load_engine

    onnx_graphs = args.engine == "onnx" and args.graph == "cudagraphs"
    variant = {"engine": args.engine, "device": args.device, "precision": args.precision,
               "graph": args.graph if args.engine == "pytorch" or onnx_graphs else None}
    grid = Grid(Path(args.out), variant)
    started = time.perf_counter()
    try:
        options = {"graph": args.graph} if args.engine == "pytorch" else \
            {"onnx_cuda_graphs": onnx_graphs}
        engine = load_engine(args.engine, args.model_dir, device=args.device,
                             precision=args.precision, **options)
    except Exception as exc:  # noqa: BLE001 - said in every cell, and the check goes on
        why = f"the engine did not load: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"  {why}", flush=True)
        for rows in args.rows:
            for length in args.lengths:
                grid.skip(rows, length, why)
        return 0
    # what really runs: a precision or graph the device cannot run falls back, and says so
    variant.update(device=engine.device, precision=engine.precision)
    runs_as = getattr(engine, "graph", None) if args.engine == "pytorch" else \
        ("cudagraphs" if getattr(engine, "graphs", None) else None)
    grid.part.update(describe=engine.describe(), runs_as=runs_as,
                     load_s=time.perf_counter() - started)
    print(f"  {engine.describe()} (loaded in {grid.part['load_s']:.1f} s)", flush=True)
    max_len, vocab = model_shape(args.model_dir)
    grid.variant = {**variant, "runs_as": runs_as}
    measure(engine, grid, args, max_len, vocab)
    if args.request_runs and time.time() + 5 < args.deadline:
        grid.part["request_batch1"] = request_at_batch_1(engine, args.model_dir,
                                                         args.request_runs)
        grid.write()
    engine.close()
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", required=True, help="a prepared QA model folder")
    p.add_argument("--engine", choices=("onnx", "pytorch"), required=True, help="the engine")
    p.add_argument("--graph", default="traced", help="pytorch: its --pytorch_graph; onnx: "
                   "cudagraphs for --onnx_cuda_graphs on")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--precision", default="fp16", help="fp32, fp16 or bf16")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per batch")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="tokens per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per cell")
    p.add_argument("--runs", type=int, default=30, help="timed runs per cell, at most")
    p.add_argument("--min_runs", type=int, default=5, help="timed runs per cell, at least")
    p.add_argument("--cell_s", type=float, default=1.0,
                   help="seconds of timed runs per cell once --min_runs are done")
    p.add_argument("--request_runs", type=int, default=0,
                   help="requests through the whole task at batch 1 (0: none)")
    p.add_argument("--deadline", type=float, default=float("inf"),
                   help="Unix time by which to be done")
    p.add_argument("--out", required=True, help="the part file to write")
    args = p.parse_args(argv)
    args.rows = [int(x) for x in args.rows.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


if __name__ == "__main__":
    sys.exit(main())
