"""bench/gpu_check.sh's dry run on the CPU, the cost curve's schema, and the budget's cut-offs."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engines.cost_curve import (
    LENGTHS,
    ROWS,
    SCHEMA,
    VERSION,
    CostCurveError,
    Variant,
    load_cost_curve,
    parse_cost_curve,
    validate,
)
from engines import TORCH_GRAPHS

ROOT = Path(__file__).resolve().parent.parent


#: The dry run's grid: the smallest and largest rows (64: the row the printed table shows) and
#: two lengths, so that it measures every engine and layout without the GPU run's whole grid.
GRID_ROWS, GRID_LENGTHS = (ROWS[0], ROWS[-1]), LENGTHS[:2]


def test_the_dry_run_measures_every_cell_of_every_engine_and_every_server_layout(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # a budget that a slow machine's one-off stall cannot spend (the cut-offs: the tests below)
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--device", "cpu", "--model_dir", str(tiny_model_dir),
         "--workers", "2", "--executor_workers", "2", "--budget_s", "900",
         "--rows", ",".join(map(str, GRID_ROWS)), "--lengths", ",".join(map(str, GRID_LENGTHS)),
         "--out", str(tmp_path)], cwd=ROOT,
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    curve = load_cost_curve(tmp_path / "cost_curve.json")  # raises unless it follows the schema
    assert curve.data["rows"] == list(GRID_ROWS) and curve.data["lengths"] == list(GRID_LENGTHS)
    expected = [Variant("pytorch", "cpu", "fp32", graph) for graph in TORCH_GRAPHS] + \
        [Variant("onnx", "cpu", "fp32", None)]
    assert curve.variants() == expected
    assert curve.data["skipped"] == []
    assert set(curve.cells) == {(v, r, n) for v in expected for r in GRID_ROWS
                                for n in GRID_LENGTHS}
    assert all(c.wall_ms_median > 0 and c.host_cpu_ms >= 0 for c in curve.cells.values())
    assert curve.data["machine"]["gpu"] is None and curve.data["date"]

    check = json.loads((tmp_path / "gpu_check.json").read_text())
    assert check["cost_curve_problems"] == [] and check["elapsed_s"] < check["budget_s"]
    assert [s["step"] for s in check["steps"]] == ["setup", "model", "engine grid", "servers"]
    assert all(s["status"] == "ok" for s in check["steps"])
    # first what `python server.py` picks here with no flags (ONNX in one process, on a CPU),
    # then PyTorch's servers (onnxruntime here has no CUDA: its servers would tell nothing)
    servers = check["servers"]
    assert [(s["engine"], s["layout"]) for s in servers] == \
        [("default", "python server.py"), ("pytorch", "1 process"), ("pytorch", "--workers 2"),
         ("pytorch", "--workers 2 --executors on")]
    assert servers[0]["flags"] == [] and servers[0]["chosen"] == {
        "inference_engine_type": "onnx", "precision": "fp32", "pytorch_graph": "auto",
        "workers": 1, "executors": "off", "num_inference_sessions": 2}
    assert all("chosen" in server for server in servers), servers  # each one started
    assert servers[1]["chosen"]["inference_engine_type"] == "pytorch"
    for server in servers:
        assert server["one_client"]["p50_ms"] > 0 and not server["one_client"]["errors"]
        assert server["saturation"]["ok"] > 0 and not server["saturation"]["errors"]
        assert server["saturation"]["mean_batch"] >= 1
    executor = servers[3]["saturation"]  # the executor's own batches, rows from every worker
    assert executor["executor_batches"] > 0 and executor["executor_rows_per_batch"] >= 1
    assert 0 <= executor["executor_idle_share"] <= 1
    assert all(e["request_batch1"]["p50_ms"] > 0 for e in check["engines"])

    out = done.stdout
    for step in ("[model] ok", "[engine grid] ok", "[servers] ok"):
        assert step in out
    assert "| engine | device | precision | graph | rows | 64: wall / CPU ms |" in out
    for graph in TORCH_GRAPHS:
        assert f"| pytorch | cpu | fp32 | {graph} | 64 | " in out
    assert "| onnx | cpu | fp32 | - | 64 | " in out
    assert "| default: onnx fp32, 1 workers, executors off | - | python server.py | fp32 | " in out
    assert "  default: onnx fp32, 1 workers, executors off: p50 " in out
    assert "| pytorch | traced | --workers 2 | fp32 | " in out
    assert "| pytorch | traced | --workers 2 --executors on | fp32 | " in out
    assert "rows on the device)" in out


def _curve() -> dict[str, Any]:
    cells = [{"engine": "pytorch", "device": "cuda:0", "precision": "fp16", "graph": "traced",
              "rows": r, "length": n, "runs": 5, "wall_ms": {"median": r * n / 1e3,
                                                              "p90": r * n / 900},
              "host_cpu_ms": 0.5} for r in (1, 2) for n in (64, 128)]
    return {"schema": SCHEMA, "version": VERSION, "machine": {"gpu": "X"}, "date": "d",
            "commit": "c", "model": {"name": "m", "dir": "d"}, "rows": [1, 2],
            "lengths": [64, 128], "cells": cells[:3],
            "skipped": [{**cells[3], "why": "the check's time ran short"}]}


def test_the_cost_curve_pads_a_batch_up_to_the_next_measured_shape() -> None:
    curve = parse_cost_curve(_curve())
    traced = Variant("pytorch", "cuda:0", "fp16", "traced")
    assert curve.variants() == [traced]
    assert curve.lookup(traced, 1, 100).wall_ms_median == pytest.approx(0.128)
    assert curve.lookup(traced, 2, 64).rows == 2
    for rows, length in ((2, 100), (3, 64), (1, 129)):  # skipped, or beyond the grid
        with pytest.raises(KeyError):
            curve.lookup(traced, rows, length)


def test_the_validator_names_every_way_a_file_breaks_the_schema(tmp_path: Path) -> None:
    assert validate(_curve()) == []
    broken = copy.deepcopy(_curve())
    broken["skipped"] = []  # 2 x 128 neither measured nor skipped
    broken["cells"][1]["wall_ms"]["p90"] = 0.0  # below the median
    broken["cells"].append(copy.deepcopy(broken["cells"][0]))  # twice
    problems = validate(broken)
    assert len(problems) == 3, problems
    assert "neither measured nor skipped" in problems[-1] and "(2, 128)" in problems[-1]
    assert any("appears twice" in p for p in problems)
    assert validate({**_curve(), "version": 2})[0].startswith("file: schema")
    assert "cells missing" in validate({**_curve(), "cells": None})[0]
    (tmp_path / "c.json").write_text("{")
    with pytest.raises(CostCurveError, match="not JSON"):
        load_cost_curve(tmp_path / "c.json")


def test_cells_that_would_end_past_the_deadline_are_skipped_and_said(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from bench.engine_grid import Grid, measure
    from engines import load_engine

    engine = load_engine("zero", tiny_model_dir)
    args = argparse.Namespace(rows=[1, 64], lengths=[64, 384, 512], warmup=1, runs=2, min_runs=2,
                              cell_s=0.0, deadline=float("inf"))
    grid = Grid(tmp_path / "part.json", {"engine": "zero", "device": "cpu", "precision": "fp32",
                                         "graph": None})
    measure(engine, grid, args, max_len=384, vocab=30522)
    written = json.loads((tmp_path / "part.json").read_text())
    assert [(c["rows"], c["length"]) for c in written["cells"]] == \
        [(1, 64), (1, 384), (64, 64), (64, 384)]
    assert [(s["rows"], s["length"], s["why"]) for s in written["skipped"]] == \
        [(1, 512, "the model serves at most 384 tokens per row"),
         (64, 512, "the model serves at most 384 tokens per row")]

    args.deadline = time.time() - 1  # the time is up: nothing more is started
    grid = Grid(tmp_path / "late.json", grid.variant)
    measure(engine, grid, args, max_len=512, vocab=30522)
    late = json.loads((tmp_path / "late.json").read_text())
    assert late["cells"] == [] and len(late["skipped"]) == 6
    assert all(s["why"].startswith("the check's time ran short") for s in late["skipped"])


def test_on_a_gpu_the_check_runs_the_executor_without_its_overlap_beside_it(
        tiny_model_dir: Path) -> None:
    from bench.gpu_check import parse_args, server_plan

    args = parse_args(["--device", "cuda", "--model_dir", str(tiny_model_dir)])
    plan = [(engine, layout) for engine, _, layout, _ in server_plan(args)]
    executor = f"--workers {args.executor_workers[0]} --executors on"
    assert plan.index(("pytorch", f"{executor} --executor_overlap off")) == \
        plan.index(("pytorch", executor)) + len(args.executor_workers)
    assert all("--executor_overlap" not in layout
               for _, _, layout, _ in server_plan(parse_args(["--device", "cpu"])))


def test_no_server_starts_once_the_budget_is_spent(tiny_model_dir: Path) -> None:
    from bench.gpu_check import measure_servers, parse_args
    from bench.gpu_check_report import Budget

    args = parse_args(["--device", "cpu", "--model_dir", str(tiny_model_dir), "--workers", "2"])
    rows = measure_servers(args, str(tiny_model_dir), Budget(time.time() - 100, 110.0))
    assert [(r["engine"], r["layout"]) for r in rows] == \
        [("default", "python server.py"), ("pytorch", "1 process"), ("pytorch", "--workers 2"),
         ("pytorch", "--workers 2 --executors on"), ("pytorch", "--workers 4 --executors on")]
    assert all(r["skipped"].startswith("the check's time ran short") for r in rows)


def test_the_rounds_dry_run_gives_each_round_and_the_medians_of_its_figures(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu_rounds.py", "--device", "cpu", "--precision", "fp32",
         "--model_dir", str(tiny_model_dir), "--rounds", "2", "--clients", "2",
         "--sessions", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_rounds.json").read_text())
    assert len(record["rounds"]) == 2 and record["clients"] == 2
    for r in record["rounds"]:
        assert r["errors"] == 0 and r["alone_ms"] > 0 and r["p50_ms"] > 0
        assert r["over_alone_ms"] == pytest.approx(r["p50_ms"] - r["alone_ms"])
        assert r["clients_mean_batch"] >= 1 and r["saturated_rps"] > 0
    for name, figure in record["summary"].items():
        values = [r[name] for r in record["rounds"]]
        assert figure["low"] == min(values) and figure["high"] == max(values)
        assert figure["median"] == pytest.approx(sum(values) / 2)


def test_the_layouts_dry_run_gives_every_layouts_rounds_against_the_curves_capacity(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu_layouts.py", "--device", "cpu", "--model_dir",
         str(tiny_model_dir), "--cost_curve", "engines/data/cost_curve_h200.json",
         "--rounds", "2", "--sessions", "1", "--out", str(tmp_path), "--layouts",
         "one=--workers 1", "executor=--workers 2 --executors on"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_layouts.json").read_text())
    assert record["ceilings"]["capacity_rps"] > 0
    assert [(r["round"], r["layout"]) for r in record["rows"]] == \
        [(1, "one"), (1, "executor"), (2, "executor"), (2, "one")]  # alternating
    for row in record["rows"]:
        assert row["errors"] == 0 and row["throughput_rps"] > 0 and row["p50_ms"] > 0
        assert row["of_capacity"] == pytest.approx(
            row["throughput_rps"] / record["ceilings"]["capacity_rps"])
    assert all(r["executor_rows_per_batch"] >= 1 for r in record["rows"]
               if r["layout"] == "executor")
    assert "executor_batches" not in record["rows"][0]
    assert set(record["summary"]) == {"one", "executor"}
    assert "| executor | " in done.stdout


def test_the_check_prepares_its_model_outside_the_repository_the_server_serves(
        tmp_path: Path) -> None:
    from bench.gpu_check import BENCH_MODELS, parse_args, prepare_model
    from bench.gpu_check_report import Budget

    served = sorted(p.name for p in (ROOT / "saved_models").iterdir())
    args = parse_args(["--device", "cpu"])  # the dry run, no --model_dir: it prepares one
    folder, how = prepare_model(args, Budget(time.time(), 300.0), into=tmp_path)
    assert Path(folder) == tmp_path / "gpu-check-tiny" and how.startswith("prepared"), how
    assert (Path(folder) / "serving.json").is_file()
    assert prepare_model(args, Budget(time.time(), 300.0), into=tmp_path)[1] == "already there"
    assert sorted(p.name for p in (ROOT / "saved_models").iterdir()) == served
    assert BENCH_MODELS.relative_to(ROOT).parts == ("bench", "models")  # ignored by git
    assert "bench/models/" in (ROOT / ".gitignore").read_text().splitlines()
