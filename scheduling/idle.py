"""Memory given back when a model goes idle: a batch's working memory is held only while
batches run.

ONNX Runtime's arena, PyTorch's CUDA cache and the C heap keep what the largest batch took (a
32 x 384 MiniLM batch: 1.2 GB on the CPU, against 90 MB of weights), so a server that once served
a burst would hold its peak for good. ``IdleRelease`` watches a model's queue and, once nothing
has waited or run for ``idle_s`` after some batches ran, asks the engine to give back what it
keeps (``Engine.release_memory``) and trims the C heap (``release`` does both). Under load it
does nothing, so batches keep their memory warm; one idle moment costs one smallest run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from scheduling.queue import WorkQueue

log = logging.getLogger(__name__)

#: Seconds of idleness after which memory is given back.
IDLE_S = 1.0


class IdleRelease(threading.Thread):
    """Calls ``release`` once per idle spell of ``queue`` that follows work.

    Args:
        queue: The model's work queue (its ``idle_after`` says whether work ran since).
        release: Gives back the engines' memory (``Engine.release_memory`` of each) and the C
            heap's (``telemetry.memory.trim_heap``).
        idle_s: Seconds without work before giving back.
    """

    def __init__(self, queue: WorkQueue, release: Callable[[], None],
                 idle_s: float = IDLE_S) -> None:
        super().__init__(name="idle-release", daemon=True)
        self.queue = queue
        self.release = release
        self.idle_s = idle_s
        self.releases = 0
        self.checks = 0  # idle checks made (for tests: how many have passed)
        self._stopping = threading.Event()
        self._released_after: int | None = 0  # batches done at the last release

    def run(self) -> None:
        """Check every ``idle_s``: idle twice in a row with the same work done, and work done
        since the last release, means an idle spell: give back."""
        seen: int | None = None
        while not self._stopping.wait(self.idle_s):
            done = self.queue.idle_after()
            if done is not None and done == seen and done != self._released_after:
                self._give_back()
                self._released_after = done
            seen = done
            self.checks += 1

    def _give_back(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - an engine that cannot shrink still serves
            log.exception("giving back an idle engine's memory failed")
        self.releases += 1

    def stop(self) -> None:
        """End the thread (at the next check)."""
        self._stopping.set()
