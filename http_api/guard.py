"""Each HTTP connection's limits, as TCP's connections have them: the cap on open connections
(429 ``too_many_connections`` past it), an idle timeout before the first request
(``--idle_timeout``; between requests it is uvicorn's keep-alive timeout, set to the same), and
a timeout on a request's head (``--frame_timeout``, 408), which uvicorn alone does not have.

``GuardedProtocol`` is uvicorn's httptools protocol with these added; uvicorn builds one per
connection (``Config(http=...)``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from http_api.errors import error_headers, error_json, status_of
from protocol.errors import FrameTimeout, ServerError, TooManyConnections
from telemetry.stats import ServerStats

#: The scope key of the ``time.monotonic()`` at which a request's first byte arrived.
BEGAN = "qa_began"


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of every HTTP connection, and where refusals are counted."""

    max_connections: int
    idle_timeout_s: float
    frame_timeout_s: float
    stats: ServerStats


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the server's connection limits."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._timer: asyncio.TimerHandle | None = None
        self._head_done = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self._limits
        if len(self.connections) > limits.max_connections:
            limits.stats.count_event("connection_refused")
            self.app = refusing(TooManyConnections(
                f"server has {limits.max_connections} HTTP connections open (max_connections); "
                "retry later"))
        if limits.idle_timeout_s > 0:
            self._arm(limits.idle_timeout_s, self._idle)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[BEGAN] = time.monotonic()  # type: ignore[literal-required]
        self._head_done = False
        self._disarm()
        if self._limits.frame_timeout_s > 0:
            self._arm(self._limits.frame_timeout_s, self._slow_head)

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle(self) -> None:
        """No request since the connection opened: close it, as uvicorn does after its
        keep-alive timeout."""
        self._timer = None
        if not self.transport.is_closing():
            self._limits.stats.count_event("idle_timeout")
            self.transport.close()

    def _slow_head(self) -> None:
        """A request's head is still arriving after ``frame_timeout_s`` (slowloris): 408."""
        self._timer = None
        if self._head_done or self.transport.is_closing():
            return
        self._limits.stats.count_event(FrameTimeout.code)
        error = FrameTimeout(f"the request's head did not arrive within "
                             f"{self._limits.frame_timeout_s:g} s (frame_timeout)")
        self.transport.write(raw_response(error))
        self.transport.close()


def raw_response(error: ServerError) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, as bytes."""
    body = error_json(error)
    status = status_of(error)
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in error_headers(error).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


_REASONS = {408: "Request Timeout", 429: "Too Many Requests"}

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def refusing(error: ServerError) -> Asgi:
    """An ASGI app that answers every request with ``error`` and closes the connection."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = error_json(error)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode("ascii")),
                   *((k.encode(), v.encode()) for k, v in error_headers(error).items())]
        await send({"type": "http.response.start", "status": status_of(error),
                    "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
