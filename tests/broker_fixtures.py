"""Brokered deployments for tests: a real redis-server, worker processes, front ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.local_server import RedisServer
from server import InferenceServer, ServerConfig
from tests.helpers import RawConnection, wait_until

ROOT = Path(__file__).resolve().parent.parent


def start_worker(url: str, model_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A ``--role worker`` process (one session, one thread, small batches, quick claims)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "server.py"), "--role", "worker", "--broker", url,
         "--model_dir", str(model_dir), "--num_inference_sessions", "1",
         "--threads_per_session", "1", "--max_batch_size", "4", "--claim_idle_ms", "500",
         "--log_level", "WARNING", *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def front_end(url: str, model_dir: Path, **overrides: Any) -> InferenceServer:
    """A started front end on a free port."""
    settings: dict[str, Any] = dict(port=0, model_dir=str(model_dir), broker=url)
    settings.update(overrides)
    server = InferenceServer(ServerConfig(**settings))
    server.start()
    return server


def heartbeats(client: redis.Redis) -> dict[int, dict[str, Any]]:
    """{pid: heartbeat} of every live worker."""
    beats = {}
    for name in client.smembers("qa:workers"):
        raw = client.get(f"qa:worker:{name.decode()}")
        if raw is not None:
            beat = json.loads(raw)
            beats[beat["pid"]] = beat
    return beats


def wait_serving(server: InferenceServer, workers: int, timeout: float = 60) -> None:
    """Until the front end counts ``workers`` serving workers."""
    backend: Any = server.backend
    wait_until(lambda: backend.monitor.serving_workers == workers and server.ready, timeout)


def stop_worker(process: subprocess.Popen[bytes], timeout: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        raise


def work_key(model_dir: Path | str, prefix: str = "qa") -> str:
    """The work stream of the model in ``model_dir`` (a model folder, named after it)."""
    return f"{prefix}:work:{Path(model_dir).resolve().name}"


def settled(client: redis.Redis, model_dir: Path | str, seconds: float = 30) -> None:
    """Until the model's work stream holds nothing."""
    deadline = time.monotonic() + seconds
    while client.xlen(work_key(model_dir)):
        assert time.monotonic() < deadline, "the work stream never emptied"
        time.sleep(0.05)


def running_redis(folder: Path) -> Iterator[RedisServer]:
    """A throwaway redis-server in ``folder`` while the generator runs (a fixture's body)."""
    server = RedisServer(folder)
    server.start()
    yield server
    server.stop()


def assert_answered_once_each(conn: RawConnection, total: int) -> dict[int, dict[str, Any]]:
    """Every one of ``total`` requests on ``conn`` answered without error, and nothing more
    comes within a second (no request answered twice); the replies by id."""
    replies = conn.recv_replies(total)  # asserts one reply per id
    assert all(reply.get("error") is None for reply in replies.values()), \
        [r for r in replies.values() if r.get("error")][:3]
    conn.sock.settimeout(1.0)
    with pytest.raises(TimeoutError):
        conn.recv_message()
    return replies
