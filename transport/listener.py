"""The accept loop, and the refusal of connections beyond the server's cap."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from protocol import encode_frame, error_reply
from protocol.errors import ServerError

log = logging.getLogger("server.transport")


class Listener(threading.Thread):
    """Accepts connections until stopped; blocks in a selector, woken by a socket pair to stop."""

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket, Any], None]) -> None:
        super().__init__(name="listener", daemon=True)
        self.sock = sock
        self.on_accept = on_accept
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def run(self) -> None:
        """Accept loop."""
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    return
                try:
                    client, peer = self.sock.accept()
                except OSError as exc:  # e.g. EMFILE: log, keep serving the others
                    log.warning("accept failed: %s", exc)
                    continue
                try:
                    self.on_accept(client, peer)
                except Exception:  # noqa: BLE001 - one connection never stops the listener
                    log.exception("could not take connection %s", peer)
                    client.close()

    def stop(self) -> None:
        """Stop accepting and close the listening socket."""
        self._wake_w.send(b"x")
        self.join()
        self._selector.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()


def refuse(sock: socket.socket, error: ServerError) -> None:
    """Answer a connection we will not serve with one error reply, then close it; never blocks."""
    try:
        sock.send(encode_frame(error_reply(None, error)), socket.MSG_DONTWAIT)
        sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        sock.recv(65536)  # drop what the client already sent, so closing does not reset
    except OSError:
        pass
    finally:
        sock.close()
