"""--broker across stops and losses found in review: a front end's drain, its reply stream
vanishing, a dead worker's entries claimed at the survivor's pace, a worker of the wrong task, a
worker that cannot hand back its last replies. Real redis-server, real worker processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.local_server import RedisServer
from client import Client
from protocol import encode_frame, qa_request
from tests.broker_fixtures import front_end, start_worker, stop_worker, wait_serving
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, wait_until
from tests.test_broker_failures import freeze_holding_work


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def pipelined(total: int, timeout_ms: float | None = None) -> bytes:
    return b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 4,
                                            timeout_ms=timeout_ms)) for i in range(total))


def test_a_front_end_stopping_answers_what_its_workers_still_run(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    """scaling.md: a front end stops (SIGTERM): every admitted request answered (its reply
    thread used to stop at once, so they waited out the timeout as shutting_down)."""
    worker = start_worker(broker.url, tiny_model_dir)
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 1)
        total = 200  # enough that the worker still holds some when we look
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(pipelined(total))
        freeze_holding_work(broker, worker.pid)
        wait_until(lambda: front.stats.admitted == total)  # all admitted before the stop
        outcome: list[bool] = []
        stopping = threading.Thread(target=lambda: outcome.append(front.shutdown(30)))
        stopping.start()
        wait_until(lambda: not front.ready, 30)  # the stop has begun, work in the worker's hands
        os.kill(worker.pid, signal.SIGCONT)
        replies = conn.recv_replies(total)
        stopping.join(60)
        assert all(reply.get("error") is None for reply in replies.values()), \
            [r["error"] for r in replies.values() if r.get("error")][:3]
        assert outcome == [True]
        conn.close()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        front.shutdown(10)
        stop_worker(worker)


def test_a_reply_stream_that_vanishes_is_made_again(broker: RedisServer,
                                                    tiny_model_dir: Path) -> None:
    """Expired in a pause longer than its TTL, or evicted: workers never create it, so every
    reply was dropped while ping said ready."""
    worker = start_worker(broker.url, tiny_model_dir)
    front = front_end(broker.url, tiny_model_dir)
    client = broker.client()
    try:
        wait_serving(front, 1)
        reply_key = front.backend.reply_key  # type: ignore[union-attr]
        client.delete(reply_key)
        wait_until(lambda: client.exists(reply_key) == 1, 30)
        wait_serving(front, 1)
        with Client(*front.address) as ask:
            assert ask.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["answer"]
    finally:
        front.shutdown(10)
        stop_worker(worker)


def test_a_dead_workers_entries_are_claimed_as_fast_as_the_survivor_has_room(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    """Claims went one pull (here 1 entry) per claim period (here 1 s): half of a dead
    worker's requests ran out of their deadline while the survivor sat idle."""
    victim = start_worker(broker.url, tiny_model_dir, "--batching", "fixed",
                          "--max_batch_size", "16")
    front = front_end(broker.url, tiny_model_dir)
    survivor = None
    try:
        wait_serving(front, 1)
        total = 96  # enough that the victim still holds some when we look
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(pipelined(total, timeout_ms=10_000))
        held = freeze_holding_work(broker, victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        survivor = start_worker(broker.url, tiny_model_dir, "--claim_idle_ms", "2000")
        replies = conn.recv_replies(total)
        late = [r["error"]["code"] for r in replies.values() if r.get("error")]
        assert held >= 8 and not late, (held, late)
        conn.close()
    finally:
        front.shutdown(10)
        victim.kill()
        victim.wait(10)
        if survivor is not None:
            stop_worker(survivor)


def test_a_worker_that_cannot_hand_back_its_replies_does_not_exit_zero(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    worker = start_worker(broker.url, tiny_model_dir)
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 1)
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(pipelined(200))  # enough that the worker still holds some when we look
        freeze_holding_work(broker, worker.pid)
        broker.stop()  # Redis gone while the worker holds work
        os.kill(worker.pid, signal.SIGCONT)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 1  # exit 0 means drained: every reply delivered
        conn.close()
    finally:
        os.kill(worker.pid, signal.SIGCONT) if worker.poll() is None else None
        front.shutdown(10)
        if worker.poll() is None:
            worker.kill()


def test_summed_batch_counters_do_not_go_back_when_a_worker_leaves(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    """They summed the live workers' heartbeats only: a worker gone took its batches along."""
    workers = [start_worker(broker.url, tiny_model_dir) for _ in range(2)]
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 2)
        with Client(*front.address) as client:
            for future in [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(60)]:
                future.result(timeout=60)
            # until the heartbeats (once a second each way) have carried every request's row
            wait_until(lambda: client.stats(timeout=30)["batch_rows"] == 60, 60)
            before = client.stats(timeout=30)["batches"]
            assert stop_worker(workers[0]) == 0
            wait_serving(front, 1)
            time.sleep(1.5)
            after = client.stats(timeout=30)["batches"]
        assert before > 0 and after >= before, (before, after)
    finally:
        front.shutdown(10)
        for worker in workers:
            if worker.poll() is None:
                stop_worker(worker)


def test_a_worker_never_claims_entries_its_own_queue_holds(broker: RedisServer,
                                                           tiny_model_dir: Path) -> None:
    """It claimed them once they idled past --claim_idle_ms in its local queue: each run twice,
    each counted a claim (the alert for dying workers), each a delivery nearer worker_lost."""
    from broker.worker import RedisWorker
    from engines import load_engine
    from engines.model_dir import load_model_info
    from server import ServerConfig
    from tests.helpers import GatedEngine

    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(model_dir=str(tiny_model_dir), broker=broker.url, role="worker",
                          num_inference_sessions=1, threads_per_session=1, max_batch_size=4,
                          claim_idle_ms=100)
    worker = RedisWorker(config, load_model_info(tiny_model_dir), tiny_model_dir.name,
                         engine_factory=lambda: engine)
    worker.start()
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 1)
        engine.gate.clear()  # the session holds its batch; the rest wait in the local queue
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(pipelined(8))
        wait_until(lambda: len(worker.queue) > 0)
        time.sleep(1.0)  # ten claim periods past --claim_idle_ms
        claims = worker.counts["claims"]
        engine.gate.set()
        replies = conn.recv_replies(8)
        assert all(reply.get("error") is None for reply in replies.values())
        assert claims == 0 and worker.counts["claims"] == 0
        assert front.backend.counts["duplicate_replies"] == 0  # type: ignore[union-attr]
        conn.close()
    finally:
        engine.gate.set()
        front.shutdown(10)
        worker.stop(10)


