"""Where a client connects, and how: the one place that opens a client's connection.

A server address is a ``host`` and a ``port``, or a Unix socket written ``unix:///path/qa.sock``
in place of the host (everything after ``unix://`` is the path, so ``unix://qa.sock`` is
relative; the port is then ignored). ``open_socket`` connects, over TLS where asked (TCP only:
the server's Unix socket never uses TLS), and returns a ``ByteStream``.

    sock = open_socket("unix:///run/qa/qa.sock", 0, timeout=10)
    sock = open_socket("qa.example.org", 9999, timeout=10, tls=True, tls_ca="ca.crt")
"""

from __future__ import annotations

import errno
import select
import socket
import ssl
import threading
import time
from typing import Protocol

#: How a host string names a Unix socket.
UNIX_SCHEME = "unix://"
#: Longest single wait of a TLS socket, in ms; it then looks whether it was closed meanwhile.
_WAIT_MS = 1000


class SendTimeout(TimeoutError):
    """The server did not take a whole frame before the deadline.

    Attributes:
        clean: Nothing of it was written, so the connection may go on; else the stream holds
            part of a frame (or, over TLS, a write OpenSSL must finish) and must be closed.
    """

    def __init__(self, clean: bool) -> None:
        super().__init__("the server took no more of the request before the timeout ran out")
        self.clean = clean


class ByteStream(Protocol):
    """What ``Client`` needs of a connection: a plain socket, or ``TLSSocket``."""

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes, blocking until some arrive; b"" at the end."""

    def sendall(self, data: bytes) -> None:
        """Write all of ``data``, blocking while the server does not read."""

    def shutdown(self, how: int) -> None:
        """Shut one or both directions (wakes a thread blocked in ``recv``)."""

    def close(self) -> None:
        """Close the connection."""


def unix_path(host: str) -> str | None:
    """The socket path of a ``unix://PATH`` host; None for a TCP host."""
    return host[len(UNIX_SCHEME):] if host.startswith(UNIX_SCHEME) else None


def describe(host: str, port: int, tls: bool = False) -> str:
    """The address in words: ``HOST:PORT`` (with ``(TLS)``) or ``unix://PATH``."""
    if unix_path(host) is not None:
        return host
    return f"{host}:{port}" + (" (TLS)" if tls else "")


def client_context(ca: str | None = None, cert: str | None = None,
                   key: str | None = None) -> ssl.SSLContext:
    """A client's TLS settings: TLS 1.2 or later, the server's certificate checked against
    ``ca`` (PEM; None: the system's trusted CAs) and the host name, and with ``cert`` (and its
    ``key``, if in another file) a client certificate for servers that require one.

    Raises:
        OSError: a file cannot be read; ``ssl.SSLError``: it is not usable PEM.
    """
    context = ssl.create_default_context(cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def check_tls_options(host: str, tls: bool, tls_ca: str | None, tls_cert: str | None,
                      tls_key: str | None) -> None:
    """Refuse TLS options that cannot apply (both clients check them before connecting).

    Raises:
        ValueError: TLS files without ``tls``, or TLS asked for a Unix socket.
    """
    if not tls and (tls_ca or tls_cert or tls_key):
        raise ValueError("tls_ca, tls_cert and tls_key need tls=True")
    if tls and unix_path(host) is not None:
        raise ValueError(f"{host} is a Unix socket: the server serves it without TLS")


def send_by(sock: ByteStream, data: bytes, deadline: float | None) -> None:
    """Write all of ``data``; with ``deadline`` (``time.monotonic()``), give up when it passes.

    Raises:
        SendTimeout: the deadline passed first.
        OSError: the connection broke.
    """
    if deadline is None:
        sock.sendall(data)
    elif isinstance(sock, TLSSocket):
        sock.sendall(data, deadline)
    else:
        _send_plain(sock, data, deadline)  # type: ignore[arg-type]


def _send_plain(sock: socket.socket, data: bytes, deadline: float) -> None:
    """``send_by`` on a blocking plain socket: only writes that cannot block, waits in poll."""
    view, poller = memoryview(data), select.poll()
    poller.register(sock, select.POLLOUT)
    while view:
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT):]
            continue
        except BlockingIOError:
            pass
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0 or not poller.poll(left_ms):
            raise SendTimeout(clean=len(view) == len(data))


