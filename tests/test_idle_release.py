"""The idle watcher gives a model's memory back once per idle spell that follows work, and
never while a batch runs or waits."""

from __future__ import annotations

import threading
import time

from scheduling.idle import IdleRelease
from scheduling.queue import WorkItem, WorkQueue


def _run_one(queue: WorkQueue) -> None:
    queue.put(WorkItem(features=None, respond=lambda result, error: None))
    assert len(queue.take_batch(1)) == 1
    queue.done()


def _wait(condition, seconds: float = 10.0) -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until, "condition never became true"
        time.sleep(0.01)


def test_memory_is_given_back_once_per_idle_spell_after_work() -> None:
    queue = WorkQueue()
    released = threading.Semaphore(0)
    calls: list[int | None] = []

    def release() -> None:
        calls.append(queue.idle_after())
        released.release()

    watcher = IdleRelease(queue, release, idle_s=0.02)
    watcher.start()
    try:
        _run_one(queue)
        assert released.acquire(timeout=10)  # idle after work: given back
        assert calls == [1]
        # idle on, with no work since: nothing more, however many checks pass
        checks = watcher.checks
        _wait(lambda: watcher.checks >= checks + 5)
        assert calls == [1]
        # a batch taken and still running: busy, never given back meanwhile
        queue.put(WorkItem(features=None, respond=lambda result, error: None))
        assert len(queue.take_batch(1)) == 1
        checks = watcher.checks
        _wait(lambda: watcher.checks >= checks + 5)
        assert calls == [1]
        queue.done()
        assert released.acquire(timeout=10)
        assert calls == [1, 2]
    finally:
        watcher.stop()
        watcher.join(5)
    assert not watcher.is_alive()


def test_a_server_that_never_ran_a_batch_gives_nothing_back() -> None:
    queue = WorkQueue()
    calls: list[int] = []
    watcher = IdleRelease(queue, lambda: calls.append(1), idle_s=0.02)
    watcher.start()
    try:
        _wait(lambda: watcher.checks >= 5)
        assert calls == []
    finally:
        watcher.stop()
        watcher.join(5)
