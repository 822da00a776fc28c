"""bench/transport.py: a Unix socket against TCP loopback on one zero-engine server, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.transport import percentile

ROOT = Path(__file__).resolve().parent.parent


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile([3.0], 0.99) == 3.0


def test_the_benchmark_measures_both_transports_on_one_server(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    done = subprocess.run(
        [sys.executable, "bench/transport.py", "--model_dir", str(tiny_model_dir), "--rounds",
         "2", "--requests", "20", "--seconds", "0.5", "--connections", "2", "--pipeline", "4",
         "--processes", "1", "--sessions", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Unix/TCP" in done.stdout and "errors: none" in done.stdout
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2
    assert list(result["rounds"][0]) == ["tcp", "unix"]  # the order alternates by round
    assert list(result["rounds"][1]) == ["unix", "tcp"]
    for name in ("tcp", "unix"):
        figures = result["summary"][name]
        assert 0 < figures["ping_p50_ms"] <= figures["ping_p99_ms"]
        assert 0 < figures["qa_p50_ms"] <= figures["qa_p99_ms"]
        assert figures["saturation_rps"] > 0
