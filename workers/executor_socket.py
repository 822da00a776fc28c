"""The socket under a worker session's connection to an executor, with time limits: the
connection and its key exchange (both sides) within a limit, and each send and receive given
up after a limit the kernel keeps (``SO_SNDTIMEO``, ``SO_RCVTIMEO``). So a stalled executor (a
stopped process, a hung driver) holds a session no longer than its job's deadline, whether in
the connect, the send of a large job (beyond the socket's buffer) or the wait for the answer;
and a worker that leaves during the key exchange ends only its own connection.

A send or receive past its limit raises ``BlockingIOError``; the connection is then out of
step (part of a message may have gone) and must be closed.
"""

from __future__ import annotations

import socket
import struct
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

#: The shortest limit set (the kernel reads 0 as none).
SHORTEST_S = 0.001


def connect(address: str, authkey: bytes, limit_s: float) -> Connection:
    """A connection to the Unix-socket listener at ``address``, its key exchanged (as
    ``multiprocessing.connection.Client`` does), all within about ``limit_s`` seconds; its
    sends and receives keep that limit until ``set_limit`` changes it.

    Raises:
        OSError: no connection (refused, missing, or too slow: ``BlockingIOError``).
        EOFError: the listener closed it during the exchange.
        multiprocessing.AuthenticationError: the key does not match.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _set(sock, limit_s)  # a blocking connect waits for room in the backlog this long
        sock.connect(address)
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def accept_key(conn: Connection, authkey: bytes, limit_s: float) -> bool:
    """The listener's side of the key exchange on a connection accepted without one, within
    ``limit_s`` (its sends and receives then wait as long as it takes); False, and the
    connection closed, where the peer failed it, left or took too long."""
    try:
        set_limit(conn, limit_s)
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        set_limit(conn, None)
        return True
    except (OSError, EOFError, AuthenticationError):
        conn.close()
        return False


def set_limit(conn: Connection, limit_s: float | None) -> None:
    """Each send and receive on ``conn`` from now on gives up after ``limit_s`` seconds
    (``BlockingIOError``); None: waits as long as it takes."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        _set(sock, limit_s)
    finally:
        sock.detach()  # the connection keeps its descriptor


def _set(sock: socket.socket, limit_s: float | None) -> None:
    seconds = 0.0 if limit_s is None else max(SHORTEST_S, limit_s)
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
