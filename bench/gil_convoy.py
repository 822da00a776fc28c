"""The GIL convoy, through the PyTorch engine: one batch's run alone and beside a thread that runs
Python, for the eager model and the traced graph (``--pytorch_graph``).

    python bench/gil_convoy.py --model_dir saved_models/qa
    python bench/gil_convoy.py --model_dir saved_models/qa --device cuda --precision fp16

Eager PyTorch takes the GIL back after every operator; beside a thread that runs Python, each
take-back waits for that thread to let go, up to the switch interval (5 ms). Three neighbours:
none, a thread looping in Python, and a thread tokenizing the mix's contexts with ``encode()``
(which holds the GIL, as a worker process's main thread does beside ONNX Runtime). Each figure
is the median wall time of ``--runs`` runs of one batch (``--rows`` x ``--length``), and the
engine thread's own CPU time per run beside it. docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench import machine  # noqa: E402
from bench.mix import load_pairs  # noqa: E402
from engines import PRECISIONS, TORCH_GRAPHS, load_engine  # noqa: E402
from engines.base import Engine  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402


def timed_runs(engine: Engine, feeds: dict[str, np.ndarray], runs: int) -> tuple[float, float]:
    """Median wall milliseconds per run, and mean CPU milliseconds of this thread per run."""
    walls, cpu = [], time.thread_time()
    for _ in range(runs):
        started = time.perf_counter()
        engine.run(feeds)
        walls.append(time.perf_counter() - started)
    return 1e3 * statistics.median(walls), 1e3 * (time.thread_time() - cpu) / runs


def beside(body: Callable[[], object] | None, measure: Callable[[], tuple[float, float]]
           ) -> tuple[float, float]:
    """``measure()`` while another thread runs ``body`` over and over (alone when None)."""
    if body is None:
        return measure()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            body()

    neighbour = threading.Thread(target=loop, daemon=True)
    neighbour.start()
    try:
        return measure()
    finally:
        stop.set()
        neighbour.join()


def neighbours(model_dir: str) -> dict[str, Callable[[], object] | None]:
    """The threads each engine is measured beside, by label."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    contexts = [context for _, context in load_pairs(None)][:8]
    return {"alone": None, "beside a Python loop": lambda: sum(range(200)),
            "beside encode() (GIL held)": lambda: [tokenizer.encode(c) for c in contexts]}


def main(argv: list[str] | None = None) -> int:
    """Measure every graph beside every neighbour; print one table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", default="saved_models/qa", help="a prepared model folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="fp16 runs on CUDA only")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (one core is "
                   "left to the neighbour on a 2-core machine)")
    p.add_argument("--rows", type=int, default=1, help="rows per batch")
    p.add_argument("--length", type=int, default=128, help="tokens per row")
    p.add_argument("--runs", type=int, default=20, help="runs per figure")
    p.add_argument("--switch_interval_ms", type=float, default=5.0, help="the interpreter's "
                   "switch interval (sys.setswitchinterval; Python's default is 5 ms)")
    args = p.parse_args(argv)
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    print(f"machine: {machine()}", flush=True)
    print(f"model {args.model_dir}, {args.device}, {args.precision}, rows {args.rows}, length "
          f"{args.length}, runs {args.runs}, torch threads {args.threads}, switch interval "
          f"{args.switch_interval_ms:g} ms", flush=True)
    around = neighbours(args.model_dir)
    print(f"{'graph':8} {'neighbour':28} {'wall ms (median)':>17} {'engine CPU ms':>14}")
    for graph in TORCH_GRAPHS:
        engine = load_engine("pytorch", args.model_dir, device=args.device, threads=args.threads,
                             precision=args.precision, graph=graph)
        feeds = {name: np.ones((args.rows, args.length), dtype=np.int64)
                 for name in engine.input_names}
        timed_runs(engine, feeds, 3)  # warm
        measure = partial(timed_runs, engine, feeds, args.runs)
        for label, body in around.items():
            wall, cpu = beside(body, measure)
            print(f"{engine.graph:8} {label:28} {wall:17.2f} {cpu:14.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
