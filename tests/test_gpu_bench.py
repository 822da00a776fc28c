"""bench/gpu.py's dry run on the CPU: every step of the GPU benchmark, small."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from preparation.fp16 import export_fp16

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmark_dry_run_measures_and_reports_everything(tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    export_fp16(model)
    out, png = tmp_path / "gpu.json", tmp_path / "gpu.png"
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--model_dir", str(model), "--device", "cpu",
         "--engines", "onnx,pytorch", "--batch_sizes", "1,2", "--concurrency", "1,64",
         "--seconds", "0.5", "--sessions", "1", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    raw = {(r["engine"], r["precision"], r["batch_size"]) for r in figures["raw"]}
    # PyTorch has no fp16 on the CPU: skipped, and said
    assert raw == {(e, p, b) for e, p in [("onnx", "fp32"), ("onnx", "fp16"),
                                          ("pytorch", "fp32")] for b in (1, 2)}
    assert "raw pytorch fp16: not run on cpu" in done.stdout
    server = figures["server"]
    assert {(r["engine"], r["batching"], r["concurrency"]) for r in server} == \
        {(e, m, c) for e in ("onnx", "pytorch") for m in ("auto", "off") for c in (1, 64)}
    assert all(r["ok"] > 0 and not r["errors"] for r in server)
    assert {(r["engine"], r["precision"]) for r in server} == {("onnx", "fp16"),
                                                              ("pytorch", "fp32")}
    assert figures["machine"]["gpus"] == 0 and not any("gpu_util_pct" in r for r in server)
    for target in ("server / best raw batch", "auto / off at 64 clients", "fp16 / fp32, raw"):
        assert f"| onnx | {target} | " in done.stdout
    assert "| onnx | GPU utilisation at saturation, % | not measured |" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layouts_spread_workers_over_every_gpu_and_report_against_one() -> None:
    from bench.gpu import layouts
    from bench.gpu_report import layouts_table

    assert layouts(0) == {"1 worker": ["--workers", "1"]}
    assert layouts(2) == {"1 worker": ["--workers", "1"],
                          "2 workers": ["--workers", "2", "--cuda_devices", "0,1"]}
    assert layouts(1, [1, 2]) == {"1 worker": ["--workers", "1"], "2 workers": ["--workers", "2"]}
    rows = [{"engine": "onnx", "batching": b, "layout": lay, "throughput_rps": rps}
            for b, lay, rps in [("auto", "1 worker", 100.0), ("auto", "1 worker", 150.0),
                                ("auto", "2 workers", 270.0), ("off", "2 workers", 900.0)]]
    table = layouts_table(rows)
    assert "| onnx | 1 worker | 150.0 | 1.00 |" in table
    assert "| onnx | 2 workers | 270.0 | 1.80 |" in table


def test_the_pipelined_load_runs_every_layout_without_latency_figures(tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    out, png = tmp_path / "gpu.json", tmp_path / "gpu.png"
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--model_dir", str(tiny_model_dir), "--device", "cpu",
         "--engines", "onnx", "--precisions", "fp32", "--batch_sizes", "1", "--modes", "auto",
         "--workers", "1,2", "--load", "pipelined", "--pipeline", "4", "--concurrency", "3",
         "--seconds", "0.5", "--sessions", "1", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    server = json.loads(out.read_text())["server"]
    assert [(r["layout"], r["load"], r["concurrency"]) for r in server] == \
        [("1 worker", "pipelined", 3), ("2 workers", "pipelined", 3)]
    assert all(r["ok"] > 0 and r["errors"] == 0 and r["p50_ms"] is None for r in server)
    assert "| onnx | 2 workers | auto | 3 | " in done.stdout and " | - | - | " in done.stdout
