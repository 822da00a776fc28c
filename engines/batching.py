"""The shared, bounded, thread-safe work queue between connection readers and inference sessions.

Pure threading: it knows no sockets. Producers ``put`` work items (blocking while the queue is
full); each inference session calls ``take_batch`` and blocks, without polling, until at least one
item is waiting, then takes whatever is waiting up to its batch cap. ``close`` stops admission;
sessions drain what was admitted and then receive an empty batch, their signal to stop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ServerError, ShuttingDown

#: Called exactly once per work item: (result, None) on success or (None, error) on failure.
Responder = Callable[[dict[str, Any] | None, ServerError | None], None]


@dataclass(eq=False, kw_only=True)
class WorkItem:
    """One admitted request: its features, how to answer it, and whether anyone still listens."""

    features: Any
    respond: Responder
    alive: Callable[[], bool] = lambda: True
    enqueued_at: float = field(default_factory=time.monotonic)


class WorkQueue:
    """A bounded FIFO of work items shared by all reader threads and all sessions.

    Args:
        maxsize: Most items held at once; ``put`` blocks while the queue is full.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._items: deque[WorkItem] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False

    def put(self, item: WorkItem, timeout: float | None = None) -> None:
        """Admit one item, waiting while the queue is full.

        Raises:
            ShuttingDown: the queue was closed (before or while waiting).
            TimeoutError: still full after ``timeout`` seconds.
        """
        with self._not_full:
            if not self._not_full.wait_for(lambda: self._closed or len(self._items) < self.maxsize,
                                           timeout):
                raise TimeoutError("work queue still full")
            if self._closed:
                raise ShuttingDown("server is shutting down; request not admitted")
            self._items.append(item)
            self._not_empty.notify()

    def take_batch(self, max_items: int) -> list[WorkItem]:
        """Block until work is waiting, then take up to ``max_items`` in arrival order.

        Returns:
            The batch; an empty list only once the queue is closed and drained.
        """
        with self._not_empty:
            self._not_empty.wait_for(lambda: self._closed or bool(self._items))
            count = min(max_items, len(self._items))
            batch = [self._items.popleft() for _ in range(count)]
            if batch:
                self._not_full.notify(count)
            if self._items:
                self._not_empty.notify()  # more left: wake another idle session
            return batch

    def close(self) -> None:
        """Refuse new items; wake every waiter. Items already admitted stay to be drained."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
