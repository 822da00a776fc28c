"""The body of one executor process (``--executors on``): the one owner of a device's engine,
running batches formed from the jobs of every worker process.

The front end starts it as ``python -m workers.executor_main FD`` before the workers
(workers/executors.py). On its pipe (workers/pipe_items.py's named types), front end ->
executor: an ``ExecutorStart`` first, then ``AskStats`` any number of times, then ``Stop``;
executor -> front end: ``Ready(description)`` or ``Failed(message)``, then a ``Stats`` for each
``AskStats``.

Before it says ready it times the batch shapes it will run, for its cost model. Workers
connect to ``address`` (a Unix socket; workers/executor_client.py), one connection per session,
and speak workers/executor_wire.py's messages: a ``Hello`` (answered with ``Described``), then
``Job``s, each a worker batch's rows in groups by length, answered by an ``Answer`` or a
``Failure`` once all its rows have run (workers/executor_loop.py forms the batches).

It ignores SIGINT and SIGTERM: the front end stops it after the workers have drained. Finding
the front end's end of the pipe closed, it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection, Listener

from engines.model_dir import load_model_info
from engines.shapes import capture_lengths
from scheduling.cost_model import CostModel
from scheduling.planner import BatchPolicy
from scheduling.session import dummy_feeds, time_shapes
from settings.server_config import ServerConfig, configure_logging
from workers.executor_loop import Executor, Link
from workers.executor_socket import accept_key
from workers.executor_wire import FIXED_WIDTH_TASKS, Described, Hello, Job
from workers.launch import serve_child
from workers.local import default_engine_factory
from workers.pipe_items import AskStats, ExecutorStart, Failed, Ready, Stats

log = logging.getLogger("executor")
#: Connections waiting to be accepted: every session of every worker may connect at once.
BACKLOG = 128
#: Seconds a connection's key exchange may take.
HANDSHAKE_S = 10.0


def serve_connection(conn: Connection, executor: Executor, authkey: bytes) -> None:
    """Check the worker session's key, then read its messages until it closes: a ``Hello``,
    then ``Job``s."""
    if not accept_key(conn, authkey, HANDSHAKE_S):
        log.warning("a connection failed its key exchange (or left during it): closed")
        return
    link, engine = Link(conn), executor.engine
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            link.close()
            return
        if isinstance(message, Hello):
            link.source = message.pid
            link.send(Described(engine.describe(), engine.precision))
        elif isinstance(message, Job):
            executor.submit(link, message)
        else:
            log.warning("a worker sent %s, not a job: closing its connection",
                        type(message).__name__)
            link.close()
            return


def accept_forever(listener: Listener, executor: Executor, authkey: bytes) -> None:
    """One thread per connection, its key checked there (a connection that fails or leaves
    during the exchange ends alone, and a slow one holds up nobody), until the listener
    closes."""
    while True:
        try:
            conn = listener.accept()
        except OSError:  # closed
            return
        threading.Thread(target=serve_connection, args=(conn, executor, authkey), daemon=True,
                         name="connection").start()


def run_executor(config: ServerConfig, device: str, address: str, authkey: bytes,
                 control: Connection, log_level: int) -> int:
    """Load the device's engine, serve jobs until told to stop (or orphaned), then stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, f"executor-{device}")
    try:
        engine = default_engine_factory(config, device)()  # as a worker's session would
        engine.run(dummy_feeds(engine.input_names, 1, 16))  # the first run allocates
        policy = BatchPolicy(mode="auto", max_items=config.max_batch_size * 4,
                             max_tokens=config.max_batch_tokens,
                             lookahead=config.batch_lookahead,
                             cost=CostModel(engine.row_steps, engine.length_steps), fill=True)
        info = load_model_info(config.model_dir)
        time_shapes(engine, policy, capture_lengths(config.bucket_lengths(), info.max_seq_len))
        if os.path.exists(address):
            os.unlink(address)  # a killed executor's socket file
        listener = Listener(address, family="AF_UNIX", backlog=BACKLOG)  # keys: per connection
    except Exception as exc:  # noqa: BLE001 - reported to the front end
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        control.send(Failed(f"{type(exc).__name__}: {exc}"))
        return 1
    executor = Executor(engine, policy, per_token=info.task not in FIXED_WIDTH_TASKS,
                        overlap=config.executor_overlap == "on")
    threading.Thread(target=accept_forever, args=(listener, executor, authkey), daemon=True,
                     name="accept").start()
    control.send(Ready(engine.describe()))
    log.info("serving %s for every worker at %s%s", engine.describe(), address,
             "; the next batch copied in while one runs" if executor.overlap else "")
    try:
        while isinstance(asked := control.recv(), AskStats):
            control.send(Stats(asked.token, executor.figures()))
    except (EOFError, OSError):  # else Stop: the workers have drained
        log.warning("front end gone; exiting")
    executor.stop(config.shutdown_timeout_s)
    listener.close()
    return 0


def main(control: Connection, first: ExecutorStart) -> int:
    """``python -m workers.executor_main FD`` (workers/launch.py's ``serve_child``): FD is this
    executor's end of the front end's pipe, whose first message is an ``ExecutorStart``."""
    return run_executor(first.config, first.device, first.address, first.authkey, control,
                        first.log_level)


if __name__ == "__main__":
    serve_child(sys.argv, main)
