"""One admitted request's way back: a completion that answers exactly once and counts once.

It replaces a chain of callbacks: whoever finishes the request (a session, the deadline reaper, a
worker's pipe, the broker's reply reader, a stop) calls it with the result or a typed error; the
client gone before it ran is ``abandon``-ed instead. Either way the request leaves the model's
in-flight count once, with its outcome.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from protocol.errors import ServerError
from telemetry.stats import ServerStats


class Replier(Protocol):
    """Where a completion's reply goes (transport.Connection; an HTTP exchange,
    http_api/exchange.py), in the encoding of its own protocol."""

    def encode_reply(self, request_id: int, result: dict[str, Any] | None,
                     error: ServerError | None) -> tuple[Any, ServerError | None]:
        """The reply as ``send_reply`` takes it, and its error: a result this protocol cannot
        carry is answered ``internal`` instead (the outcome then counted)."""

    def send_reply(self, reply: Any) -> None:
        """Send the encoded reply of an admitted request (never blocks)."""

    def release(self) -> None:
        """An admitted request will get no reply (its client is gone)."""


class Completion:
    """The single reply of one admitted request.

    Args:
        replier: The connection the request came on.
        request_id: The request's id, echoed in the reply.
        stats: The served model's statistics, counted once on completion.
        admitted_at: ``time.monotonic()`` at admission, for the request's duration.
    """

    __slots__ = ("replier", "request_id", "stats", "admitted_at", "_done", "_lock")

    def __init__(self, replier: Replier, request_id: int, stats: ServerStats,
                 admitted_at: float) -> None:
        self.replier = replier
        self.request_id = request_id
        self.stats = stats
        self.admitted_at = admitted_at
        self._done = False
        self._lock = threading.Lock()

    def _claim(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            done, self._done = self._done, True
        return not done

    @property
    def done(self) -> bool:
        """Answered or abandoned."""
        return self._done

    def __call__(self, result: dict[str, Any] | None, error: ServerError | None) -> None:
        """Answer: count the outcome (before the client can see it), then reply. Later calls
        do nothing."""
        if not self._claim():
            return
        reply, error = self.replier.encode_reply(self.request_id, result, error)
        outcome = "ok" if error is None else error.code
        self.stats.on_finished(outcome, time.monotonic() - self.admitted_at)
        self.replier.send_reply(reply)

    def abandon(self) -> None:
        """The client left before an answer: count ``client_gone``, send nothing."""
        if self._claim():
            self.stats.on_finished("client_gone", None)
            self.replier.release()
