"""The shared work queue and the inference-session threads, with a tiny real engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import load_engine
from engines.base import Engine
from protocol.errors import DeadlineExceeded, EngineError, Overloaded, ServerError, ShuttingDown
from scheduling.queue import DeadlineReaper, WorkItem, WorkQueue
from scheduling.session import InferenceSession
from tasks.qa import QATask


def item(tag: Any, replies: list | None = None, alive: bool = True) -> WorkItem:
    def respond(result: dict | None, error: ServerError | None) -> None:
        if replies is not None:
            replies.append((tag, result, error))

    return WorkItem(features=tag, respond=respond, alive=lambda: alive)


def test_take_batch_returns_waiting_items_in_arrival_order_up_to_the_cap() -> None:
    queue = WorkQueue(maxsize=10)
    for n in range(5):
        queue.put(item(n))
    assert [i.features for i in queue.take_batch(3)] == [0, 1, 2]
    assert [i.features for i in queue.take_batch(3)] == [3, 4]
    assert len(queue) == 0


def test_take_batch_blocks_until_work_arrives() -> None:
    queue = WorkQueue()
    got: list[Any] = []
    consumer = threading.Thread(target=lambda: got.extend(queue.take_batch(4)))
    consumer.start()
    consumer.join(0.2)
    assert consumer.is_alive() and not got  # waiting, not spinning through empty batches
    queue.put(item("x"))
    consumer.join(5)
    assert [i.features for i in got] == ["x"]


def test_close_lets_consumers_drain_then_gives_them_an_empty_batch() -> None:
    queue = WorkQueue()
    queue.put(item("last"))
    queue.close()
    with pytest.raises(ShuttingDown):
        queue.put(item("late"))
    assert [i.features for i in queue.take_batch(4)] == ["last"]
    assert queue.take_batch(4) == []


def test_close_wakes_every_waiting_consumer() -> None:
    queue = WorkQueue()
    results: list[list[WorkItem]] = []
    consumers = [threading.Thread(target=lambda: results.append(queue.take_batch(2)))
                 for _ in range(3)]
    for c in consumers:
        c.start()
    queue.close()
    for c in consumers:
        c.join(5)
    assert results == [[], [], []]


def test_a_full_queue_refuses_at_once_with_overloaded_and_admits_again_once_space_frees() -> None:
    queue = WorkQueue(maxsize=2)
    queue.put(item(1))
    queue.put(item(2))
    with pytest.raises(Overloaded, match="max_queue"):
        queue.put(item(3))  # no waiting: refused now
    assert len(queue) == 2
    queue.take_batch(1)
    queue.put(item(3))
    assert [i.features for i in queue.take_batch(5)] == [2, 3]


def timed_item(tag: Any, timeout_s: float | None, replies: list) -> WorkItem:
    now = time.monotonic()
    return WorkItem(features=tag, respond=_collect(replies, tag), enqueued_at=now,
                    deadline=None if timeout_s is None else now + timeout_s)


def test_the_reaper_answers_expired_items_while_no_session_takes_any() -> None:
    queue, replies = WorkQueue(), []
    for tag, timeout_s in (("far", 1e10), ("slow", 0.05), ("none", None), ("later", 30.0),
                           ("fast", 0.02)):  # "far": a wait that long must not break the reaper
        queue.put(timed_item(tag, timeout_s, replies))
    reaper = DeadlineReaper(queue)
    reaper.start()
    deadline = time.monotonic() + 10
    while len(replies) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [tag for tag, _, _ in replies] == ["fast", "slow"]  # earliest deadline first
    assert all(isinstance(error, DeadlineExceeded) for _, _, error in replies)
    assert "not run" in replies[0][2].message
    assert [i.features for i in queue.take_batch(5)] == ["far", "none", "later"]  # still queued
    queue.done()
    queue.close()
    reaper.join(5)
    assert not reaper.is_alive()  # stops once the queue is closed and empty


def test_an_item_taken_before_its_deadline_is_not_expired_later() -> None:
    queue, replies = WorkQueue(), []
    queue.put(timed_item("a", 0.05, replies))
    assert queue.take_batch(1)[0].features == "a"
    queue.put(timed_item("b", 30.0, replies))
    reaper = DeadlineReaper(queue)
    reaper.start()
    time.sleep(0.15)
    assert replies == []
    queue.close()
    assert queue.take_batch(1)[0].features == "b"
    reaper.join(5)
    assert not reaper.is_alive()


def test_purge_removes_only_the_matching_items() -> None:
    queue = WorkQueue()
    for n in range(6):
        queue.put(item(n, alive=n % 2 == 0))
    dropped = queue.purge(lambda i: not i.alive())
    assert [i.features for i in dropped] == [1, 3, 5]
    assert [i.features for i in queue.take_batch(10)] == [0, 2, 4]


def test_many_deadlines_of_taken_items_do_not_pile_up() -> None:
    queue = WorkQueue(maxsize=10)
    for n in range(1000):
        queue.put(timed_item(n, 60.0, []))
        queue.take_batch(1)
        queue.done()
    assert len(queue._deadlines) <= 2 * len(queue) + 65  # compacted as items are taken


class ExplodingEngine(Engine):
    """A real engine that raises on any batch holding the token id ``poison``."""

    def __init__(self, inner: Engine, poison: int) -> None:
        self.inner, self.poison = inner, poison
        self.input_names = inner.input_names

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        if (feeds["input_ids"] == self.poison).any():
            raise RuntimeError("boom")
        return self.inner.run(feeds)


def test_a_failing_batch_fails_only_its_own_requests_and_the_session_keeps_serving(
        tiny_model_dir: Path) -> None:
    task = QATask.from_dir(tiny_model_dir)
    poison = task.tokenizer.convert_tokens_to_ids("explode")
    engine = ExplodingEngine(load_engine("onnx", tiny_model_dir, threads=1), poison)
    queue = WorkQueue()
    session = InferenceSession(0, lambda: engine, task, queue, policy=2)
    replies: list[tuple[Any, Any, Any]] = []
    texts = [("Who?", "Ann met Bob."), ("What?", "It will explode soon."), ("Why?", "Rain."),
             ("When?", "At noon."), ("Where?", "Here.")]
    for n, (q, c) in enumerate(texts):
        queue.put(WorkItem(features=task.preprocess(q, c), respond=_collect(replies, n)))
    queue.put(WorkItem(features=task.preprocess("Who?", "Nobody."), respond=_collect(replies, 99),
                       alive=lambda: False))  # its client left: skipped, never answered
    queue.close()
    session.start()
    session.join(30)
    outcome = {tag: (error.code if error else "ok") for tag, _, error in replies}
    assert outcome == {0: "engine_error", 1: "engine_error", 2: "ok", 3: "ok", 4: "ok"}
    assert session.batches_run == 2
    assert all(isinstance(e, EngineError) for _, _, e in replies[:2])


def _collect(replies: list, tag: Any) -> Any:
    return lambda result, error: replies.append((tag, result, error))


def test_a_session_whose_engine_cannot_load_reports_it(tiny_model_dir: Path) -> None:
    def broken() -> Engine:
        raise FileNotFoundError("no model.onnx")

    session = InferenceSession(0, broken, QATask.from_dir(tiny_model_dir), WorkQueue())
    session.start()
    assert session.ready.wait(10)
    session.join(10)
    assert isinstance(session.load_error, FileNotFoundError)


def test_a_burst_is_served_by_all_sessions_in_batches_up_to_the_cap(tiny_model_dir: Path) -> None:
    task = QATask.from_dir(tiny_model_dir)
    queue = WorkQueue()
    sessions = [InferenceSession(i, lambda: load_engine("onnx", tiny_model_dir, threads=1), task,
                                 queue, policy=3) for i in range(2)]
    replies: list[tuple[Any, Any, Any]] = []
    for n in range(30):
        queue.put(WorkItem(features=task.preprocess("Who?", "Ann met Bob. " * 30),
                           respond=_collect(replies, n)))
    for s in sessions:
        s.start()
    queue.close()
    for s in sessions:
        s.join(60)
    assert sorted(tag for tag, _, _ in replies) == list(range(30))
    assert all(error is None for _, _, error in replies)
    assert sum(s.batches_run for s in sessions) >= 10  # batches of at most 3
