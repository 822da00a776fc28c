"""Admission control, deadlines and fault isolation, over real sockets with a tiny real model.

Most tests hold the engine with a gate, so what waits in the queue is known exactly.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Client
from engines import load_engine
from engines.base import Engine
from protocol import encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    GatedEngine,
    RawConnection,
    header,
    nan_model_dir,
    wait_until,
)


def frames(*messages: dict[str, Any]) -> bytes:
    return b"".join(encode_frame(m) for m in messages)


def qa(rid: int, **extra: Any) -> dict[str, Any]:
    return {**qa_request(rid, QUESTIONS[rid % 6], CONTEXTS[rid % 6]), **extra}


@pytest.fixture()
def gated(tiny_model_dir: Path) -> Iterator[tuple[InferenceServer, GatedEngine]]:
    """One session, no batching, a queue of 4 and a 300 ms default deadline; gate closed."""
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          batching="off", max_queue=4, request_timeout_ms=300)
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        engine.gate.clear()
        yield srv, engine
        engine.gate.set()


def hold_the_session(srv: InferenceServer, engine: GatedEngine, conn: RawConnection) -> None:
    """Send request 0 and wait until the session is stuck running it: the queue is then empty."""
    calls = engine.calls
    conn.send(qa(0, timeout_ms=60_000))
    wait_until(lambda: engine.calls > calls)


def outcomes(srv: InferenceServer) -> dict[str, int]:
    return srv.stats.snapshot()["requests"].get("qa", {})


def test_beyond_the_queue_bound_requests_get_overloaded_at_once(gated: Any) -> None:
    srv, engine = gated
    conn = RawConnection(srv.address)
    hold_the_session(srv, engine, conn)
    conn.send_raw(frames(*(qa(rid, timeout_ms=60_000) for rid in range(1, 8)),
                         qa(8, question="?" * 990)))  # under the cap, too long for the model
    refused = conn.recv_replies(4)  # answered while the engine is still held
    assert set(refused) == {5, 6, 7, 8}
    assert {r["error"]["code"] for r in refused.values()} == {"overloaded"}  # before tokenizing
    assert "max_queue" in refused[5]["error"]["message"]
    assert len(srv.backend.queue) == 4
    engine.gate.set()
    answered = conn.recv_replies(5)
    assert set(answered) == {0, 1, 2, 3, 4} and all(r["ok"] for r in answered.values())
    assert outcomes(srv) == {"ok": 5, "overloaded": 4}
    assert srv.stats.snapshot()["in_flight"] == 0
    conn.close()


def test_a_request_past_its_deadline_in_the_queue_fails_and_never_runs(gated: Any) -> None:
    srv, engine = gated
    conn = RawConnection(srv.address)
    hold_the_session(srv, engine, conn)
    conn.send_raw(frames(qa(1, timeout_ms=50),  # its own short deadline
                         qa(2),  # the server's default: 300 ms
                         qa(3, timeout_ms=60_000)))  # a long one overrides the default
    expired = conn.recv_replies(2)  # both expire while no session is free
    assert set(expired) == {1, 2}
    assert {r["error"]["code"] for r in expired.values()} == {"deadline_exceeded"}
    assert "not run" in expired[1]["error"]["message"]
    rows_before = engine.rows_run
    engine.gate.set()
    answered = conn.recv_replies(2)
    assert set(answered) == {0, 3} and all(r["ok"] for r in answered.values())
    assert engine.rows_run - rows_before == 2  # requests 0 and 3, one window each: 1, 2 never ran
    wait_until(lambda: outcomes(srv) == {"ok": 2, "deadline_exceeded": 2})
    conn.close()


def test_a_client_that_leaves_has_its_queued_requests_dropped_before_the_engine(
        gated: Any) -> None:
    srv, engine = gated
    leaving = RawConnection(srv.address)
    hold_the_session(srv, engine, leaving)
    leaving.send_raw(frames(*(qa(rid, timeout_ms=60_000) for rid in range(1, 4))))
    wait_until(lambda: len(srv.backend.queue) == 3)
    # gone for good (a reset): a plain FIN would read as a half-close, which still gets replies
    leaving.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    leaving.close()
    wait_until(lambda: outcomes(srv).get("client_gone") == 3)  # purged at once, engine still held
    assert len(srv.backend.queue) == 0
    calls = engine.calls
    engine.gate.set()
    with Client(*srv.address) as client:
        assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["end"] > 0
    assert engine.calls == calls + 1  # only the healthy client's request ran after the gate
    wait_until(lambda: srv.stats.snapshot()["in_flight"] == 0)


def test_work_still_queued_when_the_shutdown_timeout_runs_out_is_refused(
        tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          batching="off")
    srv = InferenceServer(config, engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()
    conn = RawConnection(srv.address)
    hold_the_session(srv, engine, conn)
    conn.send_raw(frames(qa(1), qa(2)))
    wait_until(lambda: len(srv.backend.queue) == 2)
    assert srv.shutdown(timeout=0.3) is False  # request 0 is stuck in the engine
    replies = conn.recv_replies(2)
    assert {r["error"]["code"] for r in replies.values()} == {"shutting_down"}
    assert conn.recv_message() is None
    engine.gate.set()
    conn.close()


class PoisonedEngine(Engine):
    """A real engine that fails on batches holding a chosen token: with ``error`` (an Exception:
    the batch fails) or with a BaseException (the session thread dies)."""

    def __init__(self, inner: Engine, poison: int, error: BaseException) -> None:
        self.inner, self.poison, self.error = inner, poison, error
        self.input_names, self.name = inner.input_names, "poisoned"

    def run(self, feeds: Any) -> dict[str, Any]:
        if (feeds["input_ids"] == self.poison).any():
            raise self.error
        return self.inner.run(feeds)


class SessionKiller(BaseException):
    """Escapes ``except Exception``: kills the session thread that meets it."""


def poisoned_server(model_dir: Path, error: BaseException,
                    factory_calls: list[int]) -> InferenceServer:
    from tasks.qa import QATask

    poison = QATask.from_dir(model_dir).tokenizer.convert_tokens_to_ids("explode")

    def factory() -> Engine:
        factory_calls.append(1)
        return PoisonedEngine(load_engine("onnx", model_dir, threads=1), poison, error)

    config = ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                          batching="off")
    return InferenceServer(config, engine_factory=factory)


def test_an_engine_failing_on_chosen_batches_fails_only_those_requests(
        tiny_model_dir: Path) -> None:
    with poisoned_server(tiny_model_dir, RuntimeError("boom"), calls := []) as srv:
        conn = RawConnection(srv.address)
        texts = ["Ann met Bob.", "It will explode soon.", "Rain fell.", "explode", "At noon."]
        conn.send_raw(frames(*(qa_request(i, "Who?", t) for i, t in enumerate(texts))))
        replies = conn.recv_replies(len(texts))
        codes = {i: r["error"]["code"] if not r["ok"] else "ok" for i, r in replies.items()}
        assert codes == {0: "ok", 1: "engine_error", 2: "ok", 3: "engine_error", 4: "ok"}
        assert "boom" in replies[1]["error"]["message"]
        assert len(calls) == 1 and srv.ready  # the same session, still serving
        conn.close()


def test_a_session_that_dies_is_replaced_and_the_server_keeps_answering(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with poisoned_server(tiny_model_dir, SessionKiller(), calls := []) as srv:
        with Client(*srv.address) as client:
            doomed = client.submit("Who?", "It will explode soon.")
            with pytest.raises(Exception) as info:
                doomed.result(timeout=30)
            assert getattr(info.value, "code", None) == "internal"
            wait_until(lambda: srv.ready)  # a new session with a new engine
            assert len(calls) == 2
            assert client.answer("Who?", "Ann met Bob.", timeout=30)["end"] > 0
        assert srv.stats.snapshot()["events"]["session_restart"] == 1
    assert "session-0 died" in caplog.text and "SessionKiller" in caplog.text


@pytest.mark.parametrize("workers", [1, 2])
def test_nan_logits_fail_only_their_own_requests_with_an_engine_error(
        tiny_model_dir: Path, tmp_path: Path, workers: int) -> None:
    model_dir = nan_model_dir(tiny_model_dir, tmp_path / "nan_model")
    config = ServerConfig(port=0, model_dir=str(model_dir), workers=workers,
                          num_inference_sessions=1, threads_per_session=1, max_batch_size=8)
    with InferenceServer(config) as srv:
        conn = RawConnection(srv.address)
        texts = ["Ann met Bob.", "It will explode soon.", "Rain fell.", "explode", "At noon."]
        requests = [qa_request(i, "Who?", t) for i, t in enumerate(texts)]
        requests.append(qa_request(5, "Will it explode?", "Rain fell."))  # a question token
        conn.send_raw(frames(*requests))  # pipelined: they may share batches
        replies = conn.recv_replies(len(requests))
        codes = {i: r["error"]["code"] if not r["ok"] else "ok" for i, r in replies.items()}
        assert codes == {0: "ok", 1: "engine_error", 2: "ok", 3: "engine_error", 4: "ok",
                         5: "ok"}
        assert "logits for this request hold NaN or infinite values" in \
            replies[1]["error"]["message"]
        conn.close()
        with Client(*srv.address) as client:
            assert client.answer("Who?", "Ann met Bob.", timeout=30)["answer"]
            assert client.stats(timeout=30)["requests"]["qa"]["engine_error"] == 2
        assert srv.ready


def test_field_caps_give_bad_request_naming_the_limit(tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          max_question_chars=20, max_context_chars=100)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        for question, context, limit in (("Who? " * 5, "Bob.", "max_question_chars"),
                                         ("Who?", "Bob. " * 30, "max_context_chars")):
            with pytest.raises(Exception, match=limit) as info:
                client.answer(question, context, timeout=30)
            assert getattr(info.value, "code", None) == "bad_request"
        assert client.answer("Who?", "Bob. " * 20, timeout=30)["answer"]  # at the caps: fine


def test_a_client_that_never_reads_does_not_stall_the_sessions(tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          send_timeout_s=120)
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        engine.gate.clear()
        stuck = RawConnection(srv.address)
        stuck.send_raw(frames(*(qa(rid) for rid in range(50))))
        wait_until(lambda: srv.stats.admitted == 50)
        # ~1.5 KB stats replies the client does not read: its socket fills, replies wait in the
        # server's outbox, and the reader stops reading its requests once that is over 1 MiB
        stats_frames = frames(*({"id": 1000 + i, "op": "stats"} for i in range(6000)))
        writer = threading.Thread(target=stuck.send_raw, args=(stats_frames,), daemon=True)
        writer.start()
        (conn,) = srv.connections
        wait_until(lambda: conn._writer is not None)  # the socket is full: the outbox is in use
        engine.gate.set()  # now the session answers 50 requests into a full socket
        with Client(*srv.address) as healthy:
            assert healthy.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["end"] > 0
        replies = stuck.recv_replies(6050)  # it reads at last: everything arrives, in one piece
        assert all(replies[rid]["ok"] for rid in range(50))
        writer.join(30)
        stuck.close()


def test_a_client_that_never_reads_is_disconnected_after_the_send_timeout(
        tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          send_timeout_s=0.5)
    with InferenceServer(config) as srv:
        stuck = RawConnection(srv.address)
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer = threading.Thread(
            target=lambda: _send_ignoring_errors(stuck, frames(*(
                {"id": i, "op": "stats"} for i in range(5000)))), daemon=True)
        writer.start()
        wait_until(lambda: srv.stats.snapshot()["events"]["send_timeout"] == 1)
        wait_until(lambda: srv.stats.snapshot()["connections_open"] == 0)
        with Client(*srv.address) as healthy:
            assert healthy.ping(timeout=10)["ready"] is True
        stuck.close()
        writer.join(30)


def test_a_client_leaving_more_than_max_outbox_unread_is_disconnected(tmp_path: Path) -> None:
    """Replies to requests admitted before the reader paused still join the outbox; large ones
    (embed: texts x dim floats) are capped by --max_outbox_mb, not held without bound."""
    from tests.text_models import build_tiny_embed_dir

    embed_dir = build_tiny_embed_dir(tmp_path / "embed")
    engine = GatedEngine(load_engine("onnx", embed_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(embed_dir), num_inference_sessions=1,
                          max_outbox_mb=1, send_timeout_s=120)
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        engine.gate.clear()
        stuck = RawConnection(srv.address)
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # 200 replies of 256 vectors of 32 floats, about 75 KB each: 15 MB, admitted at once;
        # more than the socket buffers (a few MB on loopback) and the 1 MiB cap together
        stuck.send_raw(frames(*({"id": i, "op": "embed", "texts": ["a b c"] * 256}
                                for i in range(200))))
        wait_until(lambda: srv.stats.admitted == 200)
        engine.gate.set()
        wait_until(lambda: srv.stats.snapshot()["events"]["outbox_overflow"] == 1)
        wait_until(lambda: srv.stats.snapshot()["connections_open"] == 0)
        wait_until(lambda: srv.stats.in_flight == 0)  # the rest: dropped, its client gone
        assert srv.stats.snapshot()["events"]["send_timeout"] == 0  # the overflow, not a timeout
        with Client(*srv.address) as healthy:
            assert healthy.ping(timeout=10)["ready"] is True
        stuck.close()


def _send_ignoring_errors(conn: RawConnection, data: bytes) -> None:
    try:
        conn.send_raw(data)
    except OSError:
        pass


def test_after_a_fatal_error_nothing_more_is_sent_or_run_for_that_connection(
        gated: Any) -> None:
    srv, engine = gated
    conn = RawConnection(srv.address)
    hold_the_session(srv, engine, conn)
    conn.send(qa(1, timeout_ms=60_000))
    wait_until(lambda: len(srv.backend.queue) == 1)
    conn.send_raw(header(5) + b"\xc1" * 5)  # not msgpack: fatal
    error = conn.recv_message()
    assert error is not None and error["id"] is None and error["error"]["code"] == "protocol_error"
    engine.gate.set()
    assert conn.recv_message() is None  # request 0's reply is not sent after the fatal error
    wait_until(lambda: outcomes(srv).get("client_gone") == 1)  # request 1 never ran
    conn.close()


def test_shutdown_delivers_replies_still_waiting_for_a_slow_clients_socket(
        tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          send_timeout_s=120)
    srv = InferenceServer(config, engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()
    slow = RawConnection(srv.address)
    slow.send_raw(frames(*(qa(rid) for rid in range(50))))
    wait_until(lambda: srv.stats.admitted == 50)
    done = threading.Event()

    def keep_sending() -> None:  # a client that sends on and on: unread input at any close
        burst = frames(*({"id": 1000 + i, "op": "stats"} for i in range(100)))
        try:
            while not done.is_set():
                slow.send_raw(burst)
        except OSError:
            pass  # the server closed after this client had every reply

    writer = threading.Thread(target=keep_sending, daemon=True)
    writer.start()
    (conn,) = srv.connections
    wait_until(lambda: conn._writer is not None)  # its socket is full: replies wait in the outbox
    stopper = threading.Thread(target=srv.shutdown)
    stopper.start()
    wait_until(lambda: not srv.ready)
    engine.gate.set()  # the 50 answers go behind the stats replies, into the outbox
    wait_until(lambda: not any(s.is_alive() for s in srv.backend.pool.sessions))
    ids = set()
    # read at last, while shutting down, and slowly: the server must not close (and reset the
    # connection, destroying replies in flight) before this client has received every reply
    while (reply := slow.recv_message(pace_s=0.002)) is not None:
        ids.add(reply["id"])
    assert set(range(50)) <= ids  # none dropped at close
    done.set()
    stopper.join(60)
    assert not stopper.is_alive()
    writer.join(30)
    slow.close()
