"""Connection limits: the cap on connections, idle connections, frames that arrive too slowly."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from engines import load_engine
from protocol import encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, GatedEngine, RawConnection, header, wait_until
from transport.closing import delivered, unacknowledged_bytes


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          max_connections=300, idle_timeout_s=1.0, frame_timeout_s=0.5)
    with InferenceServer(config) as srv:
        yield srv


def events(srv: InferenceServer) -> dict[str, int]:
    return srv.stats.snapshot()["events"]


def open_connections(srv: InferenceServer) -> int:
    return srv.stats.snapshot()["connections_open"]


def test_many_idle_connections_do_not_hurt_service_and_are_closed_after_the_idle_timeout(
        server: InferenceServer) -> None:
    before = events(server)["idle_timeout"]
    idle = [RawConnection(server.address) for _ in range(250)]
    # every one accepted: open, or closed already for its idle second (beside busy processes
    # opening 250 took longer than that, so they were never all open at once)
    wait_until(lambda: open_connections(server) + events(server)["idle_timeout"] - before >= 250)
    with Client(*server.address) as client:  # served while 250 others idle
        assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["end"] > 0
    for conn in idle:
        reply = conn.recv_message()
        assert reply is not None and reply["id"] is None
        assert reply["error"]["code"] == "idle_timeout"
        assert "idle_timeout" in reply["error"]["message"]
        assert conn.recv_message() is None  # then closed
        conn.close()
    wait_until(lambda: open_connections(server) == 0)
    assert events(server)["idle_timeout"] - before >= 250


def test_a_connection_awaiting_replies_is_not_idle(tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          idle_timeout_s=0.3)
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        engine.gate.clear()
        conn = RawConnection(srv.address)
        conn.send(qa_request(1, QUESTIONS[1], CONTEXTS[1]))
        time.sleep(1.0)  # more than the idle timeout, while its request is held
        engine.gate.set()
        reply = conn.recv_message()
        assert reply is not None and reply["id"] == 1 and reply["ok"]
        idle = conn.recv_message()  # then, with nothing in flight, it idles out
        assert idle is not None and idle["error"]["code"] == "idle_timeout"
        conn.close()


def test_a_frame_trickling_in_too_slowly_is_cut_off(server: InferenceServer) -> None:
    before = events(server)["frame_timeout"]
    slow = RawConnection(server.address)
    frame = encode_frame(qa_request(1, QUESTIONS[2], CONTEXTS[2]))
    slow.send_raw(frame[:10])
    started = time.monotonic()
    try:
        for byte in frame[10:]:  # a byte every 50 ms: the frame would take seconds
            slow.send_raw(bytes([byte]))
            time.sleep(0.05)
    except OSError:
        pass  # the server closed the connection under us: what this test wants
    reply = slow.recv_message()
    assert time.monotonic() - started < 60
    assert reply is not None and reply["id"] is None
    assert reply["error"]["code"] == "frame_timeout" and "frame_timeout" in reply["error"]["message"]
    slow.close()
    assert events(server)["frame_timeout"] == before + 1
    with Client(*server.address) as client:
        assert client.ping(timeout=10)["pong"] is True


def test_a_header_alone_is_cut_off_too(server: InferenceServer) -> None:
    conn = RawConnection(server.address)
    conn.send_raw(header(100))  # announces a body that never comes
    reply = conn.recv_message()
    assert reply is not None and reply["error"]["code"] == "frame_timeout"
    conn.close()


def test_beyond_max_connections_a_new_connection_is_refused_with_an_error_and_closed(
        tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          max_connections=3)
    with InferenceServer(config) as srv:
        clients = [Client(*srv.address) for _ in range(3)]
        for client in clients:
            assert client.ping(timeout=10)["pong"] is True
        extra = RawConnection(srv.address)
        extra.send(qa_request(1, QUESTIONS[0], CONTEXTS[0]))
        reply = extra.recv_message()
        assert reply is not None and reply["id"] is None
        assert reply["error"]["code"] == "too_many_connections"
        assert "max_connections" in reply["error"]["message"]
        assert extra.recv_message() is None
        extra.close()
        assert srv.stats.snapshot()["events"]["connection_refused"] == 1
        for client in clients:  # the three admitted ones are unaffected
            assert client.answer(QUESTIONS[3], CONTEXTS[3], timeout=30)["answer"]
        clients.pop().close()
        wait_until(lambda: srv.stats.snapshot()["connections_open"] == 2)
        with Client(*srv.address) as again:  # room again
            assert again.ping(timeout=10)["pong"] is True
        for client in clients:
            client.close()


def test_a_closing_socket_knows_when_the_peer_has_received_everything_sent() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    server_side.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):  # fill every buffer: the client does not read
        while True:
            sent += server_side.send(b"x" * 65536)
    assert not delivered(server_side)
    assert (unacknowledged_bytes(server_side) or 0) > 0
    received = 0
    while received < sent:
        received += len(client.recv(1 << 20))
    wait_until(lambda: delivered(server_side))
    for s in (client, server_side, listener):
        s.close()
