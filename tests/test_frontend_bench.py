"""bench/frontend.py: the server's CPU per request against the tokenizer floor, end to end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.frontend import process_tree_cpu_s, scaling_ratios, tokenizer_floor_us, variant
from bench.mix import load_pairs
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_process_tree_cpu_counts_the_children_too() -> None:
    # it spins 0.5 s for a check at 0.4 s: /proc counts whole clock ticks, rounded down, so a
    # spin of exactly 0.4 s by process_time() can read as 0.39 s there for ever
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\ntime.sleep(60)"])
    try:
        wait_until(lambda: process_tree_cpu_s(child.pid) >= 0.4)
        own = time.process_time()  # this process's CPU, threads included
        assert process_tree_cpu_s(os.getpid()) >= own + 0.4 - 0.05  # tick rounding
    finally:
        child.kill()
        child.wait()


def test_the_tokenizer_floor_is_a_positive_cost_per_pair(tiny_model_dir: Path) -> None:
    pairs = load_pairs()[:5]
    assert tokenizer_floor_us(str(tiny_model_dir), pairs, min_seconds=0.2) > 0


def test_the_benchmark_saturates_zero_engine_servers_and_reports_cpu_per_request(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    done = subprocess.run(
        [sys.executable, "bench/frontend.py", "--model_dir", str(tiny_model_dir), "--seconds",
         "1", "--connections", "2", "--pipeline", "4", "--processes", "1", "--rounds", "2",
         "--floor_seconds", "0.2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "x floor" in done.stdout
    result = json.loads(out.read_text())
    # in-process, then 2 workers; the second round the other way round
    assert [(row["round"], row["workers"]) for row in result["server"]] == [
        (1, 1), (1, 2), (2, 2), (2, 1)]
    assert result["tokenizer_floor_us"] > 0
    for row in result["server"]:
        assert row["errors"] in ({}, None)
        assert row["requests"] > 0 and row["cpu_us_per_request"] > 0 and row["floor_us"] > 0
        assert row["x_floor"] == row["cpu_us_per_request"] / row["floor_us"]
        assert 0 < row["server_cores"] <= (os.cpu_count() or 1) * 1.05  # CPU time over wall
    assert "scaling: 2 workers" in done.stdout and "median" in done.stdout


def test_scaling_ratios_pair_each_round_with_its_own_base() -> None:
    rows = [{"round": 1, "workers": 1, "throughput_rps": 100.0},
            {"round": 1, "workers": 2, "throughput_rps": 180.0},
            {"round": 2, "workers": 2, "throughput_rps": 150.0},
            {"round": 2, "workers": 1, "throughput_rps": 50.0}]
    assert scaling_ratios(rows) == {2: [1.8, 3.0]}


def test_variants_compare_server_flags_in_the_same_rounds(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    done = subprocess.run(
        [sys.executable, "bench/frontend.py", "--model_dir", str(tiny_model_dir), "--seconds",
         "1", "--connections", "2", "--pipeline", "4", "--processes", "1", "--workers", "1", "2",
         "--floor_seconds", "0.2", "--variants", "batch=--cpu_scheduling batch",
         "normal=--cpu_scheduling normal", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["server"]
    assert [(row["variant"], row["workers"]) for row in rows] == [
        ("batch", 1), ("batch", 2), ("normal", 1), ("normal", 2)]
    assert all(row["requests"] > 0 and row["errors"] in ({}, None) for row in rows)
    assert rows[3]["server_args"] == "--cpu_scheduling normal"
    for name in ("batch", "normal"):
        assert f"{name}, 2 workers: median" in done.stdout
        assert f"scaling ({name}): 2 workers" in done.stdout


def test_a_variant_needs_a_name_and_flags() -> None:
    assert variant("lean=--workers 2 --batching off") == ("lean", "--workers 2 --batching off")
    with pytest.raises(argparse.ArgumentTypeError):
        variant("--workers 2")


def _repository(root: Path, models: dict[str, tuple[Path, str]]) -> Path:
    """A model repository: each name a copy of a model folder's serving.json with that task
    (only the metadata is read), beside nothing else."""
    for name, (source, task) in models.items():
        folder = root / name
        folder.mkdir(parents=True)
        info = json.loads((source / "serving.json").read_text())
        (folder / "serving.json").write_text(json.dumps({**info, "task": task}))
    return root


def test_the_qa_benchmarks_take_a_repository_as_the_server_does(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    from bench.servers import qa_model_dir

    assert qa_model_dir(str(tiny_model_dir)) == str(tiny_model_dir)  # a model folder: itself
    repository = _repository(tmp_path / "models", {"embed": (tiny_model_dir, "embed"),
                                                   "reader": (tiny_model_dir, "qa")})
    assert qa_model_dir(str(repository)) == str(repository / "reader")
    without = _repository(tmp_path / "no_qa", {"embed": (tiny_model_dir, "embed")})
    with pytest.raises(ValueError, match="no qa model"):
        qa_model_dir(str(without))


def test_the_task_benchmark_runs_on_the_repository_prepare_model_writes(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    repository = tmp_path / "saved_models"
    repository.mkdir()
    (repository / "qa").symlink_to(tiny_model_dir)
    done = subprocess.run([sys.executable, "bench/qa_task.py", "--model_dir", str(repository),
                           "--seconds", "0.05", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "postprocess" in done.stdout and "floor" in done.stdout
