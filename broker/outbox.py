"""A worker's way back: replies to each front end's stream, and the work entries acknowledged
and deleted, for everything answered since the last send, in one round trip.

A session answers its batch inside ``coalesced_sends()``: the batch's replies are held and, at
the end of the block, sent by the session's own thread when nothing else is being sent and no
work waits for the session (transport/bulk.py; one try, within the client's timeouts; the
outbox thread retries a failure, so an unreachable Redis never holds a session longer). Under
load, or outside such a block, the outbox thread sends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from broker.connect import BROKER_ERRORS, GROUP, Keys
from broker.wire import FIELD
from transport.bulk import BulkSender

log = logging.getLogger(__name__)

#: A front end's reply stream is cut (approximately) to this many entries; it reads and
#: deletes them as they come, so only a front end that stopped reading reaches it.
REPLY_MAXLEN = 100_000
#: Sends tried before a bulk of replies is given up (its entries stay pending in Redis and are
#: claimed again after the visibility timeout; the front ends answered them ``unavailable``).
SEND_TRIES = 20
RETRY_S = 0.5


#: One reply: the work entry it settles, the front end's reply stream (None: nobody to answer,
#: only settle the entry) and the reply.
Reply = tuple[bytes, str | None, bytes | None]


class ReplyOutbox:
    """Collects (entry id, reply stream, reply) from the session threads and sends them in bulk
    (transport/bulk.py), one pipeline a bulk.

    Args:
        client: A Redis client.
        keys: The deployment's keys.
        on_sent: Called with the number of entries settled (sent, or given up) after each send.
        idle: True when no work waits for a session: only then does a session's thread send
            its own batch's replies (default: never).
    """

    def __init__(self, client: redis.Redis, keys: Keys, on_sent: Callable[[int], None],
                 idle: Callable[[], bool] = lambda: False) -> None:
        self.client, self.keys, self.on_sent = client, keys, on_sent
        self._bulk: BulkSender[Reply] = BulkSender(self._send_bulk, "broker-outbox",
                                                   self._send_inline, idle)
        self.lost = 0  # replies given up after SEND_TRIES

    def start(self) -> None:
        """Start the sending thread."""
        self._bulk.start()

    def put(self, entry_id: bytes, reply_to: str | None, reply: bytes | None) -> None:
        """Queue one reply (any thread; never waits on an unreachable Redis; inside a session's
        ``coalesced_sends()``, sent when the block ends). ``reply_to`` None: only acknowledge
        and delete the entry (nobody to answer)."""
        self._bulk.put((entry_id, reply_to, reply))

    def _send_inline(self, bulk: list[Reply]) -> bool:
        """A session's one try at its batch's replies (else the outbox thread retries)."""
        if self._send_once(bulk) is not None:
            return False
        self.on_sent(len(bulk))
        return True

    def _send_bulk(self, bulk: list[Reply]) -> bool:
        """The outbox thread's send: tried until it goes or is given up (settled either way,
        even where something unforeseen raised: the worker's count of entries held drains)."""
        try:
            self._send(bulk)
        except Exception:
            self.lost += len(bulk)
            raise
        finally:
            self.on_sent(len(bulk))
        return True

    def _pipeline(self, bulk: list[Reply]) -> Any:
        """The replies of ``bulk``, and its entries acknowledged and deleted, as one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        for _, reply_to, reply in bulk:
            if reply_to is not None and reply is not None:
                pipe.xadd(reply_to, {FIELD: reply}, maxlen=REPLY_MAXLEN,
                          approximate=True, nomkstream=True)
        ids = [entry_id for entry_id, _, _ in bulk]
        pipe.xack(self.keys.work, GROUP, *ids)
        pipe.xdel(self.keys.work, *ids)
        return pipe

    def _send_once(self, bulk: list[Reply]) -> BaseException | None:
        """One try at sending ``bulk``: None if sent, else why the broker could not take it."""
        try:
            self._pipeline(bulk).execute(raise_on_error=False)  # a front end gone: its stream too
        except BROKER_ERRORS as exc:
            return exc
        return None

    def _send(self, bulk: list[Reply]) -> None:
        for attempt in range(SEND_TRIES):
            if (error := self._send_once(bulk)) is None:
                return
            if attempt == 0:
                log.warning("cannot send %d replies (%s); retrying", len(bulk), error)
            if self._bulk.closed and attempt >= 2:
                break
            time.sleep(RETRY_S)
        self.lost += len(bulk)
        log.error("gave up sending %d replies; their entries stay pending in the broker",
                  len(bulk))

    @property
    def backlog(self) -> int:
        """Replies waiting to be sent."""
        return self._bulk.backlog

    def close(self, timeout: float) -> None:
        """Send what is queued, then stop."""
        self._bulk.close(timeout)
