"""The stats op and the Prometheus /metrics endpoint, read from a live server."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from protocol import BadRequest
from server import InferenceServer, ServerConfig
from telemetry.prometheus import GpuProbe
from tests.helpers import CONTEXTS, QUESTIONS


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=2,
                          threads_per_session=1, max_batch_size=4, metrics_port=0)
    with InferenceServer(config) as srv:
        with Client(*srv.address) as client:
            futures = [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(30)]
            for future in futures:
                future.result(timeout=60)
            with pytest.raises(BadRequest):
                client.answer("", "empty question", timeout=30)
            client.ping(timeout=10)
        yield srv


def scrape(srv: InferenceServer) -> dict[str, dict[tuple, float]]:
    """GET /metrics over HTTP; {metric family name: {(sample name, labels...): value}}."""
    assert srv.metrics_address is not None
    host, port = srv.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    families: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return families


def test_stats_op_reports_outcomes_batches_timings_and_configuration(
        server: InferenceServer) -> None:
    with Client(*server.address) as client:
        stats = client.stats(timeout=10)
    assert stats["requests"]["qa"]["ok"] == 30
    assert stats["requests"]["qa"]["bad_request"] == 1
    assert stats["requests"]["ping"]["ok"] == 1
    assert stats["admitted"] == 30 and stats["in_flight"] == 0 and stats["queue_depth"] == 0
    histogram = {int(k): v for k, v in stats["batch_size_histogram"].items()}
    assert sum(size * n for size, n in histogram.items()) == 30
    assert max(histogram) <= 4 and stats["batches"] == sum(histogram.values())
    assert 1 <= stats["mean_batch_size"] <= 4
    for timing in ("queue_time", "engine_time", "request_time"):
        t = stats[timing]
        assert t["count"] > 0 and 0 <= t["p50_ms"] <= t["p90_ms"] <= t["p99_ms"] <= t["max_ms"]
    assert stats["queue_time"]["count"] == stats["request_time"]["count"] == 30
    assert stats["engine_time"]["count"] == stats["batches"]
    assert stats["config"]["num_inference_sessions"] == 2
    assert stats["config"]["max_batch_size"] == 4
    assert stats["model"]["name"] == "tiny-random-bert-qa-0" and stats["model"]["meaningful"] is False
    assert stats["engine"]["type"] == "onnx" and stats["engine"]["device"] == "cpu"
    assert stats["uptime_s"] > 0 and stats["ready"] is True
    assert stats["connections_total"] >= 2


def test_metrics_endpoint_serves_the_same_figures_as_prometheus_text(
        server: InferenceServer) -> None:
    with Client(*server.address) as client:
        stats = client.stats(timeout=10)
    metrics = scrape(server)
    requests = metrics["qa_server_requests"]
    assert requests[("qa_server_requests_total", ("op", "qa"), ("outcome", "ok"))] == 30
    assert requests[("qa_server_requests_total", ("op", "qa"), ("outcome", "bad_request"))] == 1
    assert metrics["qa_server_batches"][("qa_server_batches_total",)] == stats["batches"]
    engine = metrics["qa_server_engine_time_seconds"]
    assert engine[("qa_server_engine_time_seconds_count",)] == stats["batches"]
    assert engine[("qa_server_engine_time_seconds_bucket", ("le", "+Inf"))] == stats["batches"]
    assert engine[("qa_server_engine_time_seconds_sum",)] > 0
    batch = metrics["qa_server_batch_size"]
    assert batch[("qa_server_batch_size_sum",)] == 30
    assert batch[("qa_server_batch_size_bucket", ("le", "4"))] == stats["batches"]
    queue = metrics["qa_server_queue_time_seconds"]
    assert queue[("qa_server_queue_time_seconds_count",)] == 30
    assert metrics["qa_server_queue_depth"][("qa_server_queue_depth",)] == 0
    assert metrics["qa_server_ready"][("qa_server_ready",)] == 1
    events = metrics["qa_server_events"]
    assert events[("qa_server_events_total", ("event", "session_restart"))] == 0
    assert set(stats["events"]) == {key[1][1] for key in events}
    info = next(iter(metrics["qa_server_info"]))
    assert ("model", "tiny-random-bert-qa-0") in info and ("engine", "onnx") in info
    assert ("precision", "fp32") in info


def test_memory_is_in_stats_and_metrics_for_the_process_and_the_model(
        server: InferenceServer) -> None:
    with Client(*server.address) as client:
        stats = client.stats(timeout=30)
    assert stats["memory"]["process_rss_mb"] > 0
    assert stats["memory"]["total_pss_mb"] == stats["memory"]["process_pss_mb"]  # no workers
    (entry,) = stats["models"].values()
    assert entry["memory_mb"] is not None and entry["memory_mb"] >= 0  # what loading added
    assert stats["workers"][0]["memory_mb"]["rss_mb"] > 0
    metrics = scrape(server)
    assert metrics["qa_server_process_resident_memory_bytes"][
        ("qa_server_process_resident_memory_bytes",)] > 0
    (model_bytes,) = metrics["qa_server_model_memory_bytes"].values()
    assert model_bytes == entry["memory_mb"] * 2**20


def test_gpu_series_are_absent_without_a_gpu(server: InferenceServer) -> None:
    probe = GpuProbe()
    if probe.handles:
        pytest.skip("this machine has an NVIDIA GPU")
    assert list(probe.collect()) == []
    assert not [name for name in scrape(server) if "gpu" in name]


def test_metrics_are_off_unless_asked_for(tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1)
    with InferenceServer(config) as srv:
        assert srv.metrics_address is None
