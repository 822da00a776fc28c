"""stress_test.py against a real in-process server: closed and open loop, sweeps, reports."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from bench.figures import percentile, server_breakdown
from bench.loadgen import (
    OpenSpec,
    Recorder,
    _OpenTracker,
    _send_on_schedule,
    poisson_offsets,
)
from bench.mix import DEFAULT_DATA, load_pairs
from bench.plots import build_figure
from bench.runs import DEFAULT_LEVEL_SECONDS, run_closed_loop, run_open_loop, run_sweep
from client import Client
from engines import load_engine
from engines.base import Engine
from server import InferenceServer, ServerConfig
from stress_test import build_parser, parse_args
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
PAIRS = [("Who went home?", "Bob went home after the match."),
         ("Where is the tower?", "The old tower stands in Paris, on the left bank of the river.")]


class SlowEngine(Engine):
    """The real engine, made slower by a fixed sleep per batch (a busy server on demand)."""

    def __init__(self, inner: Engine, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name, self.device, self.input_names = inner.name, inner.device, inner.input_names

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.delay_s)
        return self.inner.run(feeds)

    def close(self) -> None:
        self.inner.close()


def _config(model_dir: Path, **options: Any) -> ServerConfig:
    return ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                        threads_per_session=1, **options)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    with InferenceServer(_config(tiny_model_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    """About 25 batches/s at most: 40 ms per batch, one request per batch."""
    def factory() -> Engine:
        return SlowEngine(load_engine("onnx", tiny_model_dir, threads=1), 0.04)

    # batching off: a fixed cost per batch is what auto batching would (rightly) amortise
    with InferenceServer(_config(tiny_model_dir, batching="off"), engine_factory=factory) as srv:
        yield srv


def run_cli(srv: InferenceServer | None, *args: str, port: int | None = None
            ) -> subprocess.CompletedProcess[str]:
    host, port = srv.address if srv is not None else ("127.0.0.1", port)
    return subprocess.run([sys.executable, "stress_test.py", "--host", host, "--port", str(port),
                           "--no_progress", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _ordered(result: dict[str, Any]) -> bool:
    return (result["p50_ms"] <= result["p90_ms"] <= result["p95_ms"] <= result["p99_ms"]
            <= result["max_ms"])


# -- the request mix ---------------------------------------------------------------------------
def test_shipped_mix_has_short_and_multi_window_pairs_whose_answers_are_in_the_context() -> None:
    pairs = load_pairs()
    records = [json.loads(line) for line in DEFAULT_DATA.read_text("utf-8").splitlines()]
    assert 40 <= len(pairs) <= 60 and len(records) == len(pairs)
    assert all(r["answer"] and r["answer"] in r["context"] for r in records)
    words = sorted(len(context.split()) for _, context in pairs)
    assert words[0] < 20 and words[-1] > 400
    assert sum(w > 350 for w in words) >= 10  # longer than one 384-token window


def test_load_pairs_reads_json_lines_and_json_lists_and_names_a_bad_line(tmp_path: Path) -> None:
    lines = tmp_path / "pairs.jsonl"
    lines.write_text('{"question": "Q1?", "context": "C1."}\n\n{"question": "Q2?", "context": '
                     '"C2.", "id": 7}\n', encoding="utf-8")
    listed = tmp_path / "pairs.json"
    listed.write_text(json.dumps([{"question": "Q?", "context": "C."}]), encoding="utf-8")
    assert load_pairs(lines) == [("Q1?", "C1."), ("Q2?", "C2.")]
    assert load_pairs(str(listed)) == [("Q?", "C.")]
    lines.write_text('{"question": "Q1?", "context": "C1."}\n{"question": "Q2?"}\n')
    with pytest.raises(ValueError, match="line 2.*context"):
        load_pairs(lines)


# -- pure figures ------------------------------------------------------------------------------
def test_percentile_is_nearest_rank() -> None:
    values = [float(n) for n in range(1, 101)]
    assert [percentile(values, q) for q in (0, 50, 90, 99, 100)] == [1.0, 50.0, 90.0, 99.0, 100.0]
    assert percentile([5.0], 99) == 5.0


def test_poisson_schedule_has_the_asked_rate_and_stops_at_either_limit() -> None:
    offsets = poisson_offsets(100.0, 50.0, None, random.Random(1))
    assert abs(len(offsets) - 5000) < 4 * 5000 ** 0.5  # ± 4 standard deviations
    assert offsets == sorted(offsets) and offsets[-1] < 50.0
    assert len(poisson_offsets(100.0, float("inf"), 37, random.Random(2))) == 37
    with pytest.raises(ValueError):
        poisson_offsets(100.0, float("inf"), None, random.Random(3))


def test_server_breakdown_differences_counters_and_derives_exact_means() -> None:
    def snapshot(admitted: int, batches: int, hist: dict[str, int], count: int,
                 mean: float) -> dict[str, Any]:
        timing = {"count": count, "mean_ms": mean, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}
        return {"requests": {"qa": {"ok": admitted}}, "admitted": admitted, "in_flight": 0,
                "batches": batches, "batch_size_histogram": hist, "batch_rows": batches,
                "queue_time": timing, "engine_time": timing, "request_time": timing,
                "connections_total": 1, "config": {"num_inference_sessions": 3}}

    before = snapshot(10, 10, {"1": 10}, 10, 5.0)  # 10 requests, 50 ms in all
    after = snapshot(30, 15, {"1": 12, "4": 3}, 30, 10.0)  # 30 requests, 300 ms in all
    out = server_breakdown(before, after)
    assert out["sessions"] == 3 and out["admitted"] == 20 and out["requests"] == {"qa": {"ok": 20}}
    assert out["batch_size_histogram"] == {"1": 2, "4": 3} and out["mean_batch_size"] == 14 / 5
    assert out["queue_time"]["count"] == 20 and out["queue_time"]["mean_ms"] == pytest.approx(12.5)
    assert server_breakdown(None, after) == {}


# -- closed loop -------------------------------------------------------------------------------
def test_cli_closed_loop_counts_every_request_with_percentiles_and_the_server_breakdown(
        server: InferenceServer, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = run_cli(server, "--num_simultaneous_clients", "2", "--num_total_clients", "5",
                   "--num_request_per_client", "4", "--pipeline", "4", "--warmup", "3",
                   "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "requests: 20   ok: 20   errors: none" in done.stdout
    assert "p99" in done.stdout and "requests/s" in done.stdout
    assert "server: 1 sessions" in done.stdout and "queue" in done.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["settings"]["pipeline"] == 4 and run["settings"]["total_clients"] == 5
    assert run["requests"] == run["ok"] == 20 and _ordered(run)
    server_side = run["server"]
    assert server_side["admitted"] == 20 and server_side["requests"]["qa"] == {"ok": 20}
    assert server_side["connections_opened"] == 5  # one connection per client, warm-up excluded
    assert server_side["request_time"]["count"] == 20


def test_pipelined_clients_keep_several_requests_queued_at_the_server(
        slow_server: InferenceServer) -> None:
    host, port = slow_server.address
    result = run_closed_loop(host, port, clients=1, requests_per_client=12, pairs=PAIRS,
                             pipeline=4, processes=1, progress=False)
    assert result["requests"] == result["ok"] == 12 and _ordered(result)
    server_side = result["server"]
    # with 4 in flight and one request per batch, each request waits behind the others
    assert server_side["queue_time"]["mean_ms"] > 1.5 * server_side["engine_time"]["mean_ms"]
    assert result["mean_ms"] >= server_side["request_time"]["mean_ms"]


# -- open loop ---------------------------------------------------------------------------------
def test_open_loop_sends_about_rate_times_duration_and_times_from_the_schedule(
        server: InferenceServer) -> None:
    host, port = server.address
    result = run_open_loop(host, port, rate=40.0, duration_s=1.5, pairs=PAIRS, connections=3,
                           processes=2, warmup=2, progress=False)
    assert 30 <= result["requests"] <= 95  # 60 expected; ± 4 standard deviations
    assert result["ok"] == result["requests"] and result["server"]["admitted"] == result["ok"]
    assert result["settings"]["mode"] == "open" and result["send_lag"]["max_ms"] >= 0
    assert result["mean_ms"] >= result["server"]["request_time"]["mean_ms"]


def test_open_loop_latency_counts_from_the_scheduled_time_not_the_actual_send(
        server: InferenceServer) -> None:
    host, port = server.address
    spec = OpenSpec(host, port, tuple(PAIRS), connections=1, rate=10.0, duration_s=1.0, count=None,
                    seed=0, first_pair=0, timeout_s=30.0)
    recorder = Recorder()
    tracker = _OpenTracker(recorder, spec.timeout_s)
    with Client(host, port) as client:
        a_second_ago = time.perf_counter() - 1.0  # a sender that fell one second behind
        _send_on_schedule(spec, [client], [0.0, 0.1, 0.2], a_second_ago, tracker, recorder)
        tracker.wait([client])
    assert len(recorder.latencies) == 3 and not recorder.errors
    assert min(recorder.lags) >= 0.8 and min(recorder.latencies) >= 0.8


def test_cli_open_loop_without_a_duration_sends_exactly_the_request_count(
        server: InferenceServer) -> None:
    done = run_cli(server, "--rate", "50", "--num_total_clients", "3",
                   "--num_request_per_client", "5", "--warmup", "0")
    assert done.returncode == 0, done.stderr
    assert "for 15 requests" in done.stdout and "requests: 15   ok: 15" in done.stdout


def test_open_loop_latency_grows_when_arrivals_outpace_the_server(
        slow_server: InferenceServer) -> None:
    host, port = slow_server.address
    result = run_open_loop(host, port, rate=75.0, duration_s=1.0, pairs=PAIRS, connections=2,
                           processes=1, progress=False)
    engine_ms = result["server"]["engine_time"]["mean_ms"]
    assert result["ok"] == result["requests"] > 30
    # three times the server's capacity: the queue, and latency from the schedule, keep growing
    assert result["p90_ms"] > 10 * engine_ms


def test_cli_open_loop_with_a_user_data_file_draws_a_single_run_plot(
        server: InferenceServer, tmp_path: Path) -> None:
    data, out, png = tmp_path / "mine.json", tmp_path / "run.json", tmp_path / "run.png"
    data.write_text(json.dumps([{"question": q, "context": c} for q, c in PAIRS]))
    done = run_cli(server, "--rate", "30", "--duration", "1", "--data", str(data),
                   "--json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert "open loop: Poisson arrivals at 30 requests/s" in done.stdout
    assert "send lag" in done.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["settings"]["pairs"] == 2 and run["requests"] == run["ok"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- sweeps, errors, unreachable ---------------------------------------------------------------
def test_sweep_prints_three_tables_with_the_sessions_row_and_saves_every_run(
        server: InferenceServer, tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    done = run_cli(server, "--sweep", "1,2", "--num_total_clients", "2",
                   "--num_request_per_client", "3", "--warmup", "2", "--json", str(out),
                   "--plot", str(png))
    assert done.returncode == 0, done.stderr
    tables = done.stdout[done.stdout.index("latency mean ± std (ms)"):]
    assert "latency p99 (ms)" in tables and "throughput (requests/s)" in tables
    assert tables.count("sessions \\ clients |") == 3
    rows = [line for line in tables.splitlines() if line.lstrip().startswith("1 |")]
    assert len(rows) == 3 and all(len(row.split("|")) == 3 for row in rows)
    assert " ± " in rows[0]
    runs = json.loads(out.read_text())["runs"]
    assert [r["settings"]["clients"] for r in runs] == [1, 2]
    assert all(r["requests"] == r["ok"] == 6 and r["server"]["sessions"] == 1 for r in runs)
    # 6 requests of the tiny model end each level long before its default time budget
    assert all(r["stopped_by"] == "count" and r["clients_run"] == 2 for r in runs)
    assert all(r["settings"]["budget_s"] == DEFAULT_LEVEL_SECONDS for r in runs)
    assert "budget after" not in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_level_stops_at_its_time_budget_and_counts_every_request_it_sent(
        slow_server: InferenceServer, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    # each level may send 2 x 100 requests (8 s at the slow server's 25 batches/s); 1 s budget
    done = run_cli(slow_server, "--sweep", "1,2", "--level_seconds", "1", "--pipeline", "3",
                   "--num_total_clients", "2", "--num_request_per_client", "100", "--warmup", "0",
                   "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("stopped by the 1 s budget after") == 2
    runs = json.loads(out.read_text())["runs"]
    for run in runs:
        assert run["settings"]["budget_s"] == 1.0 and run["stopped_by"] == "budget"
        assert 0 < run["requests"] < 200
        # every request sent, the ones in flight at the deadline included, was answered and
        # counted, and the server admitted exactly those
        assert run["ok"] == run["requests"] == run["server"]["admitted"]
        assert run["server"]["requests"]["qa"] == {"ok": run["requests"]}


def test_sweep_plot_has_log_clients_a_title_from_the_server_and_a_throughput_colour_of_its_own(
        server: InferenceServer) -> None:
    host, port = server.address
    runs = run_sweep(host, port, levels=[1, 3], requests_per_client=2, pairs=PAIRS, processes=1,
                     progress=False)
    fig = build_figure(runs)
    left, right = fig.axes
    assert left.get_xscale() == right.get_xscale() == "log"
    title = fig.get_suptitle()
    assert "onnx engine" in title and "1 session," in title
    assert "(tiny-random-bert-qa-0)" in title and runs[0]["started"][:10] in title
    percentiles = {line.get_label(): to_rgba(line.get_color()) for line in left.get_lines()}
    assert set(percentiles) == {"p50", "p90", "p99"} and len(set(percentiles.values())) == 3
    (throughput,) = right.get_lines()
    assert to_rgba(throughput.get_color()) not in percentiles.values()
    assert list(throughput.get_xdata()) == [1, 3]


def test_stress_test_help_shows_every_default_once_and_budget_needs_a_sweep() -> None:
    parser = build_parser()
    text = " ".join(parser.format_help().split())  # undo the line wrapping
    for expected in ("(default: 100)", "(default: 10)", "(default: 5)", "(default: 20)",
                     f"(default: {DEFAULT_LEVEL_SECONDS:g})", "(default: min(clients, cores))",
                     "(default: bench/data/qa_pairs.jsonl)"):
        assert expected in text
    assert "(default: None)" not in text and "(default: False)" not in text
    for action in parser._actions:
        assert action.help
        if action.dest not in ("help", "no_progress", "tls"):  # flags show no default
            assert text.count(f"{action.help.split(' (default')[0]} (default: ") == 1, action.dest
    with pytest.raises(SystemExit):
        parse_args(["--level_seconds", "5"])


def test_errors_are_counted_by_code_and_the_exit_status_is_1(
        server: InferenceServer, tmp_path: Path) -> None:
    data = tmp_path / "mixed.jsonl"
    too_long = "why " * 500  # more tokens than a 384-token window holds
    data.write_text("\n".join(json.dumps({"question": q, "context": c})
                              for q, c in [PAIRS[0], (too_long, "Some context.")]))
    done = run_cli(server, "--data", str(data), "--num_simultaneous_clients", "1",
                   "--num_total_clients", "2", "--num_request_per_client", "3", "--warmup", "0")
    assert done.returncode == 1, done.stderr
    assert "requests: 6   ok: 3   errors: bad_request 3" in done.stdout


def test_an_unreachable_server_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        done = run_cli(None, "--num_total_clients", "1", port=s.getsockname()[1])
    assert done.returncode == 2 and "cannot reach" in done.stderr


def test_a_server_that_dies_mid_run_still_gets_a_report_and_exit_status_1(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """load_testing.md: failures are counted (connection_lost, connect_failed), not thrown."""
    from tests.test_server_process import drain_log, start_server

    proc, (host, port), lines = start_server("--model_dir", str(tiny_model_dir),
                                             "--inference_engine_type", "zero",
                                             "--num_inference_sessions", "1")
    drain_log(proc, lines)
    out = tmp_path / "run.json"
    load = subprocess.Popen(
        [sys.executable, "stress_test.py", "--host", host, "--port", str(port), "--no_progress",
         "--num_total_clients", "4000", "--num_request_per_client", "50",
         "--num_simultaneous_clients", "2", "--warmup", "0", "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed once the load is under way: beside busy processes stress_test.py took more
        # than 3 s to start, and found the server gone
        with Client(host, port) as control:
            wait_until(lambda: control.stats(timeout=30)["admitted"] >= 20, 120)
        proc.kill()
        stdout, stderr = load.communicate(timeout=120)
    finally:
        proc.kill()
        load.kill()
    assert load.returncode == 1, stderr
    assert "errors:" in stdout and "ok:" in stdout, stdout
    saved = json.loads(out.read_text())
    assert saved, "no --json report"
