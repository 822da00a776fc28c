"""bench/frontend.py: the server's CPU per request against the tokenizer floor, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.frontend import process_tree_cpu_s, tokenizer_floor_us
from stress_test import load_pairs
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
         "1", "--connections", "2", "--pipeline", "4", "--processes", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "x floor" in done.stdout
    result = json.loads(out.read_text())
    assert [row["workers"] for row in result["server"]] == [1, 2]  # in-process, then 2 workers
    assert result["tokenizer_floor_us"] > 0
    for row in result["server"]:
        assert row["errors"] in ({}, None)
        assert row["requests"] > 0 and row["cpu_us_per_request"] > 0
    assert "scaling: 2 workers" in done.stdout
