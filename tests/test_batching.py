"""The shared work queue and the inference-session threads, with a tiny real engine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import load_engine
from engines.base import Engine
from engines.batching import WorkItem, WorkQueue
from engines.qa import QATask
from engines.session import InferenceSession
from protocol.errors import EngineError, ServerError, ShuttingDown


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


def test_a_full_queue_blocks_producers_until_space_frees() -> None:
    queue = WorkQueue(maxsize=2)
    queue.put(item(1))
    queue.put(item(2))
    with pytest.raises(TimeoutError):
        queue.put(item(3), timeout=0.05)
    producer = threading.Thread(target=lambda: queue.put(item(3)))
    producer.start()
    producer.join(0.1)
    assert producer.is_alive()
    queue.take_batch(1)
    producer.join(5)
    assert not producer.is_alive() and len(queue) == 2


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
