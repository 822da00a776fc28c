"""clients/aio.py, AsyncClient: pipelining, cancellation, typed errors and lost connections,
against a real server on 127.0.0.1 (tiny real models) or a fake peer on a raw socket.

pytest-asyncio is not a dependency: each test runs its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from client import AsyncClient, Client, ConnectionLost
from engines import load_engine
from protocol import (
    BadRequest,
    DeadlineExceeded,
    FrameDecoder,
    ShuttingDown,
    encode_frame,
    ok_reply,
)
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, GatedEngine, Reference
from tests.text_models import TINY_LABELS, build_tiny_classify_dir, build_tiny_embed_dir

T = TypeVar("T")
PAIRS = [(q, c if k == 0 else f"{c} {CONTEXTS[(i + k) % 6]}")
         for i, c in enumerate(CONTEXTS) for q in QUESTIONS for k in range(2)]  # 72 pairs


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 240) -> T:
    """Run ``coroutine`` on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


def assert_same_answer(result: dict[str, Any], expected: dict[str, Any]) -> None:
    assert (result["answer"], result["start"], result["end"]) == (
        expected["answer"], expected["start"], expected["end"])
    assert result["score"] == pytest.approx(expected["score"], rel=1e-3, abs=1e-6)


def assert_same_vectors(got: list[list[float]], expected: list[list[float]]) -> None:
    assert len(got) == len(expected)
    for vector, want in zip(got, expected, strict=True):
        assert vector == pytest.approx(want, abs=1e-5)


def assert_same_label(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["label"] == expected["label"] and got["label"] in TINY_LABELS
    assert got["score"] == pytest.approx(expected["score"], abs=1e-5)
    assert got["scores"] == pytest.approx(expected["scores"], abs=1e-5)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, max_queue=2048)
    with InferenceServer(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture()
def listener() -> Iterator[socket.socket]:
    """A listening socket on 127.0.0.1 that a test's fake peer accepts from."""
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


@pytest.fixture()
def gated(tiny_model_dir: Path) -> Iterator[tuple[InferenceServer, GatedEngine]]:
    """One session, no batching; the engine's gate closed once the server serves."""
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, batching="off")
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        engine.gate.clear()
        yield srv, engine
        engine.gate.set()


def ok_count(srv: InferenceServer) -> int:
    return srv.stats.snapshot()["requests"].get("qa", {}).get("ok", 0)


async def hold_the_session(client: AsyncClient, engine: GatedEngine) -> asyncio.Task[Any]:
    """Ask once and wait until the only session is stuck running it; returns the await."""
    calls = engine.calls
    held = asyncio.ensure_future(client.answer(QUESTIONS[0], CONTEXTS[0], timeout=60))
    await until(lambda: engine.calls > calls)
    return held


# -- pipelining --------------------------------------------------------------------------------
def test_a_thousand_requests_pipelined_on_one_connection_each_get_their_own_answer(
        server: InferenceServer, reference: Reference) -> None:
    expected = [reference.answer(q, c) for q, c in PAIRS]
    rng = random.Random(14)
    plan = [rng.randrange(len(PAIRS)) for _ in range(1000)]

    async def ask() -> list[dict[str, Any]]:
        async with AsyncClient(*server.address) as client:
            # even: a Future from submit; odd: an answer() coroutine, each draining on its own
            waits = [client.submit(*PAIRS[p], timeout_ms=120_000) if n % 2 == 0
                     else client.answer(*PAIRS[p], timeout=120) for n, p in enumerate(plan)]
            results = await asyncio.gather(*waits)
            assert client.in_flight == 0 and client.dropped_replies == 0
            return results

    results = run(ask())
    assert len(results) == 1000
    for p, result in zip(plan, results, strict=True):
        assert_same_answer(result, expected[p])


def test_control_ops_answer_on_the_same_connection(server: InferenceServer) -> None:
    async def ask() -> None:
        client = await AsyncClient.connect(*server.address, connect_timeout=5)
        try:
            assert (await client.ping(timeout=30))["pong"] is True
            assert (await client.stats(timeout=30))["requests"]["qa"]["ok"] >= 0
            [model] = await client.models(timeout=30)
            assert model["task"] == "qa" and not model["meaningful"]
        finally:
            await client.close()
        with pytest.raises(ConnectionLost):
            client.submit(QUESTIONS[0], CONTEXTS[0])

    run(ask())


