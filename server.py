"""A raw-TCP, msgpack-framed question-answering inference server.

    python prepare_model.py && python server.py        # 127.0.0.1:9999, 2 ONNX sessions
    python server.py --host 0.0.0.0 --inference_engine_type pytorch

A listener thread accepts connections; each connection's reader thread decodes frames, validates and
tokenizes requests, and puts them on one shared bounded queue. N inference-session threads, each with
its own engine, take batches from that queue and write every reply back on its client's socket.
See docs/architecture.md and docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from engines.base import Engine
from engines.devices import check_cuda_devices
from engines.model_dir import ModelInfo, load_model_info
from engines.zero_engine import ZERO_ENGINE_WARNING
from protocol.errors import BadRequest, ServerError, ShuttingDown, TooManyConnections
from protocol.messages import PingRequest, QARequest, Request, StatsRequest
from scheduling.queue import Responder
from settings.server_config import ServerConfig, build_parser, config_from_args
from telemetry.stats import ServerStats
from transport import BindError, Connection, Listener, bind_socket, refuse
from transport.closing import DELIVERY_POLL_S
from transport.listener import publish_address
from workers.backend import Backend
from workers.figures import summarize_worker
from workers.local import LocalBackend
from workers.processes import ProcessBackend

log = logging.getLogger("server")


class InferenceServer:
    """The assembled server. Use as a context manager, or ``start()`` then ``shutdown()``.

    Args:
        config: Serving settings; ``port=0`` picks a free port (see ``address``).
        engine_factory: Builds each session's engine; default: ``load_engine`` with the
            config's engine type, model folder, device and threads. Lets users (and tests) serve
            an engine of their own with the same QA task.
    """

    def __init__(self, config: ServerConfig,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.max_frame_size = config.max_frame_size
        self.send_timeout_s = config.send_timeout_s
        self.idle_timeout_s = config.idle_timeout_s
        self.frame_timeout_s = config.frame_timeout_s
        self.limits = config.limits()
        self.info: ModelInfo | None = None
        self.stats = ServerStats()
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_httpd: Any = None
        self.backend: Backend | None = None
        self.connections: set[Connection] = set()
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._draining = False
        self._started = False  # start() completed: the server served

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the address, load the model into every session, then listen and accept.

        The address is bound first, so that a busy port fails at once, not after the model has
        loaded. A start that fails releases whatever it had started before raising.

        Raises:
            BindError: the address (or the metrics port) cannot be bound: taken, privileged,
                not this machine's.
            ModelDirError: no prepared model in ``model_dir``.
            RuntimeError: a session failed to load its engine.
        """
        cfg = self.config
        self._listener = Listener(bind_socket(cfg.host, cfg.port), self._accept)
        try:
            self._publish_address(False)  # a file left by an earlier run must not say "up"
            if cfg.metrics_port is not None:  # a port too: fail early; scrapes show the loading
                self._start_metrics(cfg.metrics_host, cfg.metrics_port)
            self._load()
            self._listener.start()
            self._publish_address(True)
        except BaseException:
            self._stop(timeout=5)
            raise
        self._started = True
        self._log_serving()

    def _publish_address(self, serving: bool) -> None:
        """Write (atomically) or remove ``--address_file``, if one is configured."""
        if self.config.address_file is not None:
            publish_address(self.config.address_file, self.address if serving else None)

    def _load(self) -> None:
        """Read the model folder, then start the backend: sessions here, or worker processes."""
        cfg = self.config
        self.info = load_model_info(cfg.model_dir)
        if cfg.inference_engine_type == "zero":  # whatever the folder holds, nothing runs it
            self.info = replace(self.info, meaningful=False, warning=ZERO_ENGINE_WARNING)
        check_cuda_devices(cfg.inference_engine_type, cfg.gpu_indices())
        if cfg.broker is not None:
            log.info("front end for %s: tokenizing here, the model runs in the workers of the "
                     "broker (address %s:%d bound)", self.info.model_name, *self.address)
        else:
            where = f"{cfg.workers} worker processes of " if cfg.workers > 1 else ""
            log.info("loading %s into %s%d %s sessions (address %s:%d bound; accepting once "
                     "loaded)", self.info.model_name, where, cfg.num_inference_sessions,
                     cfg.inference_engine_type, *self.address)
        if not self.info.meaningful:
            log.warning("%s", self.info.warning)
        if cfg.broker is not None:
            from broker.frontend import RedisBackend  # imports redis only when asked for

            self.backend = RedisBackend(cfg, self.info, self.stats)
        elif cfg.workers > 1:
            if self.engine_factory is not None:
                raise ValueError("engine_factory serves in this process: use workers=1")
            self.backend = ProcessBackend(cfg, self.info, self.stats,
                                          log_level=logging.getLogger().getEffectiveLevel())
        else:
            self.backend = LocalBackend(cfg, self.info, self.stats,
                                        device=cfg.worker_devices()[0],
                                        engine_factory=self.engine_factory)
        self.backend.start()

    def _start_metrics(self, host: str, port: int) -> None:
        from telemetry.prometheus import serve_metrics

        try:
            self._metrics_httpd = serve_metrics(self, host, port)
        except OSError as exc:
            raise BindError(exc.errno, f"cannot serve metrics on {host}:{port} (--metrics_port): "
                            f"{exc.strerror}") from exc
        self.metrics_address = self._metrics_httpd.server_address[:2]
        log.info("Prometheus metrics on http://%s:%d/metrics", *self.metrics_address)

    def _log_serving(self) -> None:
        cfg, info = self.config, self.info
        assert info is not None and self.backend is not None
        host, port = self.address
        described = self.backend.describe()
        engine = described.get("engine", {}).get("description", "?")
        log.info("model: %s (%s) from %s", info.model_name, info.source, os.path.abspath(cfg.model_dir))
        log.info("engine: %s; %s%d inference sessions; batching %s (max %d requests, %d tokens, "
                 "delay %g ms)", engine,
                 f"{cfg.workers} workers on {', '.join(cfg.worker_devices())}, each with "
                 if cfg.workers > 1 else "", cfg.num_inference_sessions, cfg.batching,
                 described.get("max_batch_size", cfg.max_batch_size), cfg.max_batch_tokens,
                 cfg.max_queue_delay_ms)
        log.info("limits: queue %d, request timeout %g ms, %d connections, idle %g s, frame %g s, "
                 "frame size %d B, question %d chars, context %d chars (docs/operations.md)",
                 cfg.max_queue, cfg.request_timeout_ms, cfg.max_connections, cfg.idle_timeout_s,
                 cfg.frame_timeout_s, cfg.max_frame_size, cfg.max_question_chars,
                 cfg.max_context_chars)
        if cfg.batching == "auto":
            log.info("batch cost model after warm-up (ms per batch, ROWSxLENGTH%s): %s",
                     ", worker 0" if cfg.workers > 1 else "",
                     ", ".join(f"{shape} {ms:.1f}"
                               for shape, ms in described.get("cost_model_ms", {}).items()))
        log.info("serving on %s:%d%s", host, port,
                 "" if host != "127.0.0.1" else " (local only; --host 0.0.0.0 to serve other machines)")

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        assert self._listener is not None, "server not started"
        host, port = self._listener.sock.getsockname()[:2]
        return host, port

    # -- what connections call -----------------------------------------------------------------
    def _accept(self, sock: socket.socket, peer: Any) -> None:
        with self._lock:
            full = len(self.connections) >= self.config.max_connections
            conn = None if full else Connection(sock, peer, self)
            if conn is not None:
                self.connections.add(conn)
        if conn is None:
            self.stats.count_event("connection_refused")
            refuse(sock, TooManyConnections(
                f"server has {self.config.max_connections} connections open (max_connections); "
                "retry later"))
            return
        self.stats.on_connection(True)
        try:
            conn.thread.start()
        except RuntimeError as exc:  # no threads left: this connection only is lost
            log.error("cannot serve connection %s: %s", conn.peer, exc)
            conn.close()
            conn.sock.close()
            self.forget(conn)

    def admit(self, request: QARequest, respond: Responder, alive: Any) -> None:
        """Check, tokenize and queue one request.

        Raises:
            BadRequest: a field over its cap, or text the model cannot take.
            ShuttingDown: the server is draining.
            Overloaded: the queue is full.
        """
        if self._draining or self.backend is None:
            raise ShuttingDown("server is shutting down; request not admitted")
        self.limits.check(request)
        admitted = time.monotonic()
        timeout_ms = request.timeout_ms or self.config.request_timeout_ms
        stats = self.stats

        def respond_and_count(result: dict[str, Any] | None, error: ServerError | None) -> None:
            # counted first, so stats never lag what a client has already seen
            stats.on_finished("ok" if error is None else error.code, time.monotonic() - admitted)
            respond(result, error)

        stats.on_admitted()
        try:
            self.backend.submit(request.question, request.context, respond_and_count, alive,
                                admitted, admitted + timeout_ms / 1000 if timeout_ms else None)
        except BaseException:
            stats.on_refused()  # the caller replies and counts the error
            raise

    def flush(self) -> None:
        """A connection admitted one read's requests: the backend may hand them on together."""
        if self.backend is not None:
            self.backend.flush()

    def control(self, request: Request) -> dict[str, Any]:
        """Answer a request that needs no engine: ``ping`` or ``stats``."""
        if isinstance(request, PingRequest):
            return {"pong": True, "ready": self.ready}
        if isinstance(request, StatsRequest):
            return self.stats_result()
        raise BadRequest(f"op {request.op!r} is not answered here", request_id=request.id)

    @property
    def ready(self) -> bool:
        """True while every session (of every worker) is loaded, warmed up and serving, and
        the server is not draining."""
        return self.backend is not None and self.backend.ready and not self._draining

    def stats_result(self) -> dict[str, Any]:
        """Counters and timings, plus what is being served and how: the ``stats`` op's result."""
        return self.collect_stats()[0]

    def collect_stats(self) -> tuple[dict[str, Any], ServerStats]:
        """The ``stats`` result, and the statistics it was made from: summed over the worker
        processes when there are some (each asked for its figures now)."""
        figures = self.backend.worker_figures() if self.backend is not None else []
        merged = self.backend.summed(self.stats, figures) if self.backend is not None \
            else self.stats
        result = merged.snapshot()
        result["queue_depth"] = self.backend.queue_depth if self.backend is not None else 0
        result["ready"] = self.ready
        result["config"] = {k: v for k, v in asdict(self.config).items() if v is not None}
        if self.config.broker is not None:
            from broker.connect import redact

            result["config"]["broker"] = redact(self.config.broker)  # no password in stats
        if self.info is not None:
            result["model"] = {"name": self.info.model_name, "source": self.info.source,
                               "meaningful": self.info.meaningful}
            if self.info.warning:
                result["model"]["warning"] = self.info.warning
        described = self.backend.describe() if self.backend is not None else {}
        result["batching"] = {"mode": self.config.batching,
                              "max_batch_size": described.get("max_batch_size",
                                                              self.config.max_batch_size),
                              "max_batch_tokens": self.config.max_batch_tokens,
                              "cost_model_ms": described.get("cost_model_ms", {})}
        if "engine" in described:
            result["engine"] = described["engine"]
        if "broker" in described:
            result["broker"] = described["broker"]
        result["workers"] = [summarize_worker(worker) for worker in figures]
        return result, merged

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection, and any work it left queued, which nobody awaits now."""
        with self._lock:
            self.connections.discard(conn)
        self.stats.on_connection(False)
        if conn.pending and self.backend is not None:
            for item in self.backend.purge(lambda item: not item.alive()):
                item.answered = True
                self.stats.on_finished("client_gone", None)

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
            self._publish_address(False)  # draining is not serving: probes must not say "up"
        finally:
            drained = self._stop(timeout)
        if self._started:
            log.info("stopped (%s)", "all admitted requests answered" if drained else "timed out")
        return drained

    def _stop(self, timeout: float) -> bool:
        """Stop whatever has been started, in shutdown order; True if everything drained."""
        deadline = time.monotonic() + timeout
        if self._listener is not None:
            self._listener.stop()  # first stop accepting, then refuse new requests
        self._draining = True
        drained = self.backend.stop(timeout) if self.backend is not None else True
        with self._lock:
            connections = list(self.connections)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        finishing = connections  # each closes once its client has every reply, all at once
        while finishing := [conn for conn in finishing if not conn.finish()]:
            if left() <= 0:
                break
            time.sleep(DELIVERY_POLL_S)
        for conn in finishing:  # out of time: a client that does not read loses what is left
            conn.close()
        for conn in connections:
            conn.thread.join(left())
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        return drained

    def __enter__(self) -> InferenceServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Command-line options -> ServerConfig (one flag per config field); sets up logging."""
    parser = build_parser(__doc__)
    parser.add_argument("--log_level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=args.pop("log_level"),
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    return config_from_args(parser, args)


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT/SIGTERM; a second signal exits at once. Returns the exit status."""
    config = parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: stopping (again to force)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if config.role == "worker":  # run the model for the front ends of --broker until stopped
        from broker.worker import run_worker

        return run_worker(config, stop)
    server = InferenceServer(config)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any start failure is exit status 2, logged
        log.error("cannot start: %s", exc if isinstance(exc, BindError) else
                  f"{type(exc).__name__}: {exc}")
        return 2
    stop.wait()
    return 0 if server.shutdown() else 1


if __name__ == "__main__":
    sys.exit(main())
