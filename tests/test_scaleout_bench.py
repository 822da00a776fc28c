"""bench/scaleout.py end to end on the tiny model: a real redis-server, front ends, workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_scaleout_benchmark_measures_the_hop_and_both_worker_counts(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "scaleout.json"
    result = subprocess.run([sys.executable, "bench/scaleout.py", "--model_dir",
                             str(tiny_model_dir), "--quick", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    # --quick: 2 independent sets per engine, 30 requests to each layout of each set
    latency = figures["latency"]
    assert sorted((r["engine"], r["set"]) for r in latency) == [
        ("onnx", 1), ("onnx", 2), ("zero", 1), ("zero", 2)]
    assert all(len(r["ms"]["in-process"]) == len(r["ms"]["redis"]) == 30 and not r["errors"]
               and min(r["ms"]["in-process"] + r["ms"]["redis"]) > 0 for r in latency)
    assert [r["workers"] for r in figures["scaling"]] == [1, 2, 1, 2]
    assert all(r["rps"] > 0 and r["front_end_cpu_us"] > 0 and not r["errors"]
               for r in figures["scaling"])
    assert len(figures["raw"]) == 2 and "2 workers / 1 worker" in figures["report"]
    assert figures["cpu"]["rps"] > 0 and all(us > 0 for us in figures["cpu"]["cpu_us"].values())
