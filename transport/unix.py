"""The Unix-socket listener's file: bound with stale files replaced, removed on stop.

A Unix socket is a file. A server that crashed leaves it behind, and binding the same path then
fails with EADDRINUSE although nothing listens. ``bind_unix_socket`` tells the cases apart
before it touches anything: a socket file nobody accepts on (connecting is refused) is stale and
replaced; one where a connection is accepted belongs to a live server and fails the start; a
path that is not a socket is never deleted. The file is created with the mode the umask leaves
(docs/operations.md#transport-security).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from transport.errors import BindError

log = logging.getLogger("server.transport")

#: Longest path a Unix socket can be bound to on Linux, in bytes (sun_path holds 108, NUL too).
MAX_PATH_BYTES = 107
#: Seconds a probe of an existing socket file may take to connect.
PROBE_TIMEOUT_S = 1.0

FileIdentity = tuple[int, int]


def bind_unix_socket(path: str) -> socket.socket:
    """A Unix stream socket bound to ``path`` and not listening yet (``Listener.start``
    listens), replacing a stale socket file left there by a server that died.

    Raises:
        BindError: another server listens on ``path``; ``path`` exists and is not a socket;
            its folder is missing or not writable; the path is too long.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            _remove_if_stale(path)
            sock.bind(path)
    except BindError:
        sock.close()
        raise
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot listen on {describe(path)}: "
                        f"{exc.strerror or exc}") from exc
    return sock


def _remove_if_stale(path: str) -> None:
    """Delete ``path`` if it is a socket file nothing listens on; else explain why not.

    Raises:
        BindError: it is not a socket, or a server accepts connections on it, or it cannot be
            told whether one does.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return  # gone meanwhile: bind again
    if not stat.S_ISSOCK(mode):
        raise BindError(errno.EEXIST, f"cannot listen on {describe(path)}: it exists and is not "
                        "a socket; it is left as it is (remove it, or pick another --unix_socket)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            log.info("%s is a stale socket file (nothing listens on it): replacing it",
                     describe(path))
            os.unlink(path)
            return
        except OSError as exc:
            raise BindError(exc.errno, f"cannot listen on {describe(path)}: a socket file is "
                            f"there and probing it failed ({exc.strerror or exc}); it is left "
                            "as it is") from exc
    raise BindError(errno.EADDRINUSE, f"cannot listen on {describe(path)}: another process is "
                    "listening there (another server.py?); stop it or pick another "
                    "--unix_socket")


def describe(path: str) -> str:
    """``unix://`` and the absolute path: how logs and clients name a Unix socket."""
    return "unix://" + os.path.abspath(path)


def socket_path(sock: socket.socket) -> str | None:
    """The path a Unix socket is bound to (None for another family, or an unnamed socket)."""
    if sock.family != socket.AF_UNIX:
        return None
    name = sock.getsockname()
    return name if isinstance(name, str) and name else None


def file_identity(path: str) -> FileIdentity | None:
    """(device, inode) of the socket file at ``path``; None if there is none."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISSOCK(info.st_mode) else None


def remove_socket_file(path: str, identity: FileIdentity | None) -> None:
    """Delete the socket file at ``path`` if it is still the one we bound (``identity``), not
    one another server has put there since."""
    if identity is not None and file_identity(path) == identity:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
