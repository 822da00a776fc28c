"""The GPU check's bookkeeping and report: its time budget, each step timed and said, what it
ran on, and the tables it prints.

``OUT/gpu_check.json`` (``CHECK_SCHEMA``, version 1) holds ``machine``, ``argv``, ``budget_s``,
``elapsed_s``, ``model`` (name, dir, how it was had, its fp16 check), ``steps`` (each with
``elapsed_s`` and ``status``), ``cost_curve`` (the file beside it, engines/cost_curve.py's schema)
with ``cost_curve_problems`` (empty when it follows the schema), ``engines`` (each variant's
description, load time and ``request_batch1``: one request of the mix through the whole task
at batch 1) and ``servers`` (per engine and layout: ``one_client`` p50/p90, ``saturation``
requests/s, mean batch and NVML figures, ``chosen``: the engine and layout it ran; or
``skipped``/``failed`` with why; the first, engine ``default``, is ``python server.py`` with no
engine or layout flag, and ``chosen`` says what it picked).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from engines.cost_curve import Variant

CHECK_SCHEMA = "qa-server/gpu-check"
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@dataclass(frozen=True)
class Budget:
    """The check's time: ``total_s`` seconds from ``started`` (a Unix time)."""

    started: float
    total_s: float

    def deadline(self) -> float:
        """The Unix time by which every step must be done."""
        return self.started + self.total_s

    def left(self) -> float:
        """Seconds left (negative once past)."""
        return self.deadline() - time.time()


