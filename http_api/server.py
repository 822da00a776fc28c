"""The HTTP listener's lifecycle: bound before the models load (a busy port fails at once, and
probes answer "loading" meanwhile), served by uvicorn on an event loop in a thread of its own
(``http``), and stopped after the models have drained, so that requests admitted before a stop
still get their replies while readiness says 503.

The event loop is uvloop; ``QA_HTTP_LOOP=asyncio`` in the environment runs asyncio's own, as
bench/http_vs_tcp.py does to measure one against the other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import ssl
import threading
import time
from typing import Any

import uvicorn

from http_api.app import HttpApp, ServingState
from http_api.exchange import Intake
from http_api.guard import ConnectionLimits, GuardedProtocol
from http_api.routes import route_table

log = logging.getLogger("server.http")

#: Threads handing HTTP requests to dispatch/ (tokenizing where the layout tokenizes in the
#: front end): TCP has one per connection; a few cover the cores one process can use.
INTAKE_THREADS = max(1, min(4, os.cpu_count() or 1))


class _Server(uvicorn.Server):
    """uvicorn's server on sockets we bound, with our TLS context and handshake limit."""

    def __init__(self, config: uvicorn.Config, tls: ssl.SSLContext | None,
                 handshake_timeout_s: float) -> None:
        super().__init__(config)
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.up = threading.Event()
        self._exit: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state={}, _loop=_loop)

        self.servers = [await self.loop.create_server(
            create_protocol, sock=sock, ssl=self.tls, backlog=config.backlog,
            ssl_handshake_timeout=self.handshake_timeout_s if self.tls else None)
            for sock in sockets or []]
        self.started = True
        self.up.set()

    async def main_loop(self) -> None:
        """Until ``exit()``: the Date header renewed once a second. uvicorn's own loop wakes
        every 0.1 s, and each wake-up takes the GIL from the sessions of this process."""
        self._exit = asyncio.Event()
        while not self.should_exit:
            await self.on_tick(0)  # counter 0: the Date header is renewed
            try:
                await asyncio.wait_for(self._exit.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def exit(self) -> None:
        """Stop serving (any thread)."""
        self.should_exit = True
        if self.loop is not None and self._exit is not None:
            try:
                self.loop.call_soon_threadsafe(self._exit.set)
            except RuntimeError:  # the loop has closed already
                pass

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, without its lifespan (there is none)."""
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(),
                                   self.config.timeout_graceful_shutdown)
        except asyncio.TimeoutError:
            for task in self.server_state.tasks:
                task.cancel()


class HttpFrontEnd:
    """The HTTP API of one server.

    Args:
        state: The server it serves (server.InferenceServer).
        sock: The bound listening socket.
        tls: The TLS context (the TCP listener's), or None for plain HTTP.
    """

    def __init__(self, state: ServingState, sock: socket.socket,
                 tls: ssl.SSLContext | None) -> None:
        self.sock = sock
        self.scheme = "https" if tls is not None else "http"
        cfg = state.config
        self.intake = Intake(state.handler, INTAKE_THREADS, purge=state.models.purge_gone)
        self.app = HttpApp(state, self.intake, route_table)
        limits = ConnectionLimits(cfg.max_connections, cfg.idle_timeout_s, cfg.frame_timeout_s,
                                  state.stats)
        config = uvicorn.Config(self.app, http=functools.partial(GuardedProtocol, limits=limits),
                                ws="none", proxy_headers=False,
                                loop=os.environ.get("QA_HTTP_LOOP", "uvloop"),
                                lifespan="off", log_config=None,
                                access_log=False, server_header=False,
                                timeout_keep_alive=int(max(1, cfg.idle_timeout_s or 86400)),
                                timeout_graceful_shutdown=1)
        self._server = _Server(config, tls, cfg.tls_handshake_timeout_s)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._failure: BaseException | None = None
        host, port = sock.getsockname()[:2]
        self._address = (host, port)  # read while open: stats still name it once closed

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on (also once it is closed)."""
        return self._address

    @property
    def url(self) -> str:
        """Its base URL, for the log."""
        host, port = self.address
        return f"{self.scheme}://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start serving; returns once it accepts connections.

        Raises:
            RuntimeError: the event loop could not start (within ``timeout_s``); what was
                started is stopped.
        """
        self.intake.start()
        self._thread.start()
        until = time.monotonic() + timeout_s
        while not self._server.up.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > until:
                self.stop(1.0)
                raise RuntimeError(f"the HTTP API could not start: {self._failure!r}")

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - reported by start() or the log
            self._failure = exc
            log.exception("the HTTP API stopped")

    def stop(self, timeout: float) -> None:
        """Stop accepting, let the replies in flight go out (at most ``timeout`` seconds),
        close every connection, and stop the intake threads."""
        self._server.config.timeout_graceful_shutdown = max(1.0, timeout)
        self._server.exit()
        self._thread.join(timeout + 2)
        self.intake.stop()
        self.sock.close()

    def describe(self) -> dict[str, Any]:
        """What stats say of it."""
        return {"url": self.url, "connections": len(self._server.server_state.connections)}


def start_http(state: ServingState, tls: ssl.SSLContext | None,
               address: tuple[str, int]) -> HttpFrontEnd:
    """Bind and start the HTTP API at ``address`` (``ServerConfig.http_address``).

    Raises:
        BindError: its address cannot be bound.
    """
    from transport import BindError, bind_socket

    try:
        sock = bind_socket(*address)
    except BindError as exc:
        raise BindError(f"HTTP API (--http_port): {exc}") from exc
    logging.getLogger("uvicorn.error").setLevel(logging.ERROR)  # not a line per bad request
    try:
        front = HttpFrontEnd(state, sock, tls)
        front.start()
    except BaseException:
        sock.close()
        raise
    log.debug("HTTP API on %s (docs/http.md)", front.url)
    return front
