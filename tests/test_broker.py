"""--broker: front ends and worker processes over a real redis-server (password through the
URL), real sockets, a tiny real ONNX model; answers checked against the in-process task."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.local_server import RedisServer
from client import Client
from protocol import BadRequest, EngineError, encode_frame, qa_request
from server import InferenceServer
from tests.broker_fixtures import (
    ROOT,
    front_end,
    heartbeats,
    settled,
    start_worker,
    stop_worker,
    wait_serving,
    work_key,
)
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    RawConnection,
    Reference,
    nan_model_dir,
    wait_until,
)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), password="s3cret")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deployment(broker: RedisServer, tiny_model_dir: Path) -> Iterator[InferenceServer]:
    """Two workers and one front end (with metrics)."""
    workers = [start_worker(broker.url, tiny_model_dir) for _ in range(2)]
    front = front_end(broker.url, tiny_model_dir, metrics_port=0)
    try:
        wait_serving(front, 2)
        yield front
    finally:
        front.shutdown()
        assert [stop_worker(w) for w in workers] == [0, 0]  # SIGTERM drains, exits 0


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


def request(i: int) -> tuple[str, str]:
    return QUESTIONS[i % 6], CONTEXTS[i % 6] * (1 + i % 4)


def test_answers_through_redis_equal_the_in_process_task_and_both_workers_serve(
        deployment: InferenceServer, broker: RedisServer, reference: Reference,
        tiny_model_dir: Path) -> None:
    before = {pid: beat["figures"]["batch_rows"] for pid, beat in
              heartbeats(broker.client()).items()}
    with Client(*deployment.address) as client:
        futures = [client.submit(*request(i)) for i in range(120)]
        answers = [future.result(timeout=60) for future in futures]
    for i, answer in enumerate(answers):
        assert answer == reference.answer(*request(i))
    settled(broker.client(), tiny_model_dir)

    def both_ran() -> bool:
        beats = heartbeats(broker.client())
        return len(beats) == 2 and all(beat["figures"]["batch_rows"] > before.get(pid, 0)
                                       for pid, beat in beats.items())

    wait_until(both_ran, 10)


def test_typed_errors_cross_the_hop(deployment: InferenceServer) -> None:
    with Client(*deployment.address) as client:
        with pytest.raises(BadRequest, match="question is too long"):  # refused by the front end
            client.answer("a," * 400, CONTEXTS[0], timeout=30)
        assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["answer"]


def test_two_front_ends_two_workers_pipelined_soak(deployment: InferenceServer,
                                                   broker: RedisServer, tiny_model_dir: Path,
                                                   reference: Reference) -> None:
    second = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(second, 2)
        replies: dict[tuple[int, int], dict[str, Any]] = {}
        per_connection = 150

        def pipelined(index: int, server: InferenceServer) -> None:
            conn = RawConnection(server.address, timeout=60)
            conn.send_raw(b"".join(encode_frame(qa_request(i, *request(i + index)))
                                   for i in range(per_connection)))
            for i, reply in conn.recv_replies(per_connection).items():
                replies[(index, i)] = reply
            conn.close()

        threads = [threading.Thread(target=pipelined, args=(index, server)) for index, server in
                   enumerate([deployment, second, deployment, second])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(replies) == 4 * per_connection
        for (index, i), reply in replies.items():
            assert reply.get("error") is None, reply
            assert reply["result"] == reference.answer(*request(i + index))
    finally:
        assert second.shutdown(10)
    client = broker.client()
    settled(client, tiny_model_dir)
    assert not client.exists(f"qa:replies:{second.backend.name}")  # type: ignore[union-attr]


def test_stats_and_metrics_cover_the_broker(deployment: InferenceServer,
                                            broker: RedisServer, tiny_model_dir: Path) -> None:
    with Client(*deployment.address) as client:
        client.answer(*request(0), timeout=30)
        stats = client.stats(timeout=30)
    figures = stats["broker"]
    assert figures["up"] is True and figures["serving_workers"] == 2
    assert "s3cret" not in str(stats) and figures["url"].startswith("redis://:***@127.0.0.1")
    assert {"stream_length", "pending", "claims", "redeliveries", "duplicate_replies",
            "unavailable", "reconnects"} <= set(figures)
    assert len(stats["workers"]) == 2 and stats["engine"]["type"] == "onnx"
    assert stats["ready"] is True
    assert deployment.metrics_address is not None
    host, port = deployment.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    label = f'{{model="{tiny_model_dir.name}"}}'
    for series in (f"qa_server_broker_up{label} 1.0",
                   f"qa_server_broker_serving_workers{label} 2.0",
                   "qa_server_broker_claims_total", "qa_server_broker_stream_length",
                   "qa_server_broker_pending_entries", "qa_server_broker_redeliveries_total"):
        assert series in text


def test_a_front_end_logs_its_broker_and_model_and_no_engine_of_its_own(
        deployment: InferenceServer, broker: RedisServer, tiny_model_dir: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # It logged "engine: ?" (or a worker's engine, as its own), an empty cost model and
    # "2 inference sessions per model", of sessions it does not run.
    with caplog.at_level("INFO"), caplog.at_level("DEBUG", logger="server"):
        front = front_end(broker.url, tiny_model_dir)
        front.shutdown(10)
    log = caplog.text
    assert "broker redis://:***@127.0.0.1" in log  # its broker
    assert f"work on {work_key(tiny_model_dir)}" in log
    name = tiny_model_dir.name
    assert f"model {name} ready: qa, tokenized here; " in log  # its model, at INFO
    assert f"model {name}: tiny-random-bert-qa-0" in log  # and in full, at DEBUG
    assert "run by the broker's workers (--role worker)" in log  # what runs it
    assert "engine:" not in log and "cost model" not in log, log
    assert " sessions" not in log.split("ready:")[-1].splitlines()[0], log


def test_an_unreadable_work_entry_is_dropped_and_the_workers_keep_serving(
        deployment: InferenceServer, broker: RedisServer, tiny_model_dir: Path) -> None:
    client = broker.client()
    client.xadd(work_key(tiny_model_dir), {"m": b"\xc1 not msgpack"})
    client.xadd(work_key(tiny_model_dir), {"other": b"field"})
    settled(client, tiny_model_dir)
    wait_until(lambda: sum(b.get("unreadable", 0) for b in heartbeats(client).values()) == 2, 10)
    with Client(*deployment.address) as conn:
        assert conn.answer(*request(2), timeout=30)["answer"]


def test_nan_logits_from_a_worker_fail_only_their_own_request_at_the_front_end(
        broker: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = nan_model_dir(tiny_model_dir, tmp_path / "nan_model")
    worker = start_worker(broker.url, model_dir, "--broker_prefix", "nan")
    front = front_end(broker.url, model_dir, broker_prefix="nan")
    try:
        wait_serving(front, 1)
        with Client(*front.address) as conn:
            futures = [conn.submit("Who?", text) for text in
                       ("Ann met Bob.", "It will explode soon.", "Rain fell.")]
            assert futures[0].result(timeout=30)["answer"]
            with pytest.raises(EngineError, match="hold NaN or infinite values"):
                futures[1].result(timeout=30)
            assert futures[2].result(timeout=30)["answer"]
    finally:
        front.shutdown()
        assert stop_worker(worker) == 0


def test_a_wrong_password_fails_the_start_clearly(broker: RedisServer,
                                                  tiny_model_dir: Path) -> None:
    url = broker.url.replace("s3cret", "wrong")
    with pytest.raises(RuntimeError, match="refused us"):
        front_end(url, tiny_model_dir)
    worker = start_worker(url, tiny_model_dir)
    assert worker.wait(60) == 2


@pytest.mark.parametrize("args, message", [
    (["--role", "worker"], "--role worker needs --broker"),
    (["--broker", "http://127.0.0.1:1"], "redis://, rediss:// or unix://"),
    (["--broker", "redis://127.0.0.1:1/0", "--workers", "2"], "--workers applies without"),
    (["--broker", "redis://127.0.0.1:1/0", "--executors", "on"], "--executors on applies"),
])
def test_broker_flags_that_cannot_work_are_usage_errors(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "server.py"), *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_serving_without_a_broker_does_not_import_redis() -> None:
    code = ("import sys, server; server.ServerConfig(workers=2).problems(); "
            "print('redis' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_the_compose_file_runs_front_ends_and_workers_with_flags_the_server_takes() -> None:
    import yaml

    from dispatch.registry import setting_registry
    from settings.server_config import parse_args

    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    front, worker = services["frontend"], services["worker"]

    def flags(service: dict[str, Any]) -> list[str]:
        words = [*service.get("entrypoint", [])[2:], *service["command"]]
        return [w.replace("${REDIS_PASSWORD}", "pw") for w in words]

    registry = setting_registry()
    front_config = parse_args(None, flags(front), registry=registry)
    worker_config = parse_args(None, flags(worker), registry=registry)
    assert front_config.broker == worker_config.broker == "redis://:pw@redis:6379/0"
    assert front_config.role == "server" and worker_config.role == "worker"
    assert front_config.length_buckets == worker_config.length_buckets
    assert "appendonly" in " ".join(services["redis"]["command"])


def test_tls_comes_through_a_rediss_url(tmp_path: Path, tiny_model_dir: Path,
                                         reference: Reference) -> None:
    server = RedisServer(tmp_path, password="tls-pw", tls=True)
    server.start()
    assert server.url.startswith("rediss://")
    with pytest.raises(redis.ConnectionError):  # it speaks TLS only
        redis.Redis(port=server.port, password="tls-pw", socket_timeout=2).ping()
    worker = start_worker(server.url, tiny_model_dir)
    front = front_end(server.url, tiny_model_dir)
    try:
        wait_serving(front, 1)
        with Client(*front.address) as client:
            assert client.answer(*request(3), timeout=30) == reference.answer(*request(3))
    finally:
        front.shutdown(10)
        assert stop_worker(worker) == 0
        server.stop()
