"""Edge cases of worker processes found in review, each proved first with these tests: real
processes, sockets and the tiny model."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from client import Client
from engines.model_dir import load_model_info
from protocol import encode_frame, ok_reply, qa_request
from protocol.messages import QARequest
from server import InferenceServer
from telemetry.stats import ServerStats
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, wait_until
from tests.test_workers import scrape
from tests.test_workers import worker_config as cfg
from transport.coalesce import coalesced_sends
from workers.handle import WorkerHandle
from workers.processes import ProcessBackend


def test_a_drained_stop_has_delivered_every_answer_popped_from_a_worker(
        tiny_model_dir: Path) -> None:
    """stop() reports drained only once answers taken from a worker's jobs are delivered."""
    config = cfg(tiny_model_dir)
    backend = ProcessBackend(config, load_model_info(config.model_dir), ServerStats())
    backend.start()
    delivered: list[int] = []

    def slow(i: int) -> Callable[[object, object], None]:
        def respond(result: object, error: object) -> None:
            time.sleep(0.3)  # e.g. a big bulk on a loaded 2-core box; GIL contention
            delivered.append(i)
        return respond

    now = time.monotonic()
    for i in range(6):
        request = QARequest(id=i, question=QUESTIONS[i], context=CONTEXTS[i])
        backend.submit(request, slow(i), lambda: True, now, None)
    backend.flush()
    drained = backend.stop(30)
    at_return = len(delivered)
    assert drained
    assert at_return == 6, f"stop() returned with only {at_return}/6 answers delivered"


def test_a_reply_held_by_coalesced_sends_is_written_when_the_stop_begins(
        tiny_model_dir: Path) -> None:
    """A frame that send() accepted into coalesced_sends is written when finish() begins."""
    with InferenceServer(cfg(tiny_model_dir, workers=1, num_inference_sessions=1)) as srv:
        raw = RawConnection(srv.address)
        wait_until(lambda: len(srv.connections) == 1)
        conn = next(iter(srv.connections))
        with coalesced_sends():
            assert conn.send(ok_reply(7, {"answer": "held"}))  # says: sent
            assert conn.finish() is False  # the server's stop begins meanwhile
        wait_until(lambda: conn.finish(), timeout=5)
        got = raw.recv_message()
        assert got is not None, "reply 7 was accepted by send() but never written"


def test_a_request_admitted_by_the_front_end_is_never_refused_by_a_worker(
        tiny_model_dir: Path) -> None:
    # a worker's window (16) is larger than --max_queue (4)
    config = cfg(tiny_model_dir, max_queue=4, max_batch_size=8, batching="off")
    with InferenceServer(config) as srv:
        conn = RawConnection(srv.address)
        total = 300
        for start in range(0, total, 4):  # reads of <= max_queue requests: none refused at the door
            conn.send_raw(b"".join(
                encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 4))
                for i in range(start, start + 4)))
            time.sleep(0.002)
        replies = conn.recv_replies(total)
        conn.close()
        snap = srv.stats.snapshot()
    qa = snap["requests"]["qa"]
    # admitted excludes requests refused at the door: admitted - ok = admitted ones NOT served
    assert snap["admitted"] == qa.get("ok", 0), (qa, snap["admitted"])


def test_summed_counters_never_go_backwards_when_a_worker_is_replaced(tiny_model_dir: Path) -> None:
    with InferenceServer(cfg(tiny_model_dir)) as srv:
        with Client(*srv.address) as client:
            for f in [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(60)]:
                f.result(timeout=60)
            before = client.stats(timeout=30)
            os.kill(before["workers"][0]["pid"], signal.SIGKILL)
            wait_until(lambda: srv.ready, timeout=60)
            after = client.stats(timeout=30)
    assert after["batches"] >= before["batches"], "a Prometheus counter decreased"


def test_concurrent_stats_queries_each_get_every_workers_figures(tiny_model_dir: Path) -> None:
    with InferenceServer(cfg(tiny_model_dir)) as srv:
        missing: list[float] = []

        def ask() -> None:
            with Client(*srv.address) as client:
                for _ in range(15):
                    started = time.monotonic()
                    workers = client.stats(timeout=30)["workers"]
                    if not all(w["answered_stats"] for w in workers):
                        missing.append(time.monotonic() - started)

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not missing


