"""Waits that let the main thread run signal handlers, and give up when a stop is asked.

Python runs a signal's handler only in the main thread, and only once that thread is back in the
interpreter. The kernel may hand a process's signal to any of its threads that does not block it;
on a GPU that is often a CUDA or ONNX Runtime thread, and then a main thread blocked in an untimed
``Event.wait()`` never wakes: the server ignores SIGTERM and Ctrl+C (found on an H100,
docs/benchmarks.md). The main thread therefore waits in short steps.

A start-up waits for engines to load and worker processes to warm up, which takes seconds to
minutes. A signal's handler only sets a flag (the ``cancel`` event); each wait of the start-up
checks it at every step and raises ``StartCancelled``, so that a stop asked during start-up
stops the start-up instead of waiting for it to finish.

``backoff_s`` is the one back-off of everything retried after failures: sessions and processes
replaced, brokers reconnected.
"""

from __future__ import annotations

import threading

#: How often a waiting main thread wakes to run pending signal handlers (seconds).
SIGNAL_POLL_S = 0.2


class StartCancelled(Exception):
    """A stop was asked (SIGINT, SIGTERM) while the server was starting: the start-up was
    abandoned, and whatever it had started is to be stopped. Not a failure: nothing went wrong."""


def raise_if_cancelled(cancel: threading.Event | None) -> None:
    """Raise ``StartCancelled`` if ``cancel`` is set.

    Raises:
        StartCancelled: a stop was asked.
    """
    if cancel is not None and cancel.is_set():
        raise StartCancelled("a stop was asked during start-up")


def wait_until_set(event: threading.Event, cancel: threading.Event | None = None) -> None:
    """Block until ``event`` is set, waking every ``SIGNAL_POLL_S`` so signal handlers run.

    Args:
        event: What to wait for.
        cancel: Give up as soon as this is set (checked before the first wait, then at every
            step); None waits for ``event`` alone.

    Raises:
        StartCancelled: ``cancel`` was set before ``event``.
    """
    raise_if_cancelled(cancel)
    while not event.wait(SIGNAL_POLL_S):
        raise_if_cancelled(cancel)


#: Seconds before the n-th consecutive retry of anything that keeps failing (a session or
#: process replaced, a broker reconnected); the last value repeats.
BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)


def backoff_s(failures: int, least: float = 0.0) -> float:
    """Seconds to wait after ``failures`` consecutive failures (0: the first retry), at least
    ``least``."""
    return max(least, BACKOFF_S[min(max(0, failures), len(BACKOFF_S) - 1)])


class Restarts:
    """The one restart policy of every supervised slot (a session thread, a worker process, an
    executor process): each replacement waits ``backoff_s`` of the failures in a row before it,
    and one that had served resets them, so a slot that served is replaced at once."""

    def __init__(self) -> None:
        self.count = 0  # replacements, ever
        self.failures = 0  # replacements in a row that did not get to serve

    def next_delay(self, served: bool) -> float:
        """Count a replacement of a slot whose process (or thread) ``served`` or not; the
        seconds to wait before starting it."""
        if served:
            self.failures = 0
        delay = backoff_s(self.failures)
        self.failures += 1
        self.count += 1
        return delay
