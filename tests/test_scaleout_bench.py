"""bench/scaleout.py end to end on tiny qa and embed models: a real redis-server, front ends,
workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_scaleout_benchmark_measures_the_hop_and_both_worker_counts_of_qa_and_embed(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.text_models import build_tiny_embed_dir

    repository, out = tmp_path / "models", tmp_path / "scaleout.json"
    shutil.copytree(tiny_model_dir, repository / "qa")
    build_tiny_embed_dir(repository / "embed")
    result = subprocess.run([sys.executable, "bench/scaleout.py", "--model_dir",
                             str(repository), "--quick", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    # --quick: 2 independent sets per engine, 30 requests to each layout of each set
    latency = figures["latency"]
    assert sorted((r["task"], r["engine"], r["set"]) for r in latency) == [
        ("embed", "onnx", 1), ("embed", "onnx", 2),
        ("qa", "onnx", 1), ("qa", "onnx", 2), ("qa", "zero", 1), ("qa", "zero", 2)]
    assert all(len(r["ms"]["in-process"]) == len(r["ms"]["redis"]) == 30 and not r["errors"]
               and min(r["ms"]["in-process"] + r["ms"]["redis"]) > 0 for r in latency)
    assert [(r["task"], r["workers"]) for r in figures["scaling"]] == [
        *(("qa", n) for n in (1, 2, 1, 2)), *(("embed", n) for n in (1, 2, 1, 2))]
    assert all(r["rps"] > 0 and r["front_end_cpu_us"] > 0 and not r["errors"]
               for r in figures["scaling"])
    assert sorted(r["task"] for r in figures["raw"]) == ["embed", "embed", "qa", "qa"]
    for task in ("qa", "embed"):
        assert f"{task}: 2 workers / 1 worker" in figures["report"]
    assert figures["cpu"]["rps"] > 0 and all(us > 0 for us in figures["cpu"]["cpu_us"].values())
