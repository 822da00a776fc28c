"""The accept loop over the listening sockets (TCP, a Unix socket, or both), and the refusal of
connections beyond the server's cap."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol import encode_frame, error_reply
from protocol.errors import ServerError
from transport.errors import BindError
from transport.unix import describe, file_identity, remove_socket_file, socket_path

log = logging.getLogger("server.transport")


#: Connections the kernel holds for us before accept.
BACKLOG = 512

_BIND_HINTS = {
    errno.EADDRINUSE: "another process is listening there (another server.py?); stop it or "
                      "pick another --port",
    errno.EACCES: "ports below 1024 need privileges; pick another --port",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address; check --host",
}


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and not listening yet, so that a busy port fails
    at once, before any model is loaded; ``Listener.start`` listens.

    Raises:
        BindError: the address is taken, privileged or not this machine's, with a hint.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # names: IPv4, as always
    try:
        _, _, _, _, address = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BindError(f"cannot resolve --host {host!r}: {exc}") from exc
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise _bind_error(exc, host, port) from exc
    return sock


def _bind_error(exc: OSError, host: str, port: int) -> BindError:
    """``exc`` said in words, with what to do about it."""
    hint = _BIND_HINTS.get(exc.errno or 0, "")
    return BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}"
                     + (f" ({hint})" if hint else ""))


class Listener(threading.Thread):
    """Accepts connections on every listening socket until stopped; blocks in one selector,
    woken by a socket pair to stop.

    Built on bound sockets (``bind_socket``, ``transport.unix.bind_unix_socket``); it listens
    only once started, so connections are refused, not left waiting, while the server loads.
    ``stop`` closes them all and removes the Unix socket's file.
    """

    def __init__(self, socks: list[socket.socket],
                 on_accept: Callable[[socket.socket, Any], None]) -> None:
        super().__init__(name="listener", daemon=True)
        self.socks = socks
        self.on_accept = on_accept
        # the file each Unix socket made, so that stop removes it and nothing else
        self._files = {path: file_identity(path) for sock in socks
                       if (path := socket_path(sock)) is not None}
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        for sock in socks:
            self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def start(self) -> None:
        """Listen, then accept in this thread.

        Raises:
            BindError: another process bound the same port meanwhile and listens first (two
                servers started on one port at once both bind; only one can listen), or
                replaced our Unix socket's file as stale while we loaded.
        """
        for sock in self.socks:
            path = socket_path(sock)
            if path is not None and file_identity(path) != self._files[path]:
                raise BindError(errno.EADDRINUSE, f"cannot listen on {describe(path)}: another "
                                "process replaced the socket file while this server loaded "
                                "(another server.py started on the same --unix_socket?)")
            try:
                sock.listen(BACKLOG)
            except OSError as exc:
                if path is not None:
                    raise BindError(exc.errno, f"cannot listen on {describe(path)}: "
                                    f"{exc.strerror}") from exc
                raise _bind_error(exc, *sock.getsockname()[:2]) from exc
        super().start()

    def run(self) -> None:
        """Accept loop."""
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    return
                try:
                    client, peer = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError as exc:  # e.g. EMFILE: log, keep serving the others
                    log.warning("accept failed: %s", exc)
                    continue
                try:
                    self.on_accept(client, peer)
                except Exception:  # noqa: BLE001 - one connection never stops the listener
                    log.exception("could not take connection %s", peer)
                    client.close()

    def stop(self) -> None:
        """Stop accepting (if started), close the listening sockets and remove the Unix
        socket's file (if it is still ours)."""
        if self.is_alive():
            self._wake_w.send(b"x")
            self.join()
        self._selector.close()
        for s in (*self.socks, self._wake_r, self._wake_w):
            s.close()
        for path, identity in self._files.items():
            remove_socket_file(path, identity)


def refuse(sock: socket.socket, error: ServerError, *, reply: bool = True) -> None:
    """Answer a connection we will not serve with one error reply, then close it; never blocks.

    Args:
        reply: False for a TLS listener: the reply would need a handshake, which the listener
            thread never does, so the connection is only closed.
    """
    try:
        if reply:
            sock.send(encode_frame(error_reply(None, error)), socket.MSG_DONTWAIT)
        sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        sock.recv(65536)  # drop what the client already sent, so closing does not reset
    except OSError:
        pass
    finally:
        sock.close()


def publish_address(path: str | Path, address: tuple[str, int] | str | None) -> None:
    """Write ``HOST:PORT`` (or a ``unix:///path`` address) to ``path`` atomically, or remove it
    when ``address`` is None (not serving): what ``client.py --address_file`` and health checks
    read."""
    path = Path(path)
    if address is None:
        path.unlink(missing_ok=True)
        return
    line = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{line}\n", encoding="utf-8")
    tmp.replace(path)