# -- every task, through a model repository ---------------------------------------------------
@pytest.fixture(scope="module")
def repository_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[InferenceServer]:
    """A repository of three tiny real models, one per task: qa, emb and cls."""
    root = tmp_path_factory.mktemp("aio_repository")
    shutil.copytree(tiny_model_dir, root / "qa")
    build_tiny_embed_dir(root / "emb")
    build_tiny_classify_dir(root / "cls")
    config = ServerConfig(port=0, model_dir=str(root), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv:
        yield srv


def test_embed_classify_and_any_op_through_a_repository_match_the_blocking_client(
        repository_server: InferenceServer) -> None:
    texts = [CONTEXTS[0], QUESTIONS[0], CONTEXTS[3]]
    with Client(*repository_server.address) as blocking:
        vectors = blocking.embed(texts, timeout=30)
        labels = [blocking.classify(text, timeout=30) for text in texts]

    async def ask() -> None:
        async with AsyncClient(*repository_server.address) as client:
            models = {m["name"]: m["task"] for m in await client.models(timeout=30)}
            assert models == {"qa": "qa", "emb": "embed", "cls": "classify"}
            got = await client.embed(texts, model="emb", timeout=30)
            assert len(got) == 3 and all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)
                                         for v in got)
            assert_same_vectors(got, vectors)
            label = await client.classify(texts[0], timeout=30)  # the only classify model
            assert_same_label(label, labels[0])
            assert_same_label(await client.call("classify", {"text": texts[1]}, model="cls",
                                                timeout=30), labels[1])
            mixed = await asyncio.gather(  # every task pipelined on the one connection
                *(client.submit_embed([t], model="emb") for t in texts),
                *(client.submit_classify(t) for t in texts),
                client.submit(QUESTIONS[4], CONTEXTS[4], model="qa"))
            assert_same_vectors([m["embeddings"][0] for m in mixed[:3]], vectors)
            for got_label, want in zip(mixed[3:6], labels, strict=True):
                assert_same_label(got_label, want)
            assert mixed[6]["end"] > 0
            with pytest.raises(BadRequest, match="classify"):
                await client.embed(texts, model="cls", timeout=30)  # another task's model

    run(ask())


# -- cancellation ------------------------------------------------------------------------------
def test_cancelled_awaits_leave_the_connection_in_sync_and_their_replies_are_dropped(
        gated: tuple[InferenceServer, GatedEngine], reference: Reference) -> None:
    srv, engine = gated

    async def ask() -> None:
        async with AsyncClient(*srv.address) as client:
            held = await hold_the_session(client, engine)
            tasks = [asyncio.ensure_future(client.answer(QUESTIONS[i], CONTEXTS[i], timeout=60))
                     for i in range(1, 6)]
            futures = [client.submit(QUESTIONS[i], CONTEXTS[i]) for i in range(1, 6)]
            await until(lambda: len(srv.backend.queue) == 10)  # all ten wait on the server
            for waiting in (*tasks, *futures):
                waiting.cancel()
            outcomes = await asyncio.gather(*tasks, *futures, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
            assert client.in_flight == 1  # only the held request is still tracked
            engine.gate.set()
            assert_same_answer(await held, reference.answer(QUESTIONS[0], CONTEXTS[0]))
            later = await asyncio.gather(*(client.answer(q, c, timeout=60) for q, c in PAIRS))
            for (q, c), result in zip(PAIRS, later, strict=True):
                assert_same_answer(result, reference.answer(q, c))
            await until(lambda: client.dropped_replies == 10)  # answered, and dropped quietly
            assert ok_count(srv) == 1 + 10 + len(PAIRS)  # the server ran every one of them
            assert client.in_flight == 0 and (await client.ping(timeout=30))["pong"]

    run(ask())


def test_cancelling_while_the_socket_is_full_never_tears_a_frame(
        listener: socket.socket) -> None:
    """A peer that does not read: writes back up past the transport's high-water mark, so the
    awaits sit in drain (or queue for it) when they are cancelled. The peer then reads every
    byte: whole frames, ids in order, and the stream still carries a later request."""
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    context = "x" * 200_000
    count = 50  # 10 MB: more than the kernel's socket buffers take

    def peer_reads_and_answers(peer: socket.socket) -> list[int]:
        decoder, ids = FrameDecoder(max_frame_size=1 << 21), []
        while len(ids) < count + 1:
            decoder.receive_data(peer.recv(1 << 20))
            while (message := decoder.next_message()) is not None:
                assert message["context"] == (context if len(ids) < count else "Bob went home.")
                ids.append(message["id"])
        peer.sendall(b"".join(encode_frame(ok_reply(rid, {"answer": f"#{rid}"})) for rid in ids))
        return ids

    async def ask() -> None:
        client = await AsyncClient.connect(*listener.getsockname()[:2])
        peer, _ = listener.accept()  # already queued in the backlog: returns at once
        stuck = [asyncio.ensure_future(client.answer("Who?", context, timeout=60))
                 for _ in range(count)]
        await asyncio.sleep(0.3)
        assert client._writer is not None
        assert client._writer.transport.get_write_buffer_size() > 1 << 20  # writing is paused
        assert not any(task.done() for task in stuck)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        assert client.in_flight == 0
        later = client.submit("Who?", "Bob went home.")
        ids = await asyncio.to_thread(peer_reads_and_answers, peer)
        assert ids == list(range(1, count + 2))
        assert await asyncio.wait_for(later, 30) == {"answer": f"#{count + 1}"}
        await until(lambda: client.dropped_replies == count)
        await client.close()
        peer.close()

    run(ask())


# -- typed errors ------------------------------------------------------------------------------
def test_server_errors_are_raised_typed_and_fail_only_their_request(
        server: InferenceServer) -> None:
    async def ask() -> None:
        async with AsyncClient(*server.address) as client:
            with pytest.raises(BadRequest) as empty:
                await client.answer("", CONTEXTS[0], timeout=30)
            assert empty.value.code == "bad_request" and "question" in empty.value.message
            with pytest.raises(BadRequest, match="nope"):
                await client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30, model="nope")
            with pytest.raises(TypeError):
                client.submit_embed("one string, not a list")
            assert (await client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30))["end"] > 0

    run(ask())