def run_step(name: str, steps: list[dict[str, Any]], body: Callable[[], T]) -> T | None:
    """Run one step, say when it starts and how long it took, and record it in ``steps``; a
    step that raises is recorded as failed (said, with its traceback's end) and gives None."""
    print(f"\n[{name}]", flush=True)
    started = time.perf_counter()
    try:
        result: T | None = body()
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - the check goes on, or says it cannot
        result, status = None, f"failed: {type(exc).__name__}: {exc}"
        print("".join(traceback.format_exc().splitlines(keepends=True)[-6:]), flush=True)
    elapsed = time.perf_counter() - started
    steps.append({"step": name, "elapsed_s": round(elapsed, 1), "status": status})
    print(f"[{name}] {status}, {elapsed:.1f} s", flush=True)
    return result


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def commit_of_tree(given: str | None) -> str:
    """``given``, else git's HEAD (``-dirty`` with tracked changes), else ``unknown`` (a copy
    of the tree without its repository: pass ``--commit``)."""
    if given:
        return given
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def machine_info(commit: str | None) -> dict[str, Any]:
    """What the check runs on, read without importing torch (no CUDA context here)."""
    from bench.nvml import gpu_names
    from tasks.qa_answers import span_search

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "") if cpuinfo.is_file() else ""
    names = gpu_names()
    return {"gpu": names[0] if names else None, "gpus": len(names),
            "cpu": cpu or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": _version("torch"),
            "onnxruntime": _version("onnxruntime", "onnxruntime-gpu"),
            "transformers": _version("transformers"), "tokenizers": _version("tokenizers"),
            "numpy": _version("numpy"), "qa_span_search": span_search(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit_of_tree(commit)}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def one_line(why: str, width: int = 300) -> str:
    """A reason on one table line: its first line and, where it has more, its last (a
    server's log line that says why it stopped), less the log line's time stamp."""
    lines = [line.strip() for line in why.splitlines() if line.strip()] or [""]
    last = re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ ", "", lines[-1])
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {last}"
    return text if len(text) <= width else text[:width - 3] + "..."


def grid_table(curve: dict[str, Any], engines: list[dict[str, Any]]) -> str:
    """One table of the cost curve: per variant (in the order ``engines`` ran) and rows, each
    length's median wall ms and host CPU ms per run; ``-`` where skipped (the reasons follow
    the table)."""
    lengths = curve["lengths"]
    cells = {(Variant.of(c), c["rows"], c["length"]): c for c in curve["cells"]}
    variants = list(dict.fromkeys(Variant.of(c) for c in
                                  engines + curve["cells"] + curve["skipped"]))
    lines = ["| engine | device | precision | graph | rows | " +
             " | ".join(f"{n}: wall / CPU ms" for n in lengths) + " |",
             "|---|---|---|---|---:|" + "---:|" * len(lengths)]
    for variant in variants:
        for rows in curve["rows"]:
            figures = [cells.get((variant, rows, n)) for n in lengths]
            lines.append(f"| {variant.engine} | {variant.device} | {variant.precision} | "
                         f"{variant.graph or '-'} | {rows} | " + " | ".join(
                             f"{c['wall_ms']['median']:.2f} / {c['host_cpu_ms']:.2f}" if c else "-"
                             for c in figures) + " |")
    whys = sorted({f"{Variant.of(s).label()}: {one_line(s['why'])}" for s in curve["skipped"]})
    return "\n".join(lines + [f"skipped, {why}" for why in whys])


def server_table(check: dict[str, Any]) -> str:
    """One row per server: p50 at 1 client against one request alone at batch 1, requests/s
    and mean batch at saturation (the executors' rows per batch beside it), NVML's figures
    during it."""
    alone = {(e["engine"], e.get("graph_asked")): (e.get("request_batch1") or {}).get("p50_ms")
             for e in check["engines"]}
    lines = ["| engine | graph | layout | precision | p50 at 1 client, ms | one request alone "
             "at batch 1, ms | req/s saturated | mean batch | GPU util % | GPU MiB | GPU W |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in check["servers"]:
        engine = picked(row) if row.get("chosen") and row["engine"] == "default" else \
            row["engine"]
        head = f"| {engine} | {row.get('graph') or '-'} | {row['layout']} |"
        if "saturation" not in row:
            lines.append(f"{head} {one_line(row.get('skipped') or row.get('failed') or '')} |")
            continue
        sat = row["saturation"]
        nvml = [f"{sat[k]:.0f}" if k in sat else "-"
                for k in ("gpu_util_pct", "gpu_memory_mib", "gpu_power_w")]
        lines.append(f"{head} {row['precision']} | {_ms(row['one_client']['p50_ms'])} | "
                     f"{_ms(alone.get((row['engine'], row.get('graph'))))} | "
                     f"{sat['throughput_rps']:.1f} | {_batch(sat)} | " + " | ".join(nvml) + " |")
    return "\n".join(lines)


def picked(row: dict[str, Any]) -> str:
    """What the default server chose, in words: ``default: pytorch fp16, 4 workers, executors
    on``."""
    chosen = row.get("chosen") or {}
    return (f"default: {chosen.get('inference_engine_type')} {chosen.get('precision')}, "
            f"{chosen.get('workers')} workers, executors {chosen.get('executors')}")


def _batch(sat: dict[str, Any]) -> str:
    """The mean batch of the sessions, and where executors run the device, the mean rows
    of the executors' batches."""
    mean = f"{sat['mean_batch']:.2f}"
    if "executor_rows_per_batch" in sat:
        mean += f" ({sat['executor_rows_per_batch']:.1f} rows on the device)"
    return mean


def print_report(check: dict[str, Any], curve: dict[str, Any]) -> None:
    """The check's table: steps, the engine alone (the cost curve), the servers."""
    machine = check["machine"]
    print(f"\n## GPU check: {machine['gpu'] or 'no GPU'}, {machine['date']}, commit "
          f"{machine['commit']}, model {check['model']['name']} ({check['model']['how']})")
    print("steps: " + "; ".join(f"{s['step']} {s['elapsed_s']:.0f} s ({s['status']})"
                                for s in check["steps"])
          + f"; total {check['elapsed_s']:.0f} s of {check['budget_s']:.0f}")
    for problem in check["cost_curve_problems"]:
        print(f"cost curve problem: {problem}")
    print("\n### The engine alone, per run (median wall ms / host CPU ms)\n")
    print(grid_table(curve, check["engines"]))
    print("\n### The server (p50: closed loop, 1 client; saturation: lean pipelined load)\n")
    print(server_table(check), flush=True)
