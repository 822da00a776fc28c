"""One thread that calls back when deadlines pass, for requests waiting on another machine."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any


class ExpiryClock(threading.Thread):
    """Calls ``on_expired(what)`` once ``time.monotonic()`` reaches the time ``what`` was added
    with. Whoever receives the call decides whether it still matters (the request may have been
    answered meanwhile).
    """

    def __init__(self, on_expired: Callable[[Any], None]) -> None:
        super().__init__(name="deadlines", daemon=True)
        self.on_expired = on_expired
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False

    def add(self, when: float, what: Any) -> None:
        """Call back with ``what`` at ``when`` (a ``time.monotonic()`` instant)."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), what))
            if self._heap[0][2] is what:
                self._cond.notify()

    def run(self) -> None:
        """Sleep until the earliest time, call back for everything due, until stopped."""
        while True:
            with self._cond:
                while not self._stopped and (not self._heap
                                             or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                due = []
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for what in due:
                self.on_expired(what)

    def stop(self) -> None:
        """Stop calling back (pending times are dropped)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
