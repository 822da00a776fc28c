"""Waits that let the main thread run signal handlers.

Python runs a signal's handler only in the main thread, and only once that thread is back in the
interpreter. The kernel may hand a process's signal to any of its threads that does not block it;
on a GPU that is often a CUDA or ONNX Runtime thread, and then a main thread blocked in an untimed
``Event.wait()`` never wakes: the server ignores SIGTERM and Ctrl+C (found on an H100,
docs/benchmarks.md). The main thread therefore waits in short steps.
"""

from __future__ import annotations

import threading

#: How often a waiting main thread wakes to run pending signal handlers (seconds).
SIGNAL_POLL_S = 0.2


def wait_until_set(event: threading.Event) -> None:
    """Block until ``event`` is set, waking every ``SIGNAL_POLL_S`` so signal handlers run."""
    while not event.wait(SIGNAL_POLL_S):
        pass
