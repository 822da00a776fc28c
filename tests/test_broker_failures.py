"""--broker when things go wrong: a worker killed mid-batch, Redis restarted under load,
deadlines across the hop, a full stream, no worker, an entry that keeps killing workers.
Real redis-server, real worker processes, real sockets."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from broker.connect import GROUP
from broker.local_server import RedisServer
from broker.wire import decode_reply, encode_work
from client import Client
from protocol import DeadlineExceeded, Overloaded, Unavailable, encode_frame, qa_request
from tests.broker_fixtures import (
    assert_answered_once_each,
    front_end,
    heartbeats,
    settled,
    start_worker,
    stop_worker,
    wait_serving,
    work_key,
)
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, freeze, frozen, wait_until


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def pending_of(broker: RedisServer, pid: int) -> int:
    """Entries the worker with this pid holds unacknowledged."""
    client = broker.client()
    name = heartbeats(client)[pid]["worker"]
    model_dir = heartbeats(client)[pid]["model_name"]
    return len(client.xpending_range(f"qa:work:{model_dir}", GROUP, min="-", max="+", count=1000,
                                     consumername=name))


def freeze_holding_work(broker: RedisServer, pid: int, timeout_s: float = 30) -> int:
    """Stop the worker ``pid`` (every thread) while it holds entries (it may settle them
    between our look and the stop: then let it go on and try again); how many it holds,
    frozen."""
    deadline = time.monotonic() + timeout_s
    while True:
        wait_until(lambda: pending_of(broker, pid) > 0, max(0.1, deadline - time.monotonic()))
        freeze(pid)
        if (held := pending_of(broker, pid)) > 0 or time.monotonic() > deadline:
            return held
        os.kill(pid, signal.SIGCONT)


def test_a_worker_killed_mid_batch_loses_no_request_and_answers_none_twice(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    workers = [start_worker(broker.url, tiny_model_dir) for _ in range(2)]
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 2)
        total, victim = 300, workers[0]
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 8))
                               for i in range(total)))
        held = freeze_holding_work(broker, victim.pid)  # mid-batch, for sure
        os.kill(victim.pid, signal.SIGKILL)
        assert_answered_once_each(conn, total)
        assert held > 0

        def claimed() -> bool:  # heartbeats lag by up to a second
            survivor = heartbeats(broker.client()).get(workers[1].pid, {})
            return survivor.get("claims", 0) >= held and survivor.get("redeliveries", 0) >= held

        wait_until(claimed, 10)
        settled(broker.client(), tiny_model_dir)
        conn.close()
    finally:
        front.shutdown(10)
        for worker in workers:
            if worker.poll() is None:
                stop_worker(worker)


def test_redis_restarted_under_load_the_front_end_recovers_by_itself(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    worker = start_worker(broker.url, tiny_model_dir)
    front = front_end(broker.url, tiny_model_dir)
    outcomes: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with Client(*front.address) as client:
            while not stop.is_set():
                futures = [client.submit(QUESTIONS[i], CONTEXTS[i]) for i in range(6)]
                for future in futures:
                    try:
                        future.result(timeout=30)
                        outcomes.append("ok")
                    except (Unavailable, Overloaded) as exc:
                        outcomes.append(exc.code)

    try:
        wait_serving(front, 1)
        thread = threading.Thread(target=load)
        thread.start()
        wait_until(lambda: outcomes.count("ok") > 20, 30)
        broker.stop()
        wait_until(lambda: not front.ready, 10)
        with Client(*front.address) as client:
            assert client.ping(timeout=5)["ready"] is False  # ping still answers
            assert client.stats(timeout=10)["broker"]["up"] is False  # stats too
            # refused at admission (at once), not failed once in flight
            with pytest.raises(Unavailable, match="cannot be reached|no live worker"):
                client.answer(QUESTIONS[0], CONTEXTS[0], timeout=10)
        broker.start()  # empty: nothing was persisted
        wait_serving(front, 1, timeout=60)
        ok_before = outcomes.count("ok")
        wait_until(lambda: outcomes.count("ok") > ok_before + 20, 30)
        stop.set()
        thread.join(60)
        assert not thread.is_alive()
        assert set(outcomes) <= {"ok", "unavailable"} and "unavailable" in outcomes
        with Client(*front.address) as client:
            stats = client.stats(timeout=10)
        assert stats["broker"]["reconnects"] >= 1 and stats["in_flight"] == 0
        assert stats["events"]["broker_lost"] >= 1 and stats["events"]["broker_reconnect"] >= 1
    finally:
        stop.set()
        front.shutdown(10)
        assert stop_worker(worker) == 0


def test_a_deadline_passes_across_the_hop_and_the_worker_skips_the_expired_entry(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    worker = start_worker(broker.url, tiny_model_dir)
    front = front_end(broker.url, tiny_model_dir)
    try:
        wait_serving(front, 1)
        freeze(worker.pid)  # every thread: it takes nothing for a while (under the 5 s TTL)
        with Client(*front.address) as client:
            with pytest.raises(DeadlineExceeded, match="before a worker answered"):
                client.submit(QUESTIONS[0], CONTEXTS[0], timeout_ms=300).result(timeout=30)
            assert frozen(worker.pid)  # so the front end answered, at the deadline
            os.kill(worker.pid, signal.SIGCONT)
            # the worker takes the entry, finds its deadline passed and replies so: a reply
            # to a request answered already, which the front end counts as late
            wait_until(lambda: client.stats()["broker"]["late_replies"] == 1, 60)
            settled(broker.client(), tiny_model_dir)  # the entry was settled with that reply
            # its next heartbeat (one a second) counts it: skipped, never run
            wait_until(lambda: heartbeats(broker.client()).get(worker.pid, {}).get("expired") == 1,
                       60)
            beat = heartbeats(broker.client())[worker.pid]
            assert beat["figures"]["batch_rows"] == 0
            assert client.stats()["broker"]["duplicate_replies"] == 0  # no entry ran twice
            assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["answer"]
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        front.shutdown(10)
        assert stop_worker(worker) == 0


def test_a_full_stream_refuses_at_once_and_no_worker_means_unavailable(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    front = front_end(broker.url, tiny_model_dir, max_queue=3)
    worker = None
    try:
        with Client(*front.address) as client:
            assert client.ping(timeout=5)["ready"] is False
            with pytest.raises(Unavailable, match="no live worker holds model"):
                client.answer(QUESTIONS[0], CONTEXTS[0], timeout=10)
        worker = start_worker(broker.url, tiny_model_dir)
        wait_serving(front, 1)
        freeze(worker.pid)  # every thread: none takes an entry until SIGCONT
        conn = RawConnection(front.address, timeout=30)
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[0], CONTEXTS[0]))
                               for i in range(10)))
        errors = [conn.recv_message() for _ in range(7)]  # the refusals come first, at once
        assert all(e is not None and e["error"]["code"] == "overloaded" for e in errors)
        os.kill(worker.pid, signal.SIGCONT)
        answered = [conn.recv_message() for _ in range(3)]
        assert all(a is not None and a.get("error") is None for a in answered)
        conn.close()
    finally:
        if worker is not None:
            os.kill(worker.pid, signal.SIGCONT)
        front.shutdown(10)
        if worker is not None:
            assert stop_worker(worker) == 0


def test_an_entry_that_keeps_killing_workers_is_answered_worker_lost(
        broker: RedisServer, tiny_model_dir: Path) -> None:
    client, work = broker.client(), work_key(tiny_model_dir)
    client.xgroup_create(work, GROUP, id="0", mkstream=True)
    client.xadd("qa:replies:test", {"m": b""})
    feeds = {"input_ids": np.array([[101, 2054, 102]]), "attention_mask": np.ones((1, 3), int),
             "token_type_ids": np.zeros((1, 3), int)}
    client.xadd(work, {"m": encode_work("qa:replies:test", 7, feeds, time.monotonic(), None)})
    for attempt in range(4):  # four workers took it and died before answering
        client.xreadgroup(GROUP, f"dead-{attempt}", {work: "0" if attempt else ">"})
        client.xclaim(work, GROUP, f"dead-{attempt}", 0, [client.xrange(work)[0][0]])
    worker = start_worker(broker.url, tiny_model_dir)
    try:
        wait_until(lambda: client.xlen("qa:replies:test") == 2, 60)
        reply = decode_reply(client.xrange("qa:replies:test")[-1][1][b"m"])
        assert reply.number == 7 and reply.code == "worker_lost"
        settled(client, tiny_model_dir)
        wait_until(lambda: worker.pid in heartbeats(client), 30)
        assert heartbeats(client)[worker.pid]["figures"]["batch_rows"] == 0  # never run
    finally:
        assert stop_worker(worker) == 0