def test_per_device_counters_never_go_back_for_a_slow_or_replaced_worker(
        tiny_model_dir: Path) -> None:
    """A worker late to answer counts with its last answer, and a dead one's last figures stay
    in its device's series (Prometheus reads any drop as a counter reset)."""
    device = ("qa_server_device_batches_total", ("device", "cpu"))
    with InferenceServer(cfg(tiny_model_dir, metrics_port=0)) as srv:
        with Client(*srv.address) as client:
            for f in [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(60)]:
                f.result(timeout=60)
            pids = [w["pid"] for w in client.stats(timeout=30)["workers"]]
            before = scrape(srv)
            os.kill(pids[0], signal.SIGSTOP)  # stands in for a worker too busy to answer
            try:
                slow = scrape(srv)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            os.kill(pids[1], signal.SIGKILL)

            def replaced() -> bool:
                worker = client.stats(timeout=30)["workers"][1]
                return worker["pid"] != pids[1] and worker["state"] == "serving"
            wait_until(replaced, timeout=60)
            after = scrape(srv)
    assert before[device] > 0
    assert slow[device] == before[device]
    assert [key for key in slow if key[0] == "qa_server_worker_batches_total"
            and ("worker", "0") in key], "the late worker's series vanished"
    assert after[device] >= before[device]


def _figures(batches: int) -> dict[str, object]:
    stats = ServerStats()
    for _ in range(batches):
        stats.on_batch(1, 1, [0.001], 0.002)
    return stats.batch_figures()


def test_a_worker_dying_after_answering_a_waiting_query_counts_once() -> None:
    """Its answer, not yet read by the query, moves to the slot's earlier figures; the query
    does not count it again as the worker's own."""
    handle = WorkerHandle(0, "cpu")
    handle.on_ready({})
    handle.answers.expect(1)
    handle.answers.answer(1, _figures(3))
    orphans, was_serving = handle.detach()
    entry = handle.figures(1, time.monotonic() + 5)
    assert (orphans, was_serving) == ([], True)
    assert entry["figures"] is None and entry["known_figures"] is None
    assert entry["earlier_figures"]["batches"] == 3


def test_the_newest_figures_of_a_dead_worker_are_kept() -> None:
    handle = WorkerHandle(0, "cpu")
    handle.on_ready({})
    handle.answers.expect(1)
    handle.answers.answer(1, _figures(7))
    assert handle.figures(1, time.monotonic() + 5)["known_figures"]["batches"] == 7
    handle.answers.expect(2)  # an older answer may still be unread: the most batches wins
    handle.answers.answer(2, _figures(5))
    handle.detach()
    assert handle.figures(2, time.monotonic() + 5)["earlier_figures"]["batches"] == 7


def test_an_older_answer_read_after_a_newer_one_is_not_kept_as_the_last() -> None:
    handle = WorkerHandle(0, "cpu")
    handle.on_ready({})
    for token, batches in ((5, 7), (6, 9)):  # two queries at once; 6 answered with more
        handle.answers.expect(token)
        handle.answers.answer(token, _figures(batches))
    handle.figures(6, time.monotonic() + 5)
    handle.figures(5, time.monotonic() + 5)  # read last, but older
    handle.detach()
    assert handle.figures(7, time.monotonic() + 5)["earlier_figures"]["batches"] == 9


def test_a_query_waiting_on_a_worker_that_dies_stops_waiting() -> None:
    handle = WorkerHandle(0, "cpu")
    handle.on_ready({})
    handle.answers.expect(1)
    entries: list[dict[str, object]] = []
    waiter = threading.Thread(target=lambda: entries.append(
        handle.figures(1, time.monotonic() + 60)))
    waiter.start()
    time.sleep(0.2)
    handle.detach()
    waiter.join(timeout=20)
    assert not waiter.is_alive(), "the query waited for figures from a dead worker"
    assert entries[0]["state"] == "lost" and entries[0]["figures"] is None
