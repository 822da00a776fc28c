"""The HTTP API's probes and rules through a server's life, in every layout: ready is 503 while
the models load and once a stop begins, 200 in between; requests admitted before a stop are
answered; tokens and TLS as for TCP; deadlines and overload as typed errors."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.local_server import RedisServer, make_certificates
from engines import load_engine
from engines.base import Engine
from server import InferenceServer
from settings.server_config import ServerConfig
from tests.broker_fixtures import running_redis, start_worker, stop_worker
from tests.helpers import GatedEngine, wait_until
from tests.http_helpers import QA_BODY, request


def status(address: tuple[str, int], path: str, **kwargs: Any) -> int:
    return request(address, "GET", path, **kwargs)[0]


class Background:
    """A call run on a thread of its own; ``result()`` waits for it."""

    def __init__(self, call: Any, *args: Any, **kwargs: Any) -> None:
        self.value: Any = None
        self.thread = threading.Thread(target=self._run, args=(call, args, kwargs))
        self.thread.start()

    def _run(self, call: Any, args: Any, kwargs: Any) -> None:
        self.value = call(*args, **kwargs)

    def result(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return self.value


def test_ready_is_503_while_loading_and_during_a_drain_and_200_between(
        tiny_model_dir: Path) -> None:
    loading = threading.Event()
    engines: list[GatedEngine] = []

    def factory() -> Engine:
        assert loading.wait(60)
        engines.append(GatedEngine(load_engine("onnx", tiny_model_dir, threads=1)))
        return engines[-1]

    server = InferenceServer(ServerConfig(model_dir=str(tiny_model_dir), port=0,
                                          num_inference_sessions=1), engine_factory=factory)
    starting = Background(server.start)
    wait_until(lambda: server._http is not None)
    http = server.http_address
    assert http is not None
    assert status(http, "/health/live") == 200
    code, _, body = request(http, "GET", "/health/ready")
    assert code == 503 and "loading" in body["error"]
    assert status(http, "/v2/health/ready") == 503
    code, _, body = request(http, "POST", "/qa", QA_BODY)
    assert code == 503 and body["error_type"] == "unavailable"
    loading.set()
    starting.result()
    assert status(http, "/health/ready") == 200 and status(http, "/health") == 200
    name = next(iter(server.models)).name
    assert status(http, "/v2/health/ready") == 200
    assert status(http, f"/v2/models/{name}/ready") == 200

    engines[0].gate.clear()  # a request held in the engine while the stop begins
    before = engines[0].calls  # the warm-up's batches
    held = Background(request, http, "POST", "/qa", QA_BODY)
    wait_until(lambda: engines[0].calls > before)
    stopping = Background(server.shutdown, 30)
    wait_until(lambda: server.handler.draining)
    code, _, body = request(http, "GET", "/health/ready")
    assert code == 503 and "draining" in body["error"]
    code, _, body = request(http, "POST", "/qa", QA_BODY)
    assert code == 503 and body["error_type"] == "shutting_down"
    engines[0].gate.set()
    code, _, body = held.result()
    assert code == 200 and "answer" in body
    assert stopping.result() is True


def test_overload_is_429_and_a_deadline_504(tiny_model_dir: Path) -> None:
    engine: list[GatedEngine] = []

    def factory() -> Engine:
        engine.append(GatedEngine(load_engine("onnx", tiny_model_dir, threads=1)))
        return engine[-1]

    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, num_inference_sessions=1,
                          max_queue=1, max_batch_size=1)
    with InferenceServer(config, engine_factory=factory) as server:
        http = server.http_address
        backend = next(iter(server.models)).backend
        engine[0].gate.clear()
        try:
            before = engine[0].calls  # the warm-up's batches
            running = Background(request, http, "POST", "/qa", QA_BODY)  # held in the engine
            wait_until(lambda: engine[0].calls > before)
            late = Background(request, http, "POST", "/qa", QA_BODY,
                              headers={"x-timeout-ms": "2000"})
            wait_until(lambda: backend.queue_depth == 1)  # it waits: the queue is full
            code, headers, body = request(http, "POST", "/qa", QA_BODY)
            assert code == 429 and body["error_type"] == "overloaded" and headers["retry-after"]
            code, _, body = late.result()
            assert code == 504 and body["error_type"] == "deadline_exceeded"
        finally:
            engine[0].gate.set()
        assert running.result()[0] == 200


def test_tokens_are_required_except_on_the_probes(tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    (tmp_path / "tokens.txt").write_text("s3cret-token\n")
    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, num_inference_sessions=1,
                          auth_token_file=str(tmp_path / "tokens.txt"))
    with InferenceServer(config) as server:
        http = server.http_address
        code, headers, body = request(http, "POST", "/qa", QA_BODY)
        assert code == 401 and body["error_type"] == "unauthorized"
        assert headers["www-authenticate"].startswith("Bearer")
        for wrong in ("Bearer nope", "Basic s3cret-token", "s3cret-token"):
            assert request(http, "POST", "/qa", QA_BODY,
                           headers={"authorization": wrong})[0] == 401
        assert status(http, "/metrics") == 401
        good = {"authorization": "Bearer s3cret-token"}
        assert request(http, "POST", "/qa", QA_BODY, headers=good)[0] == 200
        assert status(http, "/metrics", headers=good) == 200
        name = next(iter(server.models)).name
        for probe in ("/health/live", "/health/ready", "/v2/health/ready",
                      f"/v2/models/{name}/ready"):
            assert status(http, probe) == 200


def test_tls_makes_it_https_with_the_same_certificate(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    make_certificates(tmp_path)
    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, num_inference_sessions=1,
                          tls_cert=str(tmp_path / "server.crt"),
                          tls_key=str(tmp_path / "server.key"))
    with InferenceServer(config) as server:
        http = server.http_address
        tls = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        assert status(http, "/health/ready", tls=tls) == 200
        assert request(http, "POST", "/qa", QA_BODY, tls=tls)[0] == 200
        with pytest.raises((ConnectionError, OSError, AssertionError)):
            request(http, "GET", "/health/live", timeout=5)  # plain HTTP to the TLS port


@pytest.mark.parametrize("layout", [{"workers": 2}, {"workers": 1, "executors": "on",
                                                     "inference_engine_type": "sim"}],
                         ids=["workers", "executor"])
def test_every_process_layout_serves_http(tiny_model_dir: Path, layout: dict[str, Any]) -> None:
    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, num_inference_sessions=1,
                          threads_per_session=1, **layout)
    with InferenceServer(config) as server:
        http = server.http_address
        assert status(http, "/health/ready") == 200
        code, _, body = request(http, "POST", "/qa", QA_BODY)
        assert code == 200 and "answer" in body


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


def test_a_broker_front_end_is_ready_only_with_a_live_worker(tiny_model_dir: Path,
                                                             redis_server: RedisServer) -> None:
    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, broker=redis_server.url)
    with InferenceServer(config) as server:
        http = server.http_address
        code, _, body = request(http, "GET", "/health/ready")
        assert code == 503 and "not serving" in body["error"]
        assert list(body["models"].values()) == [False]
        code, _, body = request(http, "POST", "/qa", QA_BODY)
        assert code == 503 and body["error_type"] == "unavailable"
        worker = start_worker(redis_server.url, tiny_model_dir)
        try:
            wait_until(lambda: status(http, "/health/ready") == 200, 60)
            assert request(http, "POST", "/qa", QA_BODY)[0] == 200
        finally:
            stop_worker(worker)
