"""--workers N: real worker processes behind one port, with real sockets and a tiny ONNX model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from protocol import BadRequest, DeadlineExceeded, encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tasks.qa_answers import span_search
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    RawConnection,
    Reference,
    assert_same_answer,
    freeze,
    wait_until,
)
from tests.test_server_process import drain_log, start_server

ROOT = Path(__file__).resolve().parent.parent


def worker_config(model_dir: Path, **overrides: object) -> ServerConfig:
    settings: dict[str, object] = dict(port=0, model_dir=str(model_dir), workers=2,
                                       num_inference_sessions=1, threads_per_session=1,
                                       max_batch_size=4)
    settings.update(overrides)
    return ServerConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    with InferenceServer(worker_config(tiny_model_dir, metrics_port=0)) as srv:
        yield srv


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_pipelined_connection_spreads_over_every_worker_with_unchanged_answers(
        served: InferenceServer, tiny_model_dir: Path) -> None:
    with Client(*served.address) as client:
        before = {w["worker"]: w["batch_rows"] for w in client.stats(timeout=30)["workers"]}
        total = 120
        futures = [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6] * (1 + i % 3))
                   for i in range(total)]
        answers = [future.result(timeout=60) for future in futures]
        stats = client.stats(timeout=30)
    reference = Reference(tiny_model_dir)
    for i in range(6):  # the workers' answers are the in-process task's
        assert answers[i] == reference.answer(QUESTIONS[i % 6], CONTEXTS[i % 6] * (1 + i % 3))
    rows = {w["worker"]: w["batch_rows"] - before[w["worker"]] for w in stats["workers"]}
    assert sorted(rows) == [0, 1] and all(n > 0 for n in rows.values()), rows
    assert all(w["state"] == "serving" and w["pid"] != os.getpid() for w in stats["workers"])
    assert stats["ready"] is True


def test_typed_errors_come_back_from_the_workers(served: InferenceServer) -> None:
    with Client(*served.address) as client:
        with pytest.raises(BadRequest, match="question is too long"):  # found by the tokenizer
            client.answer("a," * 400, CONTEXTS[0], timeout=30)
        with pytest.raises(DeadlineExceeded):
            client.submit(QUESTIONS[0], CONTEXTS[0] * 40, timeout_ms=0.001).result(timeout=30)
        assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["answer"]


def scrape(srv: InferenceServer) -> dict[tuple, float]:
    """{(sample name, labels...): value} of every /metrics sample."""
    assert srv.metrics_address is not None
    host, port = srv.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_stats_and_metrics_are_summed_over_workers_with_series_per_worker(
        served: InferenceServer) -> None:
    with Client(*served.address) as client:
        for future in [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(40)]:
            future.result(timeout=60)
        stats = client.stats(timeout=30)
    workers = stats["workers"]
    assert len(workers) == 2 and all(w["answered_stats"] for w in workers)
    assert stats["batches"] == sum(w["batches"] for w in workers) > 0
    assert stats["batch_rows"] == sum(w["batch_rows"] for w in workers)
    assert stats["engine_time"]["count"] == stats["batches"]
    run = sum(int(size) * n for size, n in stats["batch_size_histogram"].items())
    assert stats["queue_time"]["count"] == run >= stats["requests"]["qa"]["ok"]
    metrics = scrape(served)
    per_worker = {dict(key[1:])["worker"]: value for key, value in metrics.items()
                  if key[0] == "qa_server_worker_batches_total"}
    assert sorted(per_worker) == ["0", "1"]
    assert metrics[("qa_server_batches_total",)] == sum(per_worker.values()) >= stats["batches"]
    assert all(metrics[("qa_server_worker_up", ("device", w["device"]), ("model", w["model"]),
                        ("worker", str(w["worker"])))] == 1 for w in workers)
    assert metrics[("qa_server_device_batches_total", ("device", "cpu"))] == \
        metrics[("qa_server_batches_total",)]


def test_workers_tokenize_with_the_gil_released_only_beside_pytorch(
        served: InferenceServer, tiny_model_dir: Path) -> None:
    """A worker holds the GIL through its encodes beside ONNX Runtime (fewer hand-offs), but not
    beside PyTorch, which takes the GIL back more than once per run (the GIL convoy); PyTorch
    runs its traced graph by default."""
    with Client(*served.address) as client:
        engine = client.stats(timeout=30)["engine"]
    assert engine["encodes_release_gil"] is False
    assert engine["span_search"] == span_search()  # the worker's, as this checkout builds it
    config = worker_config(tiny_model_dir, inference_engine_type="pytorch", device="cpu")
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        answer = client.answer(QUESTIONS[0], CONTEXTS[0], timeout=60)
        stats = client.stats(timeout=30)
    assert_same_answer(answer, Reference(tiny_model_dir).answer(QUESTIONS[0], CONTEXTS[0]),
                       CONTEXTS[0])
    assert stats["engine"]["type"] == "pytorch" and stats["engine"]["encodes_release_gil"] is True
    assert "traced graph" in stats["engine"]["description"]


def test_a_worker_killed_under_load_loses_no_reply_and_is_restarted(
        tiny_model_dir: Path) -> None:
    with InferenceServer(worker_config(tiny_model_dir)) as srv:
        with Client(*srv.address) as client:
            victim = client.stats(timeout=30)["workers"][0]["pid"]
        conn = RawConnection(srv.address)
        total = 600
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 6))
                               for i in range(total)))
        wait_until(lambda: srv.stats.snapshot()["requests"].get("qa", {}).get("ok", 0) > 20)
        os.kill(victim, signal.SIGKILL)
        replies = conn.recv_replies(total)  # every one answered: nothing left hanging
        codes = {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}
        assert codes <= {"worker_lost"}, codes
        assert sum(reply["ok"] for reply in replies.values()) > total // 2  # the other served
        wait_until(lambda: srv.ready)  # the replacement loaded and warmed up
        with Client(*srv.address) as client:
            stats = client.stats(timeout=30)
            assert client.answer(QUESTIONS[2], CONTEXTS[2], timeout=30)["answer"]
        conn.close()
    assert not alive(victim)
    assert stats["events"]["worker_restart"] == 1
    assert stats["workers"][0]["restarts"] == 1 and stats["workers"][0]["pid"] != victim
    lost = stats["requests"]["qa"].get("worker_lost", 0)
    assert lost > 0, "the killed worker held requests (its window) when it died"
    assert lost == sum(not reply["ok"] for reply in replies.values())
    assert stats["in_flight"] == 0


def sigterm_under_load(args: list[str], total: int,
                       repeat: int) -> tuple[dict[int, Any], int, str, dict[str, Any]]:
    """A server process started with ``args``, sent ``total`` pipelined requests (contexts
    repeated ``repeat`` times), and SIGTERM once all are admitted while some are still in
    flight: (every reply by id, its exit status, its log, its stats before the load)."""
    proc, address, lines = start_server(*args)
    reader = drain_log(proc, lines)
    with Client(*address) as observer:
        before = observer.stats(timeout=30)
        # the worker processes held while the load is admitted, so that some is still in
        # flight at the signal however slow the machine (on a busy one, admitting it all
        # could take as long as answering it)
        workers = [w["pid"] for w in before["workers"] if w["pid"] not in (None, proc.pid)]
        for pid in workers:
            freeze(pid)
        try:
            conn = RawConnection(address)
            conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6],
                                                           CONTEXTS[i % 6] * repeat))
                                   for i in range(total)))
            deadline = time.monotonic() + 60
            while (stats := observer.stats(timeout=30))["admitted"] < total:
                assert time.monotonic() < deadline, stats
                time.sleep(0.01)
            assert stats["in_flight"] > 0, "the load finished before the signal"
            proc.send_signal(signal.SIGTERM)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        replies = conn.recv_replies(total)
    status = proc.wait(timeout=60)
    reader.join(10)
    return replies, status, "".join(lines), before


def test_sigterm_with_workers_drains_every_admitted_request_and_exits_zero(
        tiny_model_dir: Path) -> None:
    replies, status, log, before = sigterm_under_load(
        ["--model_dir", str(tiny_model_dir), "--workers", "2", "--num_inference_sessions", "1",
         "--threads_per_session", "1"], total=200, repeat=8)
    assert all(reply["ok"] for reply in replies.values())
    assert status == 0
    assert "all admitted requests answered" in log
    pids = [w["pid"] for w in before["workers"]]
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10)


def test_cuda_devices_without_a_gpu_fail_at_start_with_a_clear_message(
        tiny_model_dir: Path) -> None:
    result = subprocess.run([sys.executable, "server.py", "--port", "0", "--model_dir",
                             str(tiny_model_dir), "--workers", "2", "--cuda_devices", "0,1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--cuda_devices 0,1 asks for GPUs" in result.stderr
    assert "leave --cuda_devices out to serve on the CPU" in result.stderr


def test_cuda_devices_must_be_gpu_indices() -> None:
    result = subprocess.run([sys.executable, "server.py", "--cuda_devices", "first"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--cuda_devices must list GPU indices" in result.stderr
    config = ServerConfig(workers=3, cuda_devices="0,1")
    assert config.worker_devices() == ["cuda:0", "cuda:1", "cuda:0"]  # round-robin


def test_overload_is_refused_in_the_front_end_and_every_request_is_answered(
        tiny_model_dir: Path) -> None:
    config = worker_config(tiny_model_dir, max_queue=2, max_batch_size=1)  # windows of 2
    with InferenceServer(config) as srv:
        conn = RawConnection(srv.address)
        total = 300
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 4))
                               for i in range(total)))
        replies = conn.recv_replies(total)
        conn.close()
        outcomes = [reply["error"]["code"] if not reply["ok"] else "ok"
                    for reply in replies.values()]
        assert set(outcomes) == {"ok", "overloaded"}  # 2 waiting + 2 per worker at most
        stats = srv.stats.snapshot()
    assert stats["requests"]["qa"] == {"ok": outcomes.count("ok"),
                                       "overloaded": outcomes.count("overloaded")}
    assert stats["in_flight"] == 0


def test_memory_is_reported_per_worker_process_per_model_and_in_all(
        served: InferenceServer) -> None:
    """Each worker reads its own memory; the model holds its workers' PSS; the machine's total
    is the front end's PSS and the workers' together; /metrics says the same."""
    with Client(*served.address) as client:
        stats = client.stats(timeout=30)
    workers = stats["workers"]
    assert len(workers) == 2
    for worker in workers:
        assert worker["memory_mb"]["rss_mb"] > 0 and worker["memory_mb"]["pss_mb"] > 0
    held = sum(w["memory_mb"]["pss_mb"] for w in workers)
    (entry,) = stats["models"].values()
    assert entry["memory_mb"] == pytest.approx(held, abs=0.1)
    memory = stats["memory"]
    assert memory["process_rss_mb"] > 0
    assert memory["total_pss_mb"] == pytest.approx(memory["process_pss_mb"] + held, abs=0.2)
    metrics = scrape(served)
    per_worker = {dict(key[1:])["worker"]: value for key, value in metrics.items()
                  if key[0] == "qa_server_worker_memory_bytes"}
    assert sorted(per_worker) == ["0", "1"] and all(v > 0 for v in per_worker.values())
    assert metrics[("qa_server_memory_bytes",)] > sum(per_worker.values())
    assert metrics[("qa_server_process_resident_memory_bytes",)] > 0
