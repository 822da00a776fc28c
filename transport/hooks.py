"""What a connection needs from the server that owns it, and nothing more (transport/ knows no
requests: it hands each decoded message to ``handle``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from protocol.errors import ServerError
from telemetry.stats import ServerStats

if TYPE_CHECKING:
    from transport.connection import Connection

Expiry = Callable[[], ServerError]
"""Builds the fatal error a connection is closed with when one of its deadlines passes."""


class ServerHooks(Protocol):
    """What a connection needs from the server that owns it."""

    max_frame_size: int
    send_timeout_s: float
    max_outbox_bytes: int
    idle_timeout_s: float
    frame_timeout_s: float
    tls_handshake_timeout_s: float
    stats: ServerStats

    def handle(self, message: Any, conn: Connection) -> None:
        """Answer or admit one decoded request (dispatch/handler.py); never raises."""

    def forget(self, conn: Connection) -> None:
        """The connection has closed."""

    def flush(self) -> None:
        """The requests of one read were admitted: hand them on together."""
