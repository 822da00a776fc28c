"""Messages from many threads, sent in bulk by one: the outbox of a worker process (its answers
to the front end, workers/worker_main.py) and of a Redis worker (its replies and settled
entries, broker/outbox.py).

While a send is under way, the next items gather into the next bulk: a burst of answers costs
one send, not one per answer, and no thread that answers ever waits on the way out (a full
pipe, an unreachable broker).

A session answers its batch inside ``transport.coalesce.coalesced_sends()``: what it puts is
held and, at the end of the block, sent by the session's own thread, one try, when the sender
is idle, nothing waits to be sent and ``idle()`` says no work waits for the session; else the
sending thread sends it. That spares the sending thread's wake-up (about 0.1 ms on an idle
machine) on a lone request's way back, and costs a busy session nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from transport.coalesce import holding

T = TypeVar("T")

log = logging.getLogger(__name__)


class BulkSender(Generic[T]):
    """Items put by any thread, sent in bulk by a thread of its own (see the module).

    Args:
        send: Sends one bulk, in the order put; returns False where the peer is gone, after
            which nothing more is sent (items put later are dropped: nobody takes them).
        name: The sending thread's name.
        send_once: One try at sending a session's held bulk on its own thread; True if sent
            (else the sending thread sends it, first). Default: ``send``.
        idle: Whether no work waits for the sessions now (default: never, so held bulks go
            through the sending thread).
    """

    def __init__(self, send: Callable[[list[T]], bool], name: str,
                 send_once: Callable[[list[T]], bool] | None = None,
                 idle: Callable[[], bool] = lambda: False) -> None:
        self._send = send
        self._send_once = send_once or send
        self.idle = idle
        self._held = threading.local()  # each session thread's items of its batch
        self._items: list[T] = []
        self._cond = threading.Condition()
        self._closed = False
        self._gone = False
        self._sending = False  # a bulk is on its way (by the sending thread, or a claimer)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the sending thread."""
        self._thread.start()

    def put(self, item: T) -> None:
        """Queue one item (any thread; never waits on the send); inside
        ``coalesced_sends()``, hold it until the block ends."""
        if holding(self):
            if getattr(self._held, "items", None) is None:
                self._held.items = []
            self._held.items.append(item)
            return
        self.extend((item,))

    def flush_held(self) -> None:
        """Send what this thread held (``transport.coalesce.Holder``): at once on this thread
        where the sender is idle and ``idle()``, else through the sending thread."""
        bulk, self._held.items = getattr(self._held, "items", None) or [], None
        if not bulk:
            return
        if not (self.idle() and self.claim_idle()):
            self.extend(bulk)
            return
        sent = False
        try:
            sent = self._send_once(bulk)
        finally:
            self.release([] if sent else bulk)

    def extend(self, items: Iterable[T]) -> None:
        """Queue items, in order, for the next bulk."""
        with self._cond:
            if not self._gone:
                self._items.extend(items)
                self._cond.notify()

    def claim_idle(self) -> bool:
        """True, and the sender is this caller's until ``release``, where nothing is being sent,
        nothing waits and it is not closed; else False (the caller queues its items instead)."""
        with self._cond:
            if self._sending or self._items or self._closed or self._gone:
                return False
            self._sending = True
            return True

    def release(self, unsent: list[T]) -> None:
        """End a claim; ``unsent``: what the claimer could not send, sent next, first."""
        with self._cond:
            self._sending = False
            if not self._gone:
                self._items[:0] = unsent
            self._cond.notify()

    @property
    def backlog(self) -> int:
        """Items waiting to be sent."""
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        """``close`` was called: what is queued goes, then the thread ends."""
        return self._closed

    def close(self, timeout: float) -> None:
        """Send what is queued, then stop the thread (waiting at most ``timeout`` seconds)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._sending and (
                    bool(self._items) or self._closed))
                bulk, self._items = self._items, []
                if not bulk:
                    return
                self._sending = True
            try:
                sent = self._send(bulk)
            except Exception:  # noqa: BLE001 - that bulk is lost (said); the next ones go
                log.exception("%s: sending %d items failed", self._thread.name, len(bulk))
                sent = True
            with self._cond:
                self._sending = False
                if not sent:  # the peer is gone: nobody to send to
                    self._gone, self._items = True, []
            if not sent:
                return
