"""A raw-TCP, msgpack-framed question-answering inference server.

    python prepare_model.py && python server.py        # 127.0.0.1:9999; ONNX on the CPU,
                                                       # PyTorch fp16 on a GPU box
    python server.py --host 0.0.0.0 --inference_engine_type pytorch
    python server.py --unix_socket /run/qa/qa.sock --port -1           # a Unix socket only
    python server.py --host 0.0.0.0 --tls_cert server.crt --tls_key server.key   # TLS

A listener thread accepts connections; each connection's reader thread decodes frames and hands
each request to dispatch/, which routes it to a model, whose task tokenizes it onto that model's
bounded queue. Each model's inference-session threads, each with its own engine, take batches from
its queue and write every reply back on its client's socket. This module assembles the parts and
runs their lifecycle; see docs/architecture.md and docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from dispatch.auth import Authenticator, TokenSet
from dispatch.handler import RequestHandler
from dispatch.models import ModelSet
from dispatch.registry import setting_registry
from dispatch.report import collect_stats
from dispatch.serving_log import log_loading, log_ready, log_serving, log_start
from engines.base import Engine
from engines.devices import check_cuda_devices
from engines.sim_device import new_folder_name
from protocol.errors import BadRequest, TooManyConnections
from protocol.messages import ModelsRequest, PingRequest, Request, StatsRequest
from scheduling.waits import StartCancelled, raise_if_cancelled, wait_until_set
from settings.server_config import ServerConfig, given_settings, parse_args
from telemetry.stats import ServerStats
from transport import BindError, Connection, Listener, refuse
from transport.closing import finish_all
from transport.endpoints import Endpoints
from transport.tls import server_context
from workers.backend import Backend
from workers.cpu_policy import apply_cpu_scheduling
from workers.engine_choice import choose_engine
from workers.layout import choose_layout

log = logging.getLogger("server")


class InferenceServer:
    """The assembled server. Use as a context manager, or ``start()`` then ``shutdown()``.

    Args:
        config: Serving settings; ``port=0`` picks a free port (see ``address``).
        engine_factory: Builds each session's engine, for every model served; default:
            ``load_engine`` with the config's engine type, the model's folder, device and
            threads. Lets users (and tests) serve an engine of their own with the same task.
    """

    def __init__(self, config: ServerConfig,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        self._sim_dir: str | None = None  # the simulated devices' folder of this server's own
        if config.inference_engine_type == "sim" and config.sim_device_dir is None:
            self._sim_dir = new_folder_name()  # shared by the worker processes
            config = replace(config, sim_device_dir=self._sim_dir)
        self.config = config
        self.engine_factory = engine_factory
        self.max_frame_size = config.max_frame_size
        self.send_timeout_s = config.send_timeout_s
        self.max_outbox_bytes = int(config.max_outbox_mb * (1 << 20))
        self.idle_timeout_s = config.idle_timeout_s
        self.frame_timeout_s = config.frame_timeout_s
        self.tls_handshake_timeout_s = config.tls_handshake_timeout_s
        self.stats = ServerStats()
        self.models = ModelSet(config, self.stats, engine_factory)
        self.auth = Authenticator(None, config.auth_timeout_s, self.stats)  # tokens: start()
        self.handler = RequestHandler(self.models, config.limits(), self.stats, self,
                                      config.request_timeout_ms, self.auth)
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_httpd: Any = None
        self.connections: set[Connection] = set()
        self._lock = threading.Lock()
        #: The addresses served (transport/endpoints.py): bound, TLS and HTTP set by start().
        self.net = Endpoints(config.host, config.port, config.unix_socket, config.address_file)
        self._started = False  # start() completed: the server served

    # -- start -------------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> None:
        """Bind the addresses, load the model into every session, then listen and accept.

        The addresses (TCP, the Unix socket) are bound first, so that a busy one fails at once,
        not after the model has loaded. A start that fails, or is cancelled, releases whatever
        it had started before raising.

        Args:
            cancel: Give up once this is set (``main`` sets it on SIGINT or SIGTERM): the
                start-up stops loading, never listens, and raises ``StartCancelled``; worker
                processes are stopped, and session threads still loading their engines are
                left to end by themselves once loaded (``main`` then exits without them).

        Raises:
            StartCancelled: ``cancel`` was set before the server listened.
            TokenFileError: ``auth_token_file`` cannot be read or holds no token (read first,
                on every start: a token removed from the file no longer works after a restart).
            BindError: an address (or the metrics port) cannot be bound: taken, privileged,
                not this machine's; a live server on the Unix socket, or a file there that is
                not a socket.
            ModelDirError: no prepared model in ``model_dir``.
            RuntimeError: a session failed to load its engine.
            OSError: a TLS file cannot be read or used (``ssl.SSLError``).
        """
        cfg = self.config
        if cfg.auth_token_file is not None:
            self.auth.tokens = TokenSet.from_file(cfg.auth_token_file)
        if cfg.tls_cert is not None:
            self.net.tls = server_context(cfg.tls_cert, cfg.tls_key or cfg.tls_cert,
                                          cfg.tls_client_ca)
        self.net.listener = listener = Listener(self.net.bind(), self._accept)
        try:
            self.net.publish(False)  # a file left by an earlier run must not say "up"
            if cfg.metrics_port is not None:  # a port too: fail early; scrapes show the loading
                self._start_metrics(cfg.metrics_host, cfg.metrics_port)
            if (http := cfg.http_address()) is not None:  # before loading: probes say so
                from http_api.server import start_http  # uvicorn only where HTTP is served

                self.net.http = start_http(self, self.net.tls, http)
            self._load(cancel)
            raise_if_cancelled(cancel)  # the last chance: from here on, a stop drains
            listener.start()
            self.net.publish(True)
        except StartCancelled:  # nothing admitted: no wait for engines still loading
            self._stop(timeout=0)
            raise
        except BaseException:
            self._stop(timeout=5)
            raise
        self._started = True
        log_serving(self.config, self.endpoints, self.local_only,
                    None if self.auth.tokens is None else len(self.auth.tokens),
                    self.config.auth_token_file)

    def _load(self, cancel: threading.Event | None) -> None:
        """Find the models, then start each one's backend: sessions here, or worker
        processes, or a broker front end."""
        cfg = self.config
        self.models.read()
        check_cuda_devices(cfg.inference_engine_type, cfg.gpu_indices())
        log_loading(cfg, self.models, self.endpoints)
        self.models.start(cancel, on_ready=log_ready)

    def _start_metrics(self, host: str, port: int) -> None:
        from telemetry.prometheus import serve_metrics

        try:
            self._metrics_httpd = serve_metrics(self, host, port)
        except OSError as exc:
            raise BindError(exc.errno, f"cannot serve metrics on {host}:{port} (--metrics_port): "
                            f"{exc.strerror}") from exc
        self.metrics_address = self._metrics_httpd.server_address[:2]
        log.info("Prometheus metrics on http://%s:%d/metrics", *self.metrics_address)

    @property
    def backend(self) -> Backend | None:
        """The first model's backend (the only model's, as most servers have one); None
        before the models are loaded."""
        first = next(iter(self.models), None)
        return first.backend if first is not None else None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on over TCP."""
        return self.net.address

    @property
    def _http(self) -> Any:
        """The HTTP front end (http_api/server.py's ``HttpFrontEnd``) once started; None
        without one (``--http_port -1``)."""
        return self.net.http

    @property
    def http_address(self) -> tuple[str, int] | None:
        """The (host, port) of the HTTP API; None without one (``--http_port -1``)."""
        return None if self._http is None else self._http.address

    @property
    def serving(self) -> bool:
        """True once started: every model loaded and the listeners accepting."""
        return self._started

    @property
    def unix_address(self) -> str | None:
        """The Unix socket served, as ``unix:///absolute/path``; None without ``unix_socket``."""
        return self.net.unix_address

    @property
    def endpoints(self) -> str:
        """Every address served, in words, for the log."""
        return self.net.describe()

    @property
    def local_only(self) -> bool:
        """Whether only this machine can connect: every address served is a loopback one."""
        return self.net.local_only

    # -- what connections call -----------------------------------------------------------------
    def _accept(self, sock: socket.socket, peer: Any) -> None:
        """One accepted connection, over TCP or the Unix socket: both count towards
        ``max_connections``. TLS only wraps the socket here; the reader thread shakes hands."""
        tls = self.net.tls if sock.family != socket.AF_UNIX else None
        with self._lock:
            full = len(self.connections) >= self.config.max_connections
            conn = None if full else Connection(sock, peer, self, tls=tls)
            if conn is not None:
                self.handler.connected(conn)  # its auth state and deadline, before any read
                self.connections.add(conn)
        if conn is None:
            self.stats.count_event("connection_refused")
            refuse(sock, TooManyConnections(
                f"server has {self.config.max_connections} connections open (max_connections); "
                "retry later"), reply=tls is None)
            return
        self.stats.on_connection(True)
        try:
            conn.thread.start()
        except RuntimeError as exc:  # no threads left: this connection only is lost
            log.error("cannot serve connection %s: %s", conn.peer, exc)
            conn.close()
            conn.stream.close()
            self.forget(conn)

    def handle(self, message: Any, conn: Connection) -> None:
        """Answer or admit one decoded message (dispatch/handler.py)."""
        self.handler.handle(message, conn)

    def flush(self) -> None:
        """A connection admitted one read's requests: the backends may hand them on together."""
        self.handler.flush()

    def control(self, request: Request) -> dict[str, Any]:
        """Answer a request that runs no model: ``ping``, ``stats`` or ``models``."""
        if isinstance(request, PingRequest):
            return {"pong": True, "ready": self.ready}
        if isinstance(request, StatsRequest):
            return self.stats_result()
        if isinstance(request, ModelsRequest):
            return {"models": [model.describe() for model in self.models]}
        raise BadRequest(f"op {request.op!r} is not answered here", request_id=request.id)

    @property
    def ready(self) -> bool:
        """True while every session (of every worker) is loaded, warmed up and serving, and
        the server is not draining."""
        return self.models.ready and not self.handler.draining

    def stats_result(self) -> dict[str, Any]:
        """Counters and timings, plus what is being served and how: the ``stats`` op's result."""
        return self.collect_stats()[0]

    def collect_stats(self) -> tuple[dict[str, Any], ServerStats, dict[str, ServerStats]]:
        """The ``stats`` result, the statistics it was made from (the server's own plus every
        model's, summed over worker processes), and each model's (dispatch/report.py); with
        the HTTP API's address and connections under ``http``."""
        result, total, per_model = collect_stats(self.config, self.stats, self.models,
                                                 self.ready)
        if self._http is not None:
            result["http"] = self._http.describe()
        return result, total, per_model

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection, and any work it left queued, which nobody awaits now."""
        with self._lock:
            self.connections.discard(conn)
        self.stats.on_connection(False)
        if conn.pending:
            self.models.purge_gone()

    # -- stop --------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop accepting, refuse new requests, answer every admitted one, close, join.

        Work still queued when ``timeout`` (default: the configured one) runs out is answered
        with ``shutting_down``; a batch an engine is still running is abandoned.

        Returns:
            True if every admitted request was run within ``timeout``.
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        try:
            self.net.publish(False)  # draining is not serving: probes must not say "up"
        finally:
            drained = self._stop(timeout)
        if self._started:
            log.info("stopped (%s)", "all admitted requests answered" if drained else "timed out")
        return drained

    def _stop(self, timeout: float) -> bool:
        """Stop whatever has been started, in shutdown order; True if everything drained."""
        deadline = time.monotonic() + timeout
        if self.net.listener is not None:
            self.net.listener.stop()  # first stop accepting, then refuse new requests
        self.handler.draining = True  # HTTP readiness says 503 from here on
        drained = self.models.stop(timeout)
        with self._lock:
            connections = list(self.connections)

        if self._http is not None:  # after the drain: its replies went out meanwhile
            self._http.stop(max(0.0, deadline - time.monotonic()))
        finish_all(connections, deadline)
        if self._sim_dir is not None:
            shutil.rmtree(self._sim_dir, ignore_errors=True)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        return drained

    def __enter__(self) -> InferenceServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit status: 0 once stopped with every admitted
    request answered, 1 if the stop timed out, 2 if it could not start. Does not return where
    the process must end at once: a stop during start-up exits 0 and a second signal exits 1,
    both with ``os._exit`` (an engine still loading cannot be interrupted or waited for)."""
    registry = setting_registry()
    config = parse_args(__doc__, argv, registry=registry)
    given = given_settings(argv, registry)
    engine = choose_engine(config, given)  # before the layout, which lays out for the engine
    layout = choose_layout(engine.config, given)
    config = layout.config
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: stopping (again to force)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)  # first: a stop is handled from the first log line
    signal.signal(signal.SIGTERM, on_signal)
    # before any thread or worker process starts: they inherit it (workers/cpu_policy.py)
    log_start(config, apply_cpu_scheduling(config.cpu_scheduling).explained(), engine.why,
              layout.why)
    if config.role == "worker":  # run the model for the front ends of --broker until stopped
        from broker.worker_main import run_worker

        try:
            return run_worker(config, stop)
        except StartCancelled:
            _stopped_during_start_up()
    server = InferenceServer(config)
    try:
        server.start(cancel=stop)
    except StartCancelled:
        _stopped_during_start_up()
    except Exception as exc:  # noqa: BLE001 - any start failure is exit status 2, logged
        log.error("cannot start: %s", exc if isinstance(exc, BindError) else
                  f"{type(exc).__name__}: {exc}")
        return 2
    wait_until_set(stop)
    return 0 if server.shutdown() else 1


def _stopped_during_start_up() -> NoReturn:
    """Exit 0 at once, without the interpreter's teardown: a session thread may still be
    loading its engine, which nothing interrupts, and the teardown would wait for it or free
    the runtime beneath it. Whatever else the start-up had started is stopped already."""
    log.info("stopped during start-up, before serving")
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
