"""What the blocking and the asyncio client share: the connection-lost error and argument checks.

Only the standard library and :mod:`protocol` are imported here, so every client stays light
(the client's Docker image installs msgpack alone).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

#: A reply's result map, as both clients return it.
Result = dict[str, Any]


class ConnectionLost(ConnectionError):
    """The connection closed (or broke) before the reply arrived."""


def text_list(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list; one string is refused (it would be sent as its characters).

    Raises:
        TypeError: ``texts`` is one string.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string")
    return list(texts)


def deadline_ms(timeout: float | None) -> float | None:
    """The ``timeout_ms`` a request carries when its caller waits ``timeout`` seconds, so the
    server does not run a request nobody waits for any more (None: the server's default)."""
    return None if timeout is None else 1000 * timeout


def shut(sock: Any) -> None:
    """Shut both directions of a client's socket (its reader thread wakes, the server sees the
    end) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
