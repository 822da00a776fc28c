"""The body of one executor process (``--executors on``): the one owner of a device's engine,
running batches formed from the jobs of every worker process.

The front end starts it as ``python -m workers.executor_main FD`` before the workers
(workers/executors.py). On its pipe, front end -> executor: ``(config, device, address,
authkey, log_level)`` first, then ``("stats",)`` any number of times, then ``("stop",)``;
executor -> front end: ``("ready", description)`` or ``("failed", message)``, then
``("stats", figures)`` for each ``("stats",)``.

Workers connect to ``address`` (a Unix socket; workers/executor_client.py), one connection per
session, say ``("hello", pid)`` (answered with the engine's description), and send ``("run",
job_id, feeds)``: one batch their task collated, rows x its padded
length. The executor's one run loop takes the waiting jobs as a GPU engine's session takes
requests (scheduling/planner.py, with ``fill``: up to the token budget, a longer job only where
the device's learnt costs say it pays), pads them to one length, runs them as one batch, and
sends each job its rows of the outputs (per-token outputs cut back to its length) as
``("out", job_id, outputs, device_s)``, or ``("err", job_id, message, None)``.

It ignores SIGINT and SIGTERM: the front end stops it after the workers have drained. Finding
the front end's end of the pipe closed, it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from engines.base import Engine
from engines.model_dir import load_model_info
from scheduling.cost_model import CostModel
from scheduling.planner import BatchPolicy, plan_batch
from scheduling.session import batch_cost, dummy_feeds
from settings.server_config import ServerConfig
from workers.launch import serve_child
from workers.local import default_engine_factory

log = logging.getLogger("executor")

#: Tasks whose outputs are one row of numbers per input row, not one per token.
FIXED_WIDTH_TASKS = frozenset({"embed", "classify"})


@dataclass(eq=False)
class Pending:
    """One worker's job waiting for the device (what the planner reads: rows, length,
    enqueued_at)."""

    conn: Connection
    lock: threading.Lock
    job_id: int
    feeds: dict[str, np.ndarray]
    rows: int
    length: int
    source: int = 0  # the worker process's pid
    enqueued_at: float = field(default_factory=time.monotonic)

    def reply(self, message: tuple[Any, ...]) -> None:
        """Send on the job's connection; a worker that is gone is nobody to answer."""
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:
            pass


class Executor:
    """The run loop: jobs from every connection in, batches through the engine, rows back."""

    def __init__(self, engine: Engine, policy: BatchPolicy, per_token: bool) -> None:
        self.engine, self.policy, self.per_token = engine, policy, per_token
        self._jobs: list[Pending] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.batches = 0
        self.rows = 0  # rows run, over every batch
        self.jobs = 0  # jobs answered from a batch
        self.shared_batches = 0  # batches holding the rows of more than one worker process
        self.most_sources = 0
        self._thread = threading.Thread(target=self._loop, name="run-loop", daemon=True)
        self._thread.start()

    def figures(self) -> dict[str, Any]:
        """Batches, rows and jobs run, the batches holding rows of several worker processes,
        the most processes in one, jobs waiting now, and the device's busy share where the engine knows it."""
        with self._cond:
            waiting = len(self._jobs)
        out = {"batches": self.batches, "rows": self.rows, "jobs": self.jobs,
               "shared_batches": self.shared_batches,
               "most_processes_in_a_batch": self.most_sources, "jobs_waiting": waiting}
        busy = self.engine.device_busy()
        return out if busy is None else {**out, "device_busy": busy}

    def submit(self, job: Pending) -> None:
        """Queue one job for the next batch."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        """Run what is queued, then end the loop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._stopping)
                if not self._jobs:
                    return
                chosen = plan_batch(self._jobs[:self.policy.lookahead], self.policy)
                taken = set(map(id, chosen))
                self._jobs = [job for job in self._jobs if id(job) not in taken]
            self._run(chosen)

    def _run(self, chosen: list[Pending]) -> None:
        """One batch of ``chosen`` jobs, each answered once."""
        length = max(job.length for job in chosen)
        names = self.engine.input_names
        feeds = {name: np.concatenate([_pad(job.feeds[name], length) for job in chosen])
                 for name in names}
        rows = sum(job.rows for job in chosen)
        started = time.monotonic()
        try:
            outputs = self.engine.run(feeds)
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            log.exception("the engine failed on a batch of %d rows", rows)
            for job in chosen:
                job.reply(("err", job.job_id, f"{type(exc).__name__}: {exc}", None))
            return
        seconds = batch_cost(self.engine, time.monotonic() - started)
        if self.policy.cost is not None:
            self.policy.cost.observe(rows, length, seconds)
        self.batches += 1
        self.rows += rows
        self.jobs += len(chosen)
        sources = len({job.source for job in chosen})
        self.shared_batches += sources > 1
        self.most_sources = max(self.most_sources, sources)
        first = 0
        for job in chosen:
            part = slice(first, first + job.rows)
            first += job.rows
            mine = {name: (value[part, :job.length] if self.per_token else value[part])
                    for name, value in outputs.items()}
            job.reply(("out", job.job_id, mine, seconds * job.rows / rows))


