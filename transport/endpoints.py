"""The addresses a server serves: its TCP socket (TLS or not), its Unix socket and its HTTP
API's URL; binding them, naming them for the log and for clients, and publishing the one a
client reads from ``--address_file``."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Protocol

from transport.listener import Listener, bind_socket, publish_address
from transport.unix import bind_unix_socket, describe

#: The hosts that only this machine can reach.
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class HttpEndpoint(Protocol):
    """What the endpoints need of an HTTP front end (http_api/server.py's)."""

    @property
    def address(self) -> tuple[str, int]: ...

    @property
    def url(self) -> str: ...


class Endpoints:
    """One server's addresses. ``listener`` is set once bound; ``tls`` and ``http`` where the
    server serves them.

    Args:
        host, port: The TCP address (port -1: none; 0: a free port).
        unix_socket: The Unix socket's path, or None.
        address_file: Where to publish the address while serving, or None.
    """

    def __init__(self, host: str, port: int, unix_socket: str | None,
                 address_file: str | Path | None) -> None:
        self.host, self.port = host, port
        self.unix_socket, self.address_file = unix_socket, address_file
        self.listener: Listener | None = None
        self.tls: ssl.SSLContext | None = None
        self.http: HttpEndpoint | None = None

    def bind(self) -> list[socket.socket]:
        """The listening sockets, bound: TCP unless ``port`` is -1, and the Unix socket."""
        socks = [bind_socket(self.host, self.port)] if self.port >= 0 else []
        try:
            if self.unix_socket is not None:
                socks.append(bind_unix_socket(self.unix_socket))
            if not socks:
                raise ValueError("nothing to serve on: port -1 and no unix_socket")
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        return socks

    def publish(self, serving: bool) -> None:
        """Write (atomically) or remove the address file, if one is configured: the TCP
        address, or the Unix socket's where there is no TCP listener."""
        if self.address_file is not None:
            address = (self.address if self.tcp_socket() else self.unix_address) \
                if serving else None
            publish_address(self.address_file, address)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) served over TCP."""
        sock = self.tcp_socket()
        assert sock is not None, "no TCP listener (port -1)"
        host, port = sock.getsockname()[:2]
        return host, port

    @property
    def unix_address(self) -> str | None:
        """The Unix socket served, as ``unix:///absolute/path`` (what clients take); None
        without one."""
        return None if self.unix_socket is None else describe(self.unix_socket)

    def describe(self) -> str:
        """Every address served, in words, for the log: TCP first, then the Unix socket and
        the HTTP API's URL."""
        parts = []
        if self.tcp_socket() is not None:
            host, port = self.address
            parts.append(f"{host}:{port}" + (" with TLS" if self.tls is not None else ""))
        if self.unix_address is not None:
            parts.append(self.unix_address)
        if self.http is not None:
            parts.append(self.http.url)
        return " and ".join(parts)

    @property
    def local_only(self) -> bool:
        """Whether only this machine can connect: every address served is a loopback one."""
        hosts = [self.address[0]] if self.tcp_socket() is not None else []
        hosts += [self.http.address[0]] if self.http is not None else []
        return bool(hosts) and all(h in LOOPBACK for h in hosts)

    def tcp_socket(self) -> socket.socket | None:
        """The TCP listening socket; None with port -1."""
        assert self.listener is not None, "not bound yet"
        return next((s for s in self.listener.socks if s.family != socket.AF_UNIX), None)
