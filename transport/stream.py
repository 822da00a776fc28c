"""A connection's byte stream: what a ``Connection`` calls to move bytes, whatever carries them.

``PlainStream`` is a TCP or Unix socket as it is; ``transport.tls.TLSStream`` adds TLS over TCP.
The connection's reader polls the descriptor itself (``sock``), then calls ``recv``; replies go
out through ``send_now`` (never blocks) or, from the writer thread, ``send_all``; an orderly
close is ``shut_write`` then ``delivered`` (transport/closing.py); ``abort`` wakes every thread
blocked on the socket.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from transport.closing import delivered, shut_write

log = logging.getLogger("server.transport")


class PlainStream:
    """A TCP or Unix socket, without TLS.

    Args:
        sock: The accepted socket (blocking).
        send_timeout_s: How long a blocking write may make no progress (``SO_SNDTIMEO``).
    """

    def __init__(self, sock: socket.socket, send_timeout_s: float) -> None:
        self.sock = sock
        _set_send_timeout(sock, send_timeout_s)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each reply is one small write; without this, Nagle's algorithm can hold a
            # pipelined reply until the client acknowledges the previous one (up to a
            # delayed-ACK timeout). Unix sockets have no such delay (and no such option).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handshake(self, timeout_s: float, still_open: Callable[[], bool]) -> str | None:
        """Set up the stream before any request is read; None when done, else why it failed.
        Nothing to do without TLS."""
        return None

    def recv(self, size: int) -> bytes | None:
        """Up to ``size`` bytes, once the poll said the socket is readable: b"" at EOF, None if
        nothing could be read yet (TLS: a record not complete).

        Raises:
            OSError: the connection broke (a reset).
        """
        return self.sock.recv(size)

    def buffered(self) -> bool:
        """True if bytes are ready that polling the descriptor cannot see (TLS only)."""
        return False

    def send_now(self, data: bytes) -> int:
        """Write what the socket buffer takes now, never blocking; returns the bytes taken.

        Raises:
            OSError: the connection broke.
        """
        try:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def send_all(self, data: bytes) -> None:
        """Write all of ``data``, blocking while the client does not read, each wait bounded
        by the send timeout.

        Raises:
            OSError: the connection broke, or no progress for the send timeout.
        """
        self.sock.sendall(data)

    def shut_write(self) -> bool:
        """Queue the end of the stream behind everything sent; False if the socket is gone."""
        return shut_write(self.sock)

    def delivered(self) -> bool:
        """True once the peer has everything sent (transport/closing.py)."""
        return delivered(self.sock)

    def abort(self) -> None:
        """Shut both directions: wakes the reader and writer blocked on this socket. Any
        thread; the descriptor stays open until ``close``."""
        try:  # the socket's own shutdown: an SSLSocket's would drop TLS state in use
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Close the descriptor (only once no thread uses it)."""
        self.sock.close()


def peer_name(sock: socket.socket, peer: Any) -> str:
    """How logs and thread names call the client: ``HOST:PORT`` over TCP, ``unix:pid=N`` (the
    connecting process, from ``SO_PEERCRED``) over a Unix socket."""
    if sock.family != socket.AF_UNIX:
        return f"{peer[0]}:{peer[1]}"
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):  # not Linux
        return "unix"
    return f"unix:pid={pid}"


def _set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound how long a reply may block on a client that does not read (Linux SO_SNDTIMEO)."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except OSError:
        log.debug("SO_SNDTIMEO not supported here")