def test_a_worker_of_another_model_is_not_counted_and_answers_nothing_of_it(
        broker: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Work and heartbeats carried no model: answers depended on which worker ran them."""
    from tests.broker_fixtures import heartbeats
    from tests.conftest import build_tiny_model_dir
    from tests.helpers import Reference

    other = build_tiny_model_dir(tmp_path / "other", seed=7)
    workers = [start_worker(broker.url, tiny_model_dir), start_worker(broker.url, other)]
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_until(lambda: len(heartbeats(broker.client())) == 2, 60)
        wait_serving(front, 1)
        time.sleep(1.5)  # a look that would count the other model's worker too
        assert front.backend.monitor.serving_workers == 1  # type: ignore[union-attr]
        reference = Reference(tiny_model_dir)
        total = 40
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6]))
                               for i in range(total)))
        replies = conn.recv_replies(total)
        answered = [r for r in replies.values() if not r.get("error")]
        assert len(answered) >= total // 2  # the other model's worker pauses once given ours
        for i, reply in replies.items():
            if reply.get("error"):
                assert reply["error"]["code"] == "internal", reply
                assert "serves another model" in reply["error"]["message"]
            else:
                assert reply["result"] == reference.answer(QUESTIONS[i % 6], CONTEXTS[i % 6])
        conn.close()
    finally:
        front.shutdown(10)
        for worker in workers:
            if worker.poll() is None:
                stop_worker(worker)
