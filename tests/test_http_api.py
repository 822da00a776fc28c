"""The HTTP API against bad input and bad clients: each gets its status and a JSON error, and
nothing else breaks (a good request is answered after every one). Real sockets, a tiny real
model."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server import InferenceServer
from settings.server_config import ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, Reference, assert_same_answer
from tests.http_helpers import QA_BODY, closed, connect, read_responses, request


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(model_dir=str(tiny_model_dir), port=0, num_inference_sessions=1,
                          max_connections=8, frame_timeout_s=1.0, idle_timeout_s=2.0,
                          http_payload_limit=4096, max_texts=4)
    with InferenceServer(config) as srv:
        yield srv


@pytest.fixture
def http(server: InferenceServer) -> Iterator[tuple[str, int]]:
    """The HTTP address; after each test, a good request is still answered."""
    assert server.http_address is not None
    yield server.http_address
    status, _, body = request(server.http_address, "POST", "/qa", QA_BODY)
    assert status == 200 and "answer" in body, body


def assert_error(reply: tuple[int, dict[str, str], object], status: int, code: str) -> None:
    got, headers, body = reply
    assert got == status, (got, body)
    assert isinstance(body, dict) and body["error_type"] == code and body["error"], body
    assert headers["content-type"] == "application/json"


def test_qa_answers_as_the_model_does(http: tuple[str, int], tiny_model_dir: Path) -> None:
    reference = Reference(tiny_model_dir)
    for question, context in zip(QUESTIONS, CONTEXTS):
        status, _, body = request(http, "POST", "/qa", {"inputs": {"question": question,
                                                                   "context": context}})
        assert status == 200
        assert_same_answer(body, reference.answer(question, context), context)


def test_qa_top_k_gives_that_many_answers_best_first(http: tuple[str, int]) -> None:
    _, _, one = request(http, "POST", "/qa", QA_BODY)
    status, _, three = request(http, "POST", "/qa", {**QA_BODY, "parameters": {"top_k": 3}})
    assert status == 200 and len(three) == 3 and three[0] == one
    assert [a["score"] for a in three] == sorted((a["score"] for a in three), reverse=True)


def test_a_pipeline_parameter_the_server_owns_is_refused_by_name(http: tuple[str, int]) -> None:
    reply = request(http, "POST", "/qa", {**QA_BODY, "parameters": {"doc_stride": 64}})
    assert_error(reply, 422, "bad_request")
    assert "doc_stride" in reply[2]["error"] and "--doc_stride" in reply[2]["error"]
    assert_error(request(http, "POST", "/qa", {**QA_BODY, "parameters": {"nope": 1}}),
                 422, "bad_request")


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b'{"inputs": {"question": "a"', b"[" * 2000,
                                 b"", b"null x"],
                         ids=["not utf-8", "truncated", "nested 2000 deep", "empty", "trailing"])
def test_a_body_that_is_not_json_is_400(http: tuple[str, int], raw: bytes) -> None:
    assert_error(request(http, "POST", "/qa", raw=raw), 400, "bad_request")


def test_valid_json_with_wrong_fields_is_422(http: tuple[str, int]) -> None:
    for body in ([1, 2], {"inputs": "text"}, {"inputs": {"question": "", "context": "c"}},
                 {"inputs": {"question": "q", "context": 3}}, {"inputs": [QA_BODY["inputs"]] * 5}):
        assert_error(request(http, "POST", "/qa", body), 422, "bad_request")


def test_a_wrong_content_type_is_415(http: tuple[str, int]) -> None:
    reply = request(http, "POST", "/qa", QA_BODY,
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(reply, 415, "unsupported_media_type")


def test_a_head_over_64_kib_is_431_and_closed(http: tuple[str, int]) -> None:
    with connect(http) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: t\r\n")
        for n in range(80):  # 80 headers of 1 KiB
            sock.sendall(b"x-filler-%d: %s\r\n" % (n, b"y" * 1024))
        sock.sendall(b"\r\n")
        assert_error(read_responses(sock, 1)[0], 431, "head_too_large")
        assert closed(sock)


def test_bytes_that_are_not_http_get_a_json_400_and_close(http: tuple[str, int]) -> None:
    with connect(http) as sock:
        sock.sendall(b"\x16\x03\x01 hello, not http\r\n\r\n")
        assert_error(read_responses(sock, 1)[0], 400, "protocol_error")
        assert closed(sock)


def test_forty_pipelined_requests_are_all_answered_in_order(http: tuple[str, int]) -> None:
    """Reading pauses while 16 wait, and resumes as they are answered: none is lost."""
    paths = [f"/v2/models/nope{n}/ready" if n % 2 else "/health/live" for n in range(40)]
    with connect(http) as sock:
        sock.sendall(b"".join(b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % p.encode()
                              for p in paths))
        replies = read_responses(sock, 40)
    assert [status for status, _, _ in replies] == [404 if n % 2 else 200 for n in range(40)]


def test_an_error_before_the_body_is_read_closes_the_connection(http: tuple[str, int]) -> None:
    alive = {"connection": "keep-alive"}
    reply = request(http, "POST", "/qa", QA_BODY, headers={**alive, "content-type": "text/plain"})
    assert reply[0] == 415 and reply[1]["connection"] == "close"
    reply = request(http, "POST", "/nope", QA_BODY, headers=alive)
    assert reply[0] == 404 and reply[1]["connection"] == "close"
    reply = request(http, "GET", "/health/live", headers=alive)
    assert reply[0] == 200 and reply[1].get("connection") != "close"


def test_unknown_route_is_404_and_wrong_method_405(http: tuple[str, int]) -> None:
    assert_error(request(http, "GET", "/nope"), 404, "not_found")
    assert_error(request(http, "POST", "/v2/models/nope/infer", {}), 404, "not_found")
    reply = request(http, "GET", "/qa")
    assert_error(reply, 405, "method_not_allowed")
    assert reply[1]["allow"] == "POST"


def test_a_body_over_the_limit_is_413_before_it_is_sent(http: tuple[str, int]) -> None:
    with connect(http) as sock:  # the head alone: the answer comes without the body
        sock.sendall(b"POST /qa HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n")
        assert_error(read_responses(sock, 1)[0], 413, "frame_too_large")


def test_a_chunked_body_is_refused_413_as_it_passes_the_limit(http: tuple[str, int]) -> None:
    with connect(http) as sock:
        sock.sendall(b"POST /qa HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * 1000
        for _ in range(5):  # 5000 bytes against a 4096-byte limit
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert_error(read_responses(sock, 1)[0], 413, "frame_too_large")


def test_pipelined_requests_are_answered_in_order(http: tuple[str, int]) -> None:
    bodies = [json.dumps({"inputs": {"question": q, "context": c}}).encode()
              for q, c in zip(QUESTIONS[:3], CONTEXTS[:3])]
    data = b"".join(b"POST /qa HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(b), b) for b in bodies)
    data += b"GET /health/live HTTP/1.1\r\nhost: t\r\n\r\n"
    with connect(http) as sock:
        sock.sendall(data)
        replies = read_responses(sock, 4)
    assert [r[0] for r in replies] == [200, 200, 200, 200]
    for (_, _, body), context in zip(replies[:3], CONTEXTS[:3]):
        assert context[body["start"]:body["end"]] == body["answer"]
    assert replies[3][2] == {"status": "live"}


def test_http_1_0_is_answered_and_closed(http: tuple[str, int]) -> None:
    with connect(http) as sock:
        sock.sendall(b"GET /health/live HTTP/1.0\r\n\r\n")
        status, _, body = read_responses(sock, 1)[0]
        assert status == 200 and body == {"status": "live"}
        assert closed(sock)


def test_a_head_sent_a_byte_at_a_time_is_cut_off_with_408(http: tuple[str, int]) -> None:
    head = b"POST /qa HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    with connect(http, timeout=10) as sock:
        started = time.monotonic()
        for byte in head:  # frame_timeout is 1 s: the head never completes in time
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - started > 3:
                break
        assert_error(read_responses(sock, 1)[0], 408, "frame_timeout")


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(
        http: tuple[str, int]) -> None:
    with connect(http, timeout=10) as sock:
        started = time.monotonic()
        assert closed(sock)
        assert 1.5 < time.monotonic() - started < 8


def test_connections_past_the_cap_get_429_and_the_others_are_served(
        http: tuple[str, int]) -> None:
    held = [connect(http) for _ in range(8)]  # the cap
    try:
        time.sleep(0.2)
        reply = request(http, "GET", "/health/live")
        assert_error(reply, 429, "too_many_connections")
        assert reply[1]["retry-after"] and reply[1]["connection"] == "close"
        held[0].sendall(b"GET /health/live HTTP/1.1\r\nhost: t\r\n\r\n")
        assert read_responses(held[0], 1)[0][0] == 200
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)


def test_a_deadline_from_the_header_is_checked(http: tuple[str, int]) -> None:
    assert_error(request(http, "POST", "/qa", QA_BODY, headers={"x-timeout-ms": "0"}),
                 422, "bad_request")
    status, _, _ = request(http, "POST", "/qa", QA_BODY, headers={"x-timeout-ms": "60000"})
    assert status == 200


def test_native_op_route_gives_the_tcp_result(http: tuple[str, int],
                                              server: InferenceServer) -> None:
    from client import Client

    fields = {"question": QUESTIONS[1], "context": CONTEXTS[1]}
    status, _, body = request(http, "POST", "/ops/qa", fields)
    with Client(*server.address) as tcp:
        assert status == 200 and body == tcp.answer(fields["question"], fields["context"])
    assert_error(request(http, "POST", "/ops/embed", {"texts": ["a"]}), 404, "not_found")


def test_a_client_that_leaves_is_answered_nothing_and_harms_nobody(
        http: tuple[str, int]) -> None:
    body = json.dumps(QA_BODY).encode()
    for _ in range(5):
        sock = socket.create_connection(http)
        sock.sendall(b"POST /qa HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        sock.close()
