"""A worker's way back: replies to each front end's stream, and the work entries acknowledged
and deleted, for everything answered since the last send, in one round trip."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from broker.connect import BROKER_ERRORS, GROUP, Keys
from broker.wire import FIELD

log = logging.getLogger(__name__)

#: A front end's reply stream is cut (approximately) to this many entries; it reads and
#: deletes them as they come, so only a front end that stopped reading reaches it.
REPLY_MAXLEN = 100_000
#: Sends tried before a bulk of replies is given up (its entries stay pending in Redis and are
#: claimed again after the visibility timeout; the front ends answered them ``unavailable``).
SEND_TRIES = 20
RETRY_S = 0.5


class ReplyOutbox(threading.Thread):
    """Collects (entry id, reply stream, reply) from the session threads; one thread sends.

    Args:
        client: A Redis client.
        keys: The deployment's keys.
        on_sent: Called with the number of entries settled (sent, or given up) after each send.
    """

    def __init__(self, client: redis.Redis, keys: Keys, on_sent: Callable[[int], None]) -> None:
        super().__init__(name="broker-outbox", daemon=True)
        self.client, self.keys, self.on_sent = client, keys, on_sent
        self._queue: list[tuple[bytes, str | None, bytes | None]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.lost = 0  # replies given up after SEND_TRIES

    def put(self, entry_id: bytes, reply_to: str | None, reply: bytes | None) -> None:
        """Queue one reply (any thread; never blocks on Redis). ``reply_to`` None: only
        acknowledge and delete the entry (nobody to answer)."""
        with self._cond:
            self._queue.append((entry_id, reply_to, reply))
            if len(self._queue) == 1:
                self._cond.notify()

    def run(self) -> None:
        """Send whatever has gathered, until closed and empty."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                bulk, self._queue = self._queue, []
                if not bulk and self._closed:
                    return
            self._send(bulk)
            self.on_sent(len(bulk))

    def _send(self, bulk: list[tuple[bytes, str | None, bytes | None]]) -> None:
        for attempt in range(SEND_TRIES):
            try:
                pipe = self.client.pipeline(transaction=False)
                for _, reply_to, reply in bulk:
                    if reply_to is not None and reply is not None:
                        pipe.xadd(reply_to, {FIELD: reply}, maxlen=REPLY_MAXLEN,
                                  approximate=True, nomkstream=True)
                ids = [entry_id for entry_id, _, _ in bulk]
                pipe.xack(self.keys.work, GROUP, *ids)
                pipe.xdel(self.keys.work, *ids)
                pipe.execute(raise_on_error=False)  # a front end gone: its stream is too
                return
            except BROKER_ERRORS as exc:
                if attempt == 0:
                    log.warning("cannot send %d replies (%s); retrying", len(bulk), exc)
                if self._closed and attempt >= 2:
                    break
                time.sleep(RETRY_S)
        self.lost += len(bulk)
        log.error("gave up sending %d replies; their entries stay pending in the broker",
                  len(bulk))

    @property
    def backlog(self) -> int:
        """Replies waiting to be sent."""
        with self._cond:
            return len(self._queue)

    def close(self, timeout: float) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.join(timeout)
