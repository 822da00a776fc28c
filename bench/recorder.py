"""What one load-generating worker process records (bench/loadgen.py): each request's outcome,
and its progress sent to the parent."""

from __future__ import annotations

import threading
import time
from array import array
from collections import Counter
from typing import Any


class Recorder:
    """One worker's outcomes: latencies of successes, errors by code. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latencies = array("d")
        self.lags = array("d")
        self.errors: Counter[str] = Counter()
        self.completed = 0
        self.last = 0.0
        self.clients = 0  # closed loop: client connections started
        self.cut_short = False  # closed loop: the time budget kept some requests from being sent

    def ok(self, seconds: float, now: float) -> None:
        with self._lock:
            self.latencies.append(seconds)
            self.completed += 1
            self.last = max(self.last, now)

    def failed(self, code: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self.errors[code] += n
            self.completed += n
            self.last = max(self.last, time.perf_counter())

    def client_started(self) -> None:
        with self._lock:
            self.clients += 1

    def budget_spent(self) -> None:
        with self._lock:
            self.cut_short = True

    def payload(self, start: float) -> dict[str, Any]:
        """What goes back to the parent; ``wall_s`` runs from the start to the last outcome."""
        with self._lock:
            end = self.last or time.perf_counter()
            return {"latencies": self.latencies, "lags": self.lags, "errors": dict(self.errors),
                    "requests": self.completed, "wall_s": max(0.0, end - start),
                    "clients": self.clients, "cut_short": self.cut_short}


class Reporter:
    """Sends this worker's progress to the parent every 0.2 s while in a ``with`` block."""

    def __init__(self, index: int, events: Any, recorder: Recorder) -> None:
        self._index, self._events, self._recorder = index, events, recorder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        reported = 0
        while not self._stop.wait(0.2):
            done = self._recorder.completed
            if done > reported:
                self._events.put(("progress", self._index, done - reported))
                reported = done

    def __enter__(self) -> Reporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
