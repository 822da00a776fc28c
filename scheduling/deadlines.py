"""Deadlines, kept once for every layout: a heap of things by the time they fall due
(``DeadlineHeap``), under the work queue's expiry of queued requests (scheduling/queue.py),
and a thread that calls back as each falls due (``ExpiryClock``), for requests waiting on
another machine (broker/frontend.py). Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Longest single sleep until a deadline: a far one must never overflow a wait, or outlive a
#: jump of the clock.
LONGEST_WAIT_S = 60.0


class DeadlineHeap(Generic[T]):
    """Things by the time they fall due, earliest first. Not thread-safe: its owner's lock
    guards it."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()  # ties in time keep their order; things never compare

    def push(self, when: float, what: T) -> bool:
        """Add ``what``, due at ``when``; True if it is now the earliest (a sleeper should
        wake to sleep shorter)."""
        heapq.heappush(self._heap, (when, next(self._seq), what))
        return self._heap[0][2] is what

    def pop_due(self, now: float) -> list[T]:
        """Remove and return everything due at ``now``, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def wait_s(self, now: float) -> float | None:
        """Seconds to sleep from ``now`` until the earliest is due (at most LONGEST_WAIT_S);
        None where nothing is held."""
        if not self._heap:
            return None
        return max(0.0, min(self._heap[0][0] - now, LONGEST_WAIT_S))

    def keep(self, wanted: Callable[[T], bool]) -> None:
        """Forget what is no longer ``wanted`` (say, taken before its deadline)."""
        self._heap = [entry for entry in self._heap if wanted(entry[2])]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class ExpiryClock(threading.Thread):
    """Calls ``on_expired(what)`` once ``time.monotonic()`` reaches the time ``what`` was added
    with. Whoever receives the call decides whether it still matters (the request may have been
    answered meanwhile).
    """

    def __init__(self, on_expired: Callable[[Any], None]) -> None:
        super().__init__(name="deadlines", daemon=True)
        self.on_expired = on_expired
        self._due: DeadlineHeap[Any] = DeadlineHeap()
        self._cond = threading.Condition()
        self._stopped = False

    def add(self, when: float, what: Any) -> None:
        """Call back with ``what`` at ``when`` (a ``time.monotonic()`` instant)."""
        with self._cond:
            if self._due.push(when, what):
                self._cond.notify()

    def run(self) -> None:
        """Sleep until the earliest time, call back for everything due, until stopped."""
        while True:
            with self._cond:
                while not self._stopped and not (due := self._due.pop_due(time.monotonic())):
                    self._cond.wait(self._due.wait_s(time.monotonic()))
                if self._stopped:
                    return
            for what in due:
                self.on_expired(what)

    def stop(self) -> None:
        """Stop calling back (pending times are dropped)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
