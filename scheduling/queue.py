"""The shared, bounded, thread-safe work queue that sessions take their batches from.

Pure threading: it knows no sockets and no models. Producers ``put`` work items; a full queue
refuses at once with ``Overloaded`` (memory stays bounded, the client learns it now, not later).
A session calls ``take_batch``, which blocks, without polling, until work is waiting, then forms a
batch according to a ``BatchPolicy`` (scheduling/planner.py, pure functions).

Items may carry a deadline: a ``DeadlineReaper`` thread sleeps until the earliest one and answers
every item still queued past its deadline with ``DeadlineExceeded``, whether or not a session is
free. ``purge`` removes items nobody waits for any more (their client left).

``close`` stops admission; sessions drain what was admitted and then get an empty batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import DeadlineExceeded, Overloaded, ServerError, ShuttingDown
from scheduling.deadlines import DeadlineHeap
from scheduling.planner import BatchPolicy, plan_batch, wait_for_more

log = logging.getLogger(__name__)

#: Called exactly once per work item: (result, None) on success or (None, error) on failure.
Responder = Callable[[dict[str, Any] | None, ServerError | None], None]


@dataclass(eq=False, kw_only=True)
class WorkItem:
    """One admitted request: its features and shape, how to answer it, whether anyone listens."""

    features: Any
    respond: Responder
    alive: Callable[[], bool] = lambda: True
    rows: int = 1  # engine rows it needs (context windows)
    length: int = 1  # its longest row, in tokens
    enqueued_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which it must not run
    queued: bool = field(default=False, repr=False)  # in the queue now (set by the queue)
    answered: bool = field(default=False, repr=False)

    def answer(self, result: dict[str, Any] | None, error: ServerError | None) -> None:
        """Call ``respond`` once; later calls do nothing, and a failing responder (a dead
        socket, say) is logged, never raised to the session or reaper that answers."""
        if self.answered:
            return
        self.answered = True
        try:
            self.respond(result, error)
        except Exception:  # noqa: BLE001
            log.exception("responder failed")

    def drop(self) -> None:
        """Its client left before an answer: nothing is sent. A responder with an ``abandon``
        method (dispatch.completion.Completion) counts it; later calls do nothing."""
        if self.answered:
            return
        self.answered = True
        abandon = getattr(self.respond, "abandon", None)
        if abandon is not None:
            abandon()

    def expired(self, now: float) -> bool:
        """Whether its deadline has passed at ``now``."""
        return self.deadline is not None and now >= self.deadline

    def deadline_error(self, now: float) -> DeadlineExceeded:
        """The error that answers it once expired."""
        budget = 1000 * ((self.deadline or now) - self.enqueued_at)
        return DeadlineExceeded(f"deadline of {budget:.0f} ms passed after "
                                f"{1000 * (now - self.enqueued_at):.0f} ms in the queue; not run")


class WorkQueue:
    """A bounded FIFO of work items shared by all reader threads and all sessions.

    Args:
        maxsize: Most items held at once; ``put`` refuses more with ``Overloaded``.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._items: deque[WorkItem] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._expiry = threading.Condition(self._lock)  # the earliest deadline changed, or close
        self._deadlines: DeadlineHeap[WorkItem] = DeadlineHeap()  # may hold taken items
        self._closed = False
        self._busy = 0  # sessions running a batch
        self._arrivals: deque[float] = deque(maxlen=64)
        self._batches_done = 0

    def put(self, item: WorkItem) -> None:
        """Admit one item now, or refuse it now.

        Raises:
            ShuttingDown: the queue was closed.
            Overloaded: ``maxsize`` items are already waiting.
        """
        with self._lock:
            self._check_room()
            item.queued = True
            self._items.append(item)
            self._arrivals.append(item.enqueued_at)
            if item.deadline is not None and self._deadlines.push(item.deadline, item):
                self._expiry.notify()
            self._not_empty.notify()

    def check_room(self) -> None:
        """Raise now what ``put`` would raise now, admitting nothing: lets a producer refuse
        before it does costly work (``put`` checks again).

        Raises:
            ShuttingDown: the queue was closed.
            Overloaded: the queue is full.
        """
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:
        if self._closed:
            raise ShuttingDown("server is shutting down; request not admitted")
        if len(self._items) >= self.maxsize:
            raise Overloaded(f"server overloaded: {self.maxsize} requests already waiting "
                             "(max_queue); retry later")

    def take_batch(self, policy: BatchPolicy | int) -> list[WorkItem]:
        """Block until work is waiting, then form a batch under ``policy``.

        Args:
            policy: A BatchPolicy, or an int for "up to that many, in arrival order".

        Returns:
            The batch; an empty list only once the queue is closed and drained. Each non-empty
            batch must be followed by ``done()`` when the session has finished it.
        """
        if isinstance(policy, int):
            policy = BatchPolicy(mode="fixed", max_items=policy, lookahead=policy)
        with self._not_empty:
            while True:
                self._not_empty.wait_for(lambda: self._closed or bool(self._items))
                if not self._items:
                    return []
                chosen = self._plan(policy)
                wait = self._worth_waiting(policy, chosen)
                if wait <= 0:
                    return self._take(chosen)
                waiting = len(self._items)  # another session may take some meanwhile: re-plan
                self._not_empty.wait_for(lambda: self._closed or len(self._items) != waiting, wait)

    def crowded(self) -> bool:
        """Whether a batch about to run has company: another session running one, or requests
        waiting (read without the lock: a hint, not a promise)."""
        return self._busy > 1 or bool(self._items)

    def done(self) -> None:
        """A session finished the batch it took."""
        with self._lock:
            self._busy -= 1
            self._batches_done += 1

    def idle_after(self) -> int | None:
        """Batches finished so far, where nothing is waiting or running now; None while busy
        (so a watcher can tell an idle moment that follows work from one that follows none)."""
        with self._lock:
            return None if self._busy or self._items else self._batches_done

    def _plan(self, policy: BatchPolicy) -> list[WorkItem]:
        return plan_batch(self._items, policy)

    def _worth_waiting(self, policy: BatchPolicy, chosen: list[WorkItem]) -> float:
        """Seconds left to wait for a bigger batch, or 0 to run ``chosen`` now."""
        if self._closed:
            return 0.0
        return wait_for_more(policy, chosen, len(self._items), self._busy,
                             self._arrival_rate(), time.monotonic())

    def _arrival_rate(self) -> float:
        """Requests per second over the recent arrivals."""
        if len(self._arrivals) < 2:
            return 0.0
        span = self._arrivals[-1] - self._arrivals[0]
        return (len(self._arrivals) - 1) / span if span > 0 else float("inf")

    def _take(self, chosen: list[WorkItem]) -> list[WorkItem]:
        self._remove(chosen)
        self._busy += 1
        if self._items:
            self._not_empty.notify()  # more left: wake another idle session
        return chosen

    def take_upto(self, limit: int, block: bool = True) -> list[WorkItem]:
        """Remove and return up to ``limit`` of the oldest items, in arrival order, without
        forming a batch (a worker process batches them); with ``block``, first wait for work.

        Returns:
            The items; when blocking, an empty list only once the queue is closed and drained.
        """
        with self._not_empty:
            if block:
                self._not_empty.wait_for(lambda: self._closed or bool(self._items))
            taken = [self._items.popleft() for _ in range(min(limit, len(self._items)))]
            for item in taken:
                item.queued = False
            self._removed()
            return taken

    def _remove(self, items: list[WorkItem]) -> None:
        """Take ``items`` out of the queue (lock held); the deadline heap is compacted lazily."""
        for item in items:
            item.queued = False
        if len(items) == 1 and self._items and self._items[0] is items[0]:
            self._items.popleft()
        else:
            self._items = deque(item for item in self._items if item.queued)
        self._removed()

    def _removed(self) -> None:
        """After items left the queue (lock held): compact the deadline heap, wake the reaper
        once the closed queue is empty."""
        if len(self._deadlines) > 2 * len(self._items) + 64:  # taken items' entries pile up
            self._deadlines.keep(lambda item: item.queued)
        if self._closed and not self._items:
            self._expiry.notify_all()

    def wait_expired(self) -> list[WorkItem] | None:
        """Block until queued items pass their deadline; remove and return them.

        Returns:
            The expired items (not answered yet), or None once the queue is closed and empty.
        """
        with self._lock:
            while True:
                if self._closed and not self._items:
                    return None
                now = time.monotonic()
                expired = [item for item in self._deadlines.pop_due(now) if item.queued]
                if expired:
                    self._remove(expired)
                    return expired
                self._expiry.wait(self._deadlines.wait_s(now))

    def purge(self, drop: Callable[[WorkItem], bool]) -> list[WorkItem]:
        """Remove and return every queued item for which ``drop(item)`` is true."""
        with self._lock:
            dropped = [item for item in self._items if drop(item)]
            if dropped:
                self._remove(dropped)
            return dropped

    def close(self) -> None:
        """Refuse new items; wake every waiter. Items already admitted stay to be drained."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._expiry.notify_all()

    @property
    def closed_and_empty(self) -> bool:
        """Closed with nothing left in it: no session will be given another item."""
        with self._lock:
            return self._closed and not self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class DeadlineReaper(threading.Thread):
    """Answers queued items whose deadline passed with ``DeadlineExceeded``, as it passes.

    Runs until the queue is closed and empty. Items are answered outside the queue's lock.
    """

    def __init__(self, queue: WorkQueue) -> None:
        super().__init__(name="deadline-reaper", daemon=True)
        self.queue = queue

    def run(self) -> None:
        """Expire items until the queue is closed and drained."""
        while (expired := self.queue.wait_expired()) is not None:
            now = time.monotonic()
            for item in expired:
                item.answer(None, item.deadline_error(now))