def open_socket(host: str, port: int, *, timeout: float, tls: bool = False,
                tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None) -> ByteStream:
    """Connect to the server at ``host``/``port`` (or ``unix://PATH``), within ``timeout``
    seconds, TLS handshake included; the stream returned blocks without a time limit.

    Raises:
        ValueError: TLS asked for a Unix socket, or TLS files given without ``tls``.
        OSError: the connection (or the handshake: ``ssl.SSLError``) failed.
    """
    check_tls_options(host, tls, tls_ca, tls_cert, tls_key)
    path = unix_path(host)
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _connect(sock, path, timeout)
        return sock
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests are small writes
    if not tls:
        sock.settimeout(None)
        return sock
    try:
        return TLSSocket(client_context(tls_ca, tls_cert, tls_key).wrap_socket(
            sock, server_hostname=host))  # the handshake, within the connect timeout
    except BaseException:
        sock.close()
        raise


def _connect(sock: socket.socket, address: str, timeout: float) -> None:
    """Connect ``sock`` within ``timeout``, then make it block; close it on failure."""
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise


class TLSSocket:
    """A client's TLS connection, shared by a reader thread and sender threads.

    One OpenSSL connection must not be used by two threads at once, so the socket is
    non-blocking, each call into OpenSSL holds a lock, and waits happen outside it.

    Args:
        sock: A connected ``ssl.SSLSocket`` whose handshake is done.
    """

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._lock = threading.Lock()
        self._closed = False

    def recv(self, size: int) -> bytes:
        """Up to ``size`` decrypted bytes, waiting until some arrive; b"" at the end.

        Raises:
            OSError: the connection broke, or was closed (``ssl.SSLError`` for TLS alerts).
        """
        while True:
            with self._lock:
                self._check_open()
                try:
                    return self.sock.recv(size)
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
            self._wait(events)

    def sendall(self, data: bytes, deadline: float | None = None) -> None:
        """Write all of ``data``, waiting while the server does not read (until ``deadline``,
        a ``time.monotonic()``, if given).

        Raises:
            SendTimeout: the deadline passed first (never clean: OpenSSL may hold part of it).
            OSError: the connection broke, or was closed.
        """
        view = memoryview(data)
        while view:
            with self._lock:
                self._check_open()
                try:  # a write that stops short must be retried with the same bytes: it is
                    view = view[self.sock.send(view):]
                    continue
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
                except ssl.SSLWantReadError:
                    events = select.POLLIN
            if deadline is not None and time.monotonic() >= deadline:
                raise SendTimeout(clean=False)
            self._wait(events, deadline)

    def shutdown(self, how: int) -> None:
        """Shut the TCP connection's directions (the socket's own shutdown: an SSLSocket's
        would drop its TLS state while the reader uses it)."""
        socket.socket.shutdown(self.sock, how)

    def close(self) -> None:
        """Close the connection; a thread still in ``recv`` or ``sendall`` gets OSError."""
        self._closed = True
        with self._lock:
            self.sock.close()

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "the connection was closed")

    def _wait(self, events: int, deadline: float | None = None) -> None:
        """Wait (outside the lock) until the socket may be ready for ``events``, at most a
        second, and not past ``deadline``."""
        poller = select.poll()
        try:
            poller.register(self.sock, events)
        except (OSError, ValueError) as exc:  # closed meanwhile
            raise OSError(errno.EBADF, "the connection was closed") from exc
        wait_ms = _WAIT_MS if deadline is None else \
            max(0, min(_WAIT_MS, int((deadline - time.monotonic()) * 1000) + 1))
        poller.poll(wait_ms)
