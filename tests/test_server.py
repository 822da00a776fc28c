"""The server over real sockets on 127.0.0.1, with a tiny real model."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client import Client
from engines import load_engine
from protocol import BadRequest, encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    GatedEngine,
    RawConnection,
    Reference,
    assert_pipelined_answers,
    header,
    wait_until,
)

FRAME_CAP = 64 * 1024


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module", params=["onnx", "pytorch"])
def server(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(host="127.0.0.1", port=0, model_dir=str(tiny_model_dir),
                          inference_engine_type=request.param, num_inference_sessions=2,
                          threads_per_session=1, max_batch_size=4, max_frame_size=FRAME_CAP)
    with InferenceServer(config) as srv:
        yield srv


def assert_same_answer(result: dict, expected: dict, context: str) -> None:
    assert context[result["start"]:result["end"]] == result["answer"]
    assert (result["answer"], result["start"], result["end"]) == (
        expected["answer"], expected["start"], expected["end"])
    assert result["score"] == pytest.approx(expected["score"], rel=1e-3, abs=1e-6)


def test_one_request_gets_the_answer_the_engine_gives(server: InferenceServer,
                                                      reference: Reference) -> None:
    with Client(*server.address) as client:
        result = client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)
    assert set(result) == {"answer", "score", "start", "end"}
    assert_same_answer(result, reference.answer(QUESTIONS[0], CONTEXTS[0]), CONTEXTS[0])


def test_ping_says_alive_and_ready(server: InferenceServer) -> None:
    with Client(*server.address) as client:
        assert client.ping(timeout=10) == {"pong": True, "ready": True}


def test_pipelined_requests_on_one_connection_are_matched_by_id(server: InferenceServer,
                                                                reference: Reference) -> None:
    assert_pipelined_answers(server.address, reference, first_id=100)


def test_many_concurrent_clients_each_get_their_own_answers(server: InferenceServer,
                                                            reference: Reference) -> None:
    expected = [reference.answer(q, c) for q, c in zip(QUESTIONS, CONTEXTS)]

    def one_client(seed: int) -> int:
        with Client(*server.address) as client:
            order = [(seed + k) % 6 for k in range(12)]
            futures = [(i, client.submit(QUESTIONS[i], CONTEXTS[i])) for i in order]
            for i, future in futures:
                assert_same_answer(future.result(timeout=60), expected[i], CONTEXTS[i])
        return len(futures)

    with ThreadPoolExecutor(max_workers=16) as pool:
        assert sum(pool.map(one_client, range(16))) == 16 * 12


def test_malformed_frame_gets_one_error_then_close_and_others_still_served(
        server: InferenceServer) -> None:
    bad = RawConnection(server.address)
    bad.send_raw(header(5) + b"\xc1\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    reply = bad.recv_message()
    assert reply is not None and reply["id"] is None and reply["ok"] is False
    assert reply["error"]["code"] == "protocol_error"
    assert bad.recv_message() is None  # closed
    bad.close()
    with Client(*server.address) as client:
        assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["answer"]


def test_oversized_frame_is_refused_before_its_body_is_sent(server: InferenceServer) -> None:
    big = RawConnection(server.address)
    big.send_raw(header(FRAME_CAP + 1))  # only the header: the server must not wait for the body
    reply = big.recv_message()
    assert reply is not None and reply["id"] is None
    assert reply["error"]["code"] == "frame_too_large"
    assert big.server_closed()
    big.close()
    with Client(*server.address) as client:
        assert client.ping(timeout=10)["pong"] is True


def test_bad_request_gets_a_typed_error_and_the_connection_keeps_working(
        server: InferenceServer) -> None:
    with Client(*server.address) as client:
        missing = client.request(lambda rid: {"id": rid, "op": "qa", "question": "Who?"})
        with pytest.raises(BadRequest, match="context") as info:
            missing.result(timeout=10)
        assert info.value.code == "bad_request"
        wrong_type = client.request(lambda rid: {"id": rid, "op": "qa", "question": 7, "context": "x"})
        with pytest.raises(BadRequest, match="question"):
            wrong_type.result(timeout=10)
        unknown = client.request(lambda rid: {"id": rid, "op": "translate"})
        with pytest.raises(BadRequest, match="op"):
            unknown.result(timeout=10)
        assert context_answer(client) == CONTEXTS[2]


def context_answer(client: Client) -> str:
    result = client.answer(QUESTIONS[2], CONTEXTS[2], timeout=30)
    assert CONTEXTS[2][result["start"]:result["end"]] == result["answer"]
    return CONTEXTS[2]


def test_question_too_long_for_the_model_fails_alone(server: InferenceServer) -> None:
    with Client(*server.address) as client:
        with pytest.raises(BadRequest):
            client.answer("why " * 600, CONTEXTS[0], timeout=30)
        assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["end"] > 0


def test_long_context_spanning_several_windows_is_answered(server: InferenceServer,
                                                          reference: Reference) -> None:
    context = " ".join(CONTEXTS * 40)  # thousands of tokens: many overlapping windows
    with Client(*server.address) as client:
        result = client.answer("Who created Python?", context, timeout=60)
    assert_same_answer(result, reference.answer("Who created Python?", context), context)


def test_half_closed_client_still_receives_every_reply(server: InferenceServer) -> None:
    conn = RawConnection(server.address)
    conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6]))
                           for i in range(20)))
    conn.sock.shutdown(socket.SHUT_WR)
    assert set(conn.recv_replies(20)) == set(range(20))
    assert conn.recv_message() is None
    conn.close()


def test_client_vanishing_with_requests_in_flight_does_not_hurt_the_server(
        server: InferenceServer) -> None:
    for _ in range(5):
        conn = RawConnection(server.address)
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[0], CONTEXTS[0] * 20))
                               for i in range(30)))
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()  # RST with replies still to come
    with Client(*server.address) as client:
        assert client.ping(timeout=10)["ready"] is True
        assert client.answer(QUESTIONS[4], CONTEXTS[4], timeout=60)["answer"]


def test_shutdown_answers_admitted_requests_and_refuses_new_ones(tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          batching="fixed", max_batch_size=2)
    srv = InferenceServer(config, engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()  # from now on, batches are held until the test opens the gate
    conn = RawConnection(srv.address)
    conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6]))
                           for i in range(10)))
    wait_until(lambda: srv.stats.admitted == 10)  # all admitted; the first batch is held
    stopper = threading.Thread(target=srv.shutdown)
    stopper.start()
    wait_until(lambda: not srv.ready)  # draining
    conn.send(qa_request(99, QUESTIONS[0], CONTEXTS[0]))
    refused = conn.recv_message()
    assert refused is not None and refused["id"] == 99
    assert refused["error"]["code"] == "shutting_down"
    with pytest.raises(OSError):
        socket.create_connection(srv.address, timeout=2)  # no longer accepting
    engine.gate.set()
    replies = conn.recv_replies(10)
    assert all(r["ok"] for r in replies.values())  # every admitted request answered
    assert conn.recv_message() is None  # then the connection is closed
    stopper.join(30)
    assert not stopper.is_alive()
    conn.close()
