"""One admitted request's way back: a completion that answers exactly once and counts once.

It replaces a chain of callbacks: whoever finishes the request (a session, the deadline reaper, a
worker's pipe, the broker's reply reader, a stop) calls it with the result or a typed error; the
client gone before it ran is ``abandon``-ed instead. Either way the request leaves the model's
in-flight count once, with its outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from protocol.codec import encode_frame
from protocol.errors import InternalError, ServerError
from protocol.messages import error_reply, ok_reply
from telemetry.stats import ServerStats

log = logging.getLogger(__name__)


class Replier(Protocol):
    """Where a completion's reply goes (transport.Connection)."""

    def send_reply(self, frame: bytes) -> None:
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
        frame, error = encoded_reply(self.request_id, result, error)
        outcome = "ok" if error is None else error.code
        self.stats.on_finished(outcome, time.monotonic() - self.admitted_at)
        self.replier.send_reply(frame)

    def abandon(self) -> None:
        """The client left before an answer: count ``client_gone``, send nothing."""
        if self._claim():
            self.stats.on_finished("client_gone", None)
            self.replier.release()


def encoded_reply(request_id: int, result: dict[str, Any] | None,
                  error: ServerError | None) -> tuple[bytes, ServerError | None]:
    """The reply's frame, and its error: a result msgpack cannot carry (a plug-in's numpy
    scalar or set, a list for a map) is answered ``internal`` instead, for this request alone."""
    if error is None:
        try:
            return encode_frame(ok_reply(request_id, result or {})), None
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("request %s: its result cannot be sent (%s: %s)", request_id,
                      type(exc).__name__, exc)
            error = InternalError(f"the result could not be encoded: {type(exc).__name__}")
    try:
        return encode_frame(error_reply(request_id, error)), error
    except (TypeError, ValueError, OverflowError):  # a plug-in's error with an odd message
        error = InternalError(f"the {error.code} error could not be encoded")
        return encode_frame(error_reply(request_id, error)), error