def test_a_request_whose_deadline_passes_in_the_queue_gets_deadline_exceeded(
        gated: tuple[InferenceServer, GatedEngine]) -> None:
    srv, engine = gated

    async def ask() -> None:
        async with AsyncClient(*srv.address) as client:
            held = await hold_the_session(client, engine)
            with pytest.raises(DeadlineExceeded) as late:
                await client.wait(client.submit(QUESTIONS[1], CONTEXTS[1], timeout_ms=50), 30)
            assert late.value.code == "deadline_exceeded"
            engine.gate.set()
            assert (await held)["end"] > 0

    run(ask())


def test_a_timed_out_await_sends_the_deadline_and_forgets_the_request(
        listener: socket.socket) -> None:

    async def ask() -> None:
        client = await AsyncClient.connect(*listener.getsockname()[:2])
        peer, _ = listener.accept()
        with pytest.raises(TimeoutError):
            await client.answer("Who?", "Bob.", timeout=0.2)  # the fake peer never answers
        assert client.in_flight == 0
        decoder = FrameDecoder()
        decoder.receive_data(await asyncio.to_thread(peer.recv, 4096))
        assert decoder.next_message()["timeout_ms"] == 200
        await client.close()
        peer.close()

    run(ask())


# -- lost connections --------------------------------------------------------------------------
def test_pending_and_later_requests_fail_with_connection_lost_when_the_peer_closes(
        listener: socket.socket) -> None:

    async def ask() -> None:
        client = await AsyncClient.connect(*listener.getsockname()[:2])
        peer, _ = listener.accept()
        pending = client.submit("Who?", "Bob.")
        await asyncio.to_thread(peer.recv, 1024)  # the request arrived
        peer.close()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(ConnectionLost):
            client.submit("Who?", "Bob.")
        await client.close()

    run(ask())


def test_a_server_that_stops_fails_what_it_never_answered_with_connection_lost(
        tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          batching="off")
    srv = InferenceServer(config, engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()

    async def ask() -> None:
        client = await AsyncClient.connect(*srv.address)
        held = await hold_the_session(client, engine)  # stuck in the engine past the stop
        queued = [client.submit(QUESTIONS[i], CONTEXTS[i]) for i in (1, 2)]
        await until(lambda: len(srv.backend.queue) == 2)
        assert await asyncio.to_thread(srv.shutdown, 0.3) is False
        for refused in queued:
            with pytest.raises(ShuttingDown):
                await refused
        with pytest.raises(ConnectionLost):
            await held
        with pytest.raises(ConnectionLost):
            await client.ping()
        await client.close()

    try:
        run(ask())
    finally:
        engine.gate.set()


def test_connecting_to_nothing_raises_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        with pytest.raises(ConnectionRefusedError):
            run(AsyncClient.connect(*s.getsockname()[:2]))


def test_closing_with_requests_a_server_never_read_returns_at_once() -> None:
    """close() drops what the socket still holds, instead of waiting for a peer that never
    reads (it used to wait forever, and an ``async with`` with it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        async def scenario() -> float:
            client = await AsyncClient.connect(*listener.getsockname())
            context = "word " * 150_000  # 750 KB: a few of them fill the socket buffers
            for _ in range(8):
                with pytest.raises(TimeoutError):
                    await client.answer("Who?", context, timeout=0.2)
            started = time.monotonic()
            await client.close()
            return time.monotonic() - started

        took = run(scenario(), timeout=60)
    assert took < 3, f"close() took {took:.1f} s"  # not its 5 s wait for the peer
