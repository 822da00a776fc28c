"""Each HTTP connection's limits, as TCP's connections have them: the cap on open connections
(429 ``too_many_connections`` past it), an idle timeout before the first request
(``--idle_timeout``; between requests it is uvicorn's keep-alive timeout, set to the same), and
what uvicorn with httptools alone does not bound: the time a request's head may take
(``--frame_timeout``, 408), its size (``MAX_HEAD_BYTES``, 431) and the pipelined requests a
connection may queue (``MAX_PIPELINED``: past it, reading stops until the queue shrinks).

``GuardedProtocol`` is uvicorn's httptools protocol with these added; uvicorn builds one per
connection (``Config(http=...)``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from http_api.errors import error_headers, error_json, status_of
from protocol.errors import FrameTimeout, ProtocolError, ServerError, TooManyConnections
from telemetry.stats import ServerStats

#: Most bytes of a request's URL and headers together.
MAX_HEAD_BYTES = 64 * 1024
#: Most requests waiting behind the one being answered on one connection.
MAX_PIPELINED = 16
#: Seconds a connection that got a fatal reply waits for its client to close before it closes.
LINGER_S = 5.0
#: Seconds a connection over the cap is kept for its one 429 reply.
REFUSED_LINGER_S = 5.0


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
        self._head_bytes = 0
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self.flow = PipelineFlow(transport, self.pipeline)
        limits, idle_s = self._limits, self._limits.idle_timeout_s
        if len(self.connections) > limits.max_connections:  # answered at its first request
            limits.stats.count_event("connection_refused")
            self.app = refusing(TooManyConnections(
                f"server has {limits.max_connections} HTTP connections open (max_connections); "
                "retry later"))
            idle_s = min(idle_s or REFUSED_LINGER_S, REFUSED_LINGER_S)
        if idle_s > 0:
            self._arm(idle_s, self._idle)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with its refusals as JSON: a head over ``MAX_HEAD_BYTES`` is 431, bytes
        that are not HTTP 400 ``protocol_error``; either ends the connection (``_linger``)."""
        if self._lingering:  # after a fatal reply: read and dropped
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # ws="none": no upgrade is served
        except httptools.HttpParserError:
            if self._head_bytes > MAX_HEAD_BYTES:
                self._limits.stats.count_event("head_too_large")
                self._answer_and_close(HeadTooLarge(
                    f"the request's URL and headers are over {MAX_HEAD_BYTES} bytes"))
            else:
                self._limits.stats.count_event("protocol_error")
                self._answer_and_close(ProtocolError("not a valid HTTP/1.1 request"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_done, self._head_bytes = False, 0
        self._disarm()
        if self._limits.frame_timeout_s > 0:
            self._arm(self._limits.frame_timeout_s, self._slow_head)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        """Count a piece of the head; past the cap, stop the parser (data_received: 431)."""
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ValueError("head too large")

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
        self._answer_and_close(FrameTimeout(f"the request's head did not arrive within "
                                            f"{self._limits.frame_timeout_s:g} s "
                                            "(frame_timeout)"))

    def _answer_and_close(self, error: ServerError) -> None:
        """Answer ``error`` and close; only closed where an earlier request of the connection
        is still unanswered (its reply is owed first, and would be taken for this one's)."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(raw_response(error))
        self._linger()

    def _linger(self) -> None:
        """Close as a TCP connection does after a fatal reply (transport/closing.py): a FIN
        behind the reply, whatever the client still sends read and dropped, and the close
        once the client closes its side or ``LINGER_S`` has passed. Closing at once would
        reset the connection at the client's next bytes, which can destroy the reply."""
        self._lingering = True
        self._disarm()
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self._arm(LINGER_S, self.transport.close)


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY, as TCP's connections have it: a reply's head and body are two writes.
    uvloop sets it itself; asyncio's own loop only on sockets made with IPPROTO_TCP, which our
    bound socket (transport.bind_socket) is not, and so waited for delayed ACKs (40 ms)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class HeadTooLarge(ServerError):
    """A request's URL and headers are over ``MAX_HEAD_BYTES`` (431)."""

    code = "head_too_large"


class PipelineFlow(FlowControl):
    """uvicorn's flow control, which also keeps reading paused while ``MAX_PIPELINED``
    requests wait behind the one being answered (each ``receive`` of a request resumes it)."""

    def __init__(self, transport: asyncio.Transport, pipeline: Sized) -> None:
        super().__init__(transport)
        self._pipeline = pipeline

    def resume_reading(self) -> None:
        if len(self._pipeline) < MAX_PIPELINED:
            super().resume_reading()


def raw_response(error: ServerError) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, as bytes."""
    body = error_json(error)
    status = status_of(error)
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in error_headers(error).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


_REASONS = {408: "Request Timeout", 429: "Too Many Requests",
            431: "Request Header Fields Too Large"}

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
