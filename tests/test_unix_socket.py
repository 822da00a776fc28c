"""Serving on a Unix socket (--unix_socket): answers, TCP beside it, the shared connection cap,
stale and live socket files, and the file's removal on stop; in process and as a process."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from engines import load_engine
from protocol import encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    GatedEngine,
    RawConnection,
    Reference,
    assert_pipelined_answers,
    assert_same_answer,
    wait_until,
)
from transport import BindError

ROOT = Path(__file__).resolve().parent.parent


def short_dir() -> Path:
    """A fresh folder with a short path: a socket's path holds at most 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="qa-", dir="/tmp"))


@pytest.fixture
def folder() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    path = short_dir()
    config = ServerConfig(port=0, unix_socket=str(path / "qa.sock"), model_dir=str(tiny_model_dir),
                          num_inference_sessions=2, threads_per_session=1, max_batch_size=4)
    with InferenceServer(config) as srv:
        yield srv
    shutil.rmtree(path, ignore_errors=True)


def open_connections(srv: InferenceServer) -> int:
    return srv.stats.snapshot()["connections_open"]


def test_pipelined_requests_over_the_unix_socket_get_the_in_process_answers(
        server: InferenceServer, reference: Reference) -> None:
    assert server.unix_address is not None and server.unix_address.startswith("unix:///")
    assert_pipelined_answers(server.unix_address, reference, first_id=7)


def test_tcp_and_the_unix_socket_serve_at_once(server: InferenceServer,
                                               reference: Reference) -> None:
    with Client(*server.address) as tcp, Client(server.unix_address, 12345) as unix:  # port unused
        assert unix.endpoint == server.unix_address
        wait_until(lambda: open_connections(server) == 2)
        futures = [(client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]), i % 6)
                   for i in range(40) for client in (tcp, unix)]
        for future, k in futures:
            assert_same_answer(future.result(timeout=60), reference.answer(QUESTIONS[k],
                                                                           CONTEXTS[k]),
                               CONTEXTS[k])


def test_max_connections_counts_tcp_and_unix_connections_together(tiny_model_dir: Path,
                                                                  folder: Path) -> None:
    config = ServerConfig(port=0, unix_socket=str(folder / "qa.sock"),
                          model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          max_connections=2)
    with InferenceServer(config) as srv:
        held = [RawConnection(srv.address), RawConnection(srv.unix_address)]
        wait_until(lambda: open_connections(srv) == 2)
        for address in (srv.unix_address, srv.address):  # full, over either
            refused = RawConnection(address)
            reply = refused.recv_message()
            assert reply is not None and reply["error"]["code"] == "too_many_connections"
            assert refused.recv_message() is None
            refused.close()
        assert srv.stats.snapshot()["events"]["connection_refused"] == 2
        held.pop().close()  # a slot frees: the Unix socket serves again
        wait_until(lambda: open_connections(srv) == 1)
        with Client(srv.unix_address) as client:
            assert client.ping(timeout=10)["pong"]
        held[0].close()


def test_a_stale_socket_file_is_replaced(tiny_model_dir: Path, folder: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    path = folder / "qa.sock"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(str(path))  # a server that died: the file stays, nothing listens
    crashed.close()
    assert path.is_socket()
    config = ServerConfig(port=-1, http_port=-1, unix_socket=str(path),
                          model_dir=str(tiny_model_dir),
                          num_inference_sessions=1)
    with caplog.at_level("INFO", logger="server.transport"), InferenceServer(config) as srv:
        with Client(f"unix://{path}") as client:
            assert client.ping(timeout=10)["pong"]
        assert srv.endpoints == f"unix://{path}"
    assert "stale socket file" in caplog.text
    assert not path.exists()  # removed on stop


def test_a_socket_a_live_server_listens_on_fails_the_start_with_exit_2(
        tiny_model_dir: Path, folder: Path) -> None:
    path = folder / "qa.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        done = subprocess.run([sys.executable, "server.py", "--port", "-1", "--unix_socket",
                               str(path), "--model_dir", str(tiny_model_dir)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert f"cannot listen on unix://{path}" in done.stderr
        assert "another process is listening there" in done.stderr
        assert "loading" not in done.stderr  # it failed before loading anything
        assert path.is_socket()  # the live server's file is left alone
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # and it still takes connections


def test_a_path_that_is_not_a_socket_is_never_deleted(tiny_model_dir: Path,
                                                      folder: Path) -> None:
    path = folder / "notes.txt"
    path.write_text("precious")
    config = ServerConfig(port=0, unix_socket=str(path), model_dir=str(tiny_model_dir))
    server = InferenceServer(config)
    with pytest.raises(BindError, match="exists and is not a socket"):
        server.start()
    assert path.read_text() == "precious"
    assert server.backend is None  # nothing was loaded


def test_a_stop_delivers_every_reply_over_the_unix_socket(tiny_model_dir: Path,
                                                          folder: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=-1, http_port=-1, unix_socket=str(folder / "qa.sock"),
                          model_dir=str(tiny_model_dir), num_inference_sessions=1)
    srv = InferenceServer(config, engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()
    conn = RawConnection(srv.unix_address)
    total = 20
    conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6]))
                           for i in range(total)))
    wait_until(lambda: srv.stats.snapshot()["admitted"] == total)
    stopping = threading.Thread(target=srv.shutdown, args=(30,))
    stopping.start()
    time.sleep(0.2)
    engine.gate.set()  # the stop drains the queue: every admitted request is answered
    replies = conn.recv_replies(total)
    assert all(reply["ok"] for reply in replies.values())
    assert conn.recv_message() is None  # then the end of the stream
    conn.close()
    stopping.join(30)
    assert not (folder / "qa.sock").exists()


def test_a_unix_only_server_process_publishes_its_address_and_removes_its_file(
        tiny_model_dir: Path, folder: Path) -> None:
    path, address_file = folder / "qa.sock", folder / "address"
    proc = subprocess.Popen([sys.executable, "server.py", "--port", "-1", "--http_port", "-1",
                             "--unix_socket", str(path), "--address_file", str(address_file), "--model_dir",
                             str(tiny_model_dir), "--num_inference_sessions", "1"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "serving on" in line:
            break
    log = "".join(lines)
    assert re.search(rf"serving on unix://{re.escape(str(path))}; Ctrl\+C stops$", log, re.M), log
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    assert address_file.read_text().strip() == f"unix://{path}"
    probe = subprocess.run([sys.executable, "client.py", "--address_file", str(address_file),
                            "--ready"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    asked = subprocess.run([sys.executable, "client.py", "--host", f"unix://{path}",
                            "--question", QUESTIONS[4], "--context", CONTEXTS[4]],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0 and "answer: " in asked.stdout, asked.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not path.exists() and not address_file.exists()


def test_unix_socket_usage_errors_exit_2() -> None:
    for args, message in ((["--port", "-1"], "--port -1 serves no TCP"),
                          (["--unix_socket", "/tmp/" + "x" * 120], "1 to 107 bytes"),
                          (["--port", "-2"], "--port must be -1")):
        done = subprocess.run([sys.executable, "server.py", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr
