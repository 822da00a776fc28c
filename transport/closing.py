"""How a socket is closed without destroying replies the client has not yet received.

Closing a socket whose receive buffer still holds unread client bytes makes the kernel send a
reset instead of a FIN, and a reset throws away whatever the socket had sent but the client had
not yet acknowledged. A server that stops while a client is still sending (a pipelining client,
or one whose stream went on past a bad frame) would lose its last replies that way. So a
connection that ends on purpose first shuts its write side (a FIN queued behind the replies),
keeps discarding input, and closes only once the client has acknowledged everything sent.

The same steps serve every stream. Over TLS, ``transport.tls.TLSStream.shut_write`` sends
close_notify before the FIN. Over a Unix socket, SIOCOUTQ counts the memory of what was sent
and the client has not read yet, so it reaches 0 once the client has *read* every reply (there
is no network in between to acknowledge); closing with unread input there lets the client read
what was sent, then reports a reset instead of the end of the stream.
"""

from __future__ import annotations

import array
import fcntl
import socket
import termios
import threading
import time
from collections.abc import Sequence
from typing import Protocol

#: Seconds between looks at a closing socket's unacknowledged bytes.
DELIVERY_POLL_S = 0.01


def unacknowledged_bytes(sock: socket.socket) -> int | None:
    """Bytes written to ``sock`` that the peer has not acknowledged yet (Linux SIOCOUTQ); over
    a Unix socket, the memory of what the peer has not read yet (0 exactly when it has read all).

    Returns:
        The count, or None where the platform cannot tell (then callers wait for EOF or time).
    """
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf, True)
    except (OSError, ValueError):
        return None
    return buf[0]


def delivered(sock: socket.socket) -> bool:
    """True once the peer has acknowledged every byte sent (known only where SIOCOUTQ works)."""
    return unacknowledged_bytes(sock) == 0


def shut_write(sock: socket.socket) -> bool:
    """Queue a FIN behind everything sent so far. Returns False if the socket is already gone.

    It calls the socket's own shutdown: an ``ssl.SSLSocket``'s would also drop its TLS state,
    which other threads may be using."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_WR)
    except OSError:
        return False
    return True


class Finishing(Protocol):
    """A connection that closes in steps (transport.Connection)."""

    thread: threading.Thread

    def finish(self) -> bool: ...

    def close(self) -> None: ...


def finish_all(connections: Sequence[Finishing], deadline: float) -> None:
    """Close every connection once its client has every reply, all at once, polling each every
    ``DELIVERY_POLL_S``; at ``deadline`` (``time.monotonic()``) those left are closed anyway (a
    client that does not read loses what is left); then join their threads."""
    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    finishing = list(connections)
    while finishing := [conn for conn in finishing if not conn.finish()]:
        if left() <= 0:
            break
        time.sleep(DELIVERY_POLL_S)
    for conn in finishing:
        conn.close()
    for conn in connections:
        conn.thread.join(left())
