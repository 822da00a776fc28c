"""TLS over TCP (``--tls_cert``, ``--tls_key``, ``--tls_client_ca``): the server's context and
the stream a ``Connection`` moves its bytes through.

Three rules shape ``TLSStream``:

- The handshake runs on the connection's own reader thread, never on the listener's, and is
  bounded as a whole (``--tls_handshake_timeout``), not per read: a client that connects and
  never finishes it holds one connection slot for that long and nothing more.
- An OpenSSL connection (``SSL``) must not be used by two threads at once, yet a connection's
  reader, its writer and the session threads replying on it all do. So the socket is
  non-blocking, every call into OpenSSL holds one lock per connection, and every wait (``poll``)
  happens outside it: the lock is never held for longer than one call.
- ``SSL_write`` that could not finish (``SSLWantWriteError``) may already have taken part of
  its buffer; it must be called again with the same bytes first. ``send_now`` then reports 0
  bytes taken, and the connection keeps the whole frame at the head of its outbox, so the
  writer's next write starts with exactly those bytes.

The framing inside TLS is unchanged (docs/protocol.md). The Unix socket never uses TLS.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from transport.closing import DELIVERY_POLL_S, shut_write
from transport.stream import PlainStream

if TYPE_CHECKING:
    from settings.server_config import ServerConfig


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The server's TLS settings: TLS 1.2 or later, the certificate chain and its key, and, with
    ``client_ca``, a certificate required of every client, signed by one of those CAs.

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: a file is not PEM, or the key does not match the certificate.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    # a client that half-closes (a FIN, no close_notify) is still owed its replies, as over
    # plain TCP; without this OpenSSL 3 treats that FIN as a fatal error and replies fail
    context.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
    context.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    return context


def config_problems(config: ServerConfig) -> list[str]:
    """Whether the config's TLS files make a context (the settings' check of them, given to
    settings/ through its registry); empty without TLS."""
    if config.tls_cert is None or config.tls_key is None:
        return []
    try:
        server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        return [f"--tls_cert/--tls_key/--tls_client_ca: cannot use them ({exc})"]
    return []


class TLSStream(PlainStream):
    """An accepted TCP socket carrying TLS, used by several threads (see the module's rules).

    Args:
        sock: The accepted socket.
        context: ``server_context``'s result; wrapping does no I/O (the handshake comes later).
        send_timeout_s: How long a write may make no progress before ``send_all`` fails.
    """

    def __init__(self, sock: socket.socket, context: ssl.SSLContext,
                 send_timeout_s: float) -> None:
        super().__init__(sock, send_timeout_s)
        self.sock: ssl.SSLSocket = context.wrap_socket(sock, server_side=True,
                                                        do_handshake_on_connect=False)
        self.sock.setblocking(False)
        self.send_timeout_s = send_timeout_s
        self._lock = threading.Lock()  # held for every call into OpenSSL, never while waiting
        self._ended = False  # the end (close_notify or FIN) was read along with data, not yet told

    def handshake(self, timeout_s: float, still_open: Callable[[], bool]) -> str | None:
        """Complete the server's side of the handshake within ``timeout_s`` in all.

        Returns:
            None once done; else why it failed (no secrets: OpenSSL's reason code).
        """
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while still_open():
            try:
                with self._lock:
                    self.sock.do_handshake()
                return None
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            except OSError as exc:  # ssl.SSLError included
                return _reason(exc)
            left = deadline - time.monotonic()
            if left <= 0:
                return f"not completed within {timeout_s:g} s (tls_handshake_timeout)"
            poller.modify(self.sock, events)
            poller.poll(math.ceil(left * 1000))
        return "connection closed"

    def recv(self, size: int) -> bytes | None:
        """Whatever decrypted bytes are ready, up to ``size``: b"" at the end of the stream,
        None when only part of a record has arrived."""
        chunks: list[bytes] = []
        total = 0
        with self._lock:
            if self._ended:
                return b""
            while total < size:
                try:
                    data = self.sock.recv(size - total)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    break
                if not data:
                    if not chunks:
                        return b""
                    self._ended = True  # told on the next call: no poll would see it again
                    break
                chunks.append(data)
                total += len(data)
        return b"".join(chunks) if chunks else None

    def buffered(self) -> bool:
        """True if OpenSSL holds decrypted bytes not yet read, or the end read along with the
        last of them is still to be told (a poll cannot see either)."""
        with self._lock:
            return self._ended or self.sock.pending() > 0

    def send_now(self, data: bytes) -> int:
        """Write ``data`` if the socket takes it now: all of it, or 0, in which case the next
        write must start with the same bytes (see the module's rules)."""
        with self._lock:
            try:
                return self.sock.send(data)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return 0

    def send_all(self, data: bytes) -> None:
        """Write all of ``data``, waiting (outside the lock) while the socket is full.

        Raises:
            TimeoutError: no progress for the send timeout.
            OSError: the connection broke.
        """
        view = memoryview(data)
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while view:
            with self._lock:
                try:
                    view = view[self.sock.send(view):]
                    continue
                except ssl.SSLWantWriteError:
                    pass
                except ssl.SSLWantReadError:  # only renegotiation would read: it is off
                    time.sleep(DELIVERY_POLL_S)
                    continue
            if not poller.poll(math.ceil(self.send_timeout_s * 1000)):
                raise TimeoutError(f"no progress for {self.send_timeout_s:g} s")

    def shut_write(self) -> bool:
        """Send TLS's close_notify, then the TCP FIN behind it. A peer's close_notify is not
        awaited; where the socket is too full to take the alert, the FIN goes alone and the
        client sees its replies, then the end of the stream, unannounced."""
        with self._lock:
            try:
                self.sock.unwrap()
            except (OSError, ValueError):  # WantRead: sent, the peer's not awaited; or failed
                pass
        return shut_write(self.sock)


def _reason(exc: OSError) -> str:
    """Why a handshake failed, in OpenSSL's words (a reason code, never key material)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate refused: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or exc.strerror or type(exc).__name__
    return exc.strerror or type(exc).__name__