def _pad(values: np.ndarray, length: int) -> np.ndarray:
    """Rows padded with zeros (pad id, no attention, segment 0) up to ``length`` tokens."""
    short = length - values.shape[1]
    return values if short == 0 else np.pad(values, ((0, 0), (0, short)))


def serve_connection(conn: Connection, executor: Executor) -> None:
    """Read one worker session's jobs until it closes."""
    lock, source = threading.Lock(), 0
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            conn.close()
            return
        if message[0] == "hello":  # ("hello", pid): the session's first message
            source = message[1]
            Pending(conn, lock, -1, {}, 0, 0).reply(executor.engine.describe())
            continue
        _, job_id, feeds = message
        rows, length = next(iter(feeds.values())).shape
        executor.submit(Pending(conn, lock, job_id, feeds, rows, length, source))


def accept_forever(listener: Listener, executor: Executor) -> None:
    """One thread per connection, until the listener closes."""
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError):
            return
        except Exception:  # noqa: BLE001 - a bad handshake (wrong key) ends that one only
            log.warning("a connection failed its handshake", exc_info=True)
            continue
        threading.Thread(target=serve_connection, args=(conn, executor), daemon=True,
                         name="connection").start()


def run_executor(config: ServerConfig, device: str, address: str, authkey: bytes,
                 control: Connection, log_level: int) -> int:
    """Load the device's engine, serve jobs until told to stop (or orphaned), then stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=(
        f"%(asctime)s %(levelname)s executor-{device} %(threadName)s %(name)s: %(message)s"))
    try:
        engine = default_engine_factory(config, device)()  # as a worker's session would
        engine.run(dummy_feeds(engine.input_names, 1, 16))  # the first run allocates
        if os.path.exists(address):
            os.unlink(address)  # a killed executor's socket file
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
    except Exception as exc:  # noqa: BLE001 - reported to the front end
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        control.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    policy = BatchPolicy(mode="auto", max_items=config.max_batch_size * 4,
                         max_tokens=config.max_batch_tokens, lookahead=config.batch_lookahead,
                         cost=CostModel(), fill=True)
    task = load_model_info(config.model_dir).task
    executor = Executor(engine, policy, per_token=task not in FIXED_WIDTH_TASKS)
    threading.Thread(target=accept_forever, args=(listener, executor), daemon=True,
                     name="accept").start()
    control.send(("ready", engine.describe()))
    log.info("serving %s for every worker at %s", engine.describe(), address)
    try:
        while control.recv()[0] == "stats":
            control.send(("stats", executor.figures()))
    except (EOFError, OSError):  # else ("stop",): the workers have drained
        log.warning("front end gone; exiting")
    executor.stop(config.shutdown_timeout_s)
    listener.close()
    return 0


def main(control: Connection, first: tuple[Any, ...]) -> int:
    """``python -m workers.executor_main FD`` (workers/launch.py's ``serve_child``): FD is this
    executor's end of the front end's pipe."""
    config, device, address, authkey, log_level = first
    return run_executor(config, device, address, authkey, control, log_level)


if __name__ == "__main__":
    serve_child(sys.argv, main)
