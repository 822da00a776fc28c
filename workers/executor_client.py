"""The engine a worker process runs when its device's engine lives in an executor process
(``--executors on``): each run goes, as one job, to the executor that owns the device, which
batches its rows with those of every other worker (workers/executor_loop.py). The batch goes
cut into groups by each row's own length and comes back joined (workers/executor_wire.py).

Each session of a worker holds one connection (a Unix socket), so a session's run is one send
and one receive, with nothing to share between threads. A connection that breaks (the executor
died) fails the run in hand with an error, which the session answers as ``engine_error``; the
next run connects again, to the executor the front end has restarted by then, or fails at once
while it is still loading.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from multiprocessing.connection import Client, Connection
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.model_dir import load_model_info
from workers.executor_wire import (
    FIXED_WIDTH_TASKS,
    Answer,
    Described,
    Failure,
    Hello,
    Job,
    join_groups,
    split_by_length,
)

#: Seconds a new engine waits for its executor to accept (it is started before the workers).
CONNECT_S = 30.0


class ExecutorLost(RuntimeError):
    """The executor closed the connection, or could not be reached."""


def executor_address(folder: str, device: str) -> str:
    """The Unix socket of the executor that owns ``device``, in the front end's folder."""
    return str(Path(folder) / f"executor-{device.replace(':', '-')}.sock")


class ExecutorEngine(Engine):
    """Sends each batch to the executor at ``address`` and returns its outputs.

    Args:
        model_dir: The model folder (for its input and output names).
        address: The executor's Unix socket.
        authkey: The key the executor's listener checks.
        device: The executor's device, for descriptions.
        buckets: The server's length buckets (``--length_buckets``): rows are trimmed to the
            first of them (else the graphs' default lengths) that holds their tokens.
        connect_s: How long the first connection may take.
    """

    name = "executor"
    device_bound = True

    def __init__(self, model_dir: str | Path, address: str, authkey: bytes, device: str,
                 buckets: tuple[int, ...] = (), connect_s: float = CONNECT_S) -> None:
        info = load_model_info(model_dir)
        self.input_names = tuple(info.input_names)
        self.output_names = tuple(info.output_names)
        self.buckets = buckets
        self.per_token = info.task not in FIXED_WIDTH_TASKS
        #: Seconds the last job waited in the executor for its last rows' batch to start.
        self.queued_s: float | None = None
        self.address, self.authkey, self.device = address, authkey, device
        self._ids = itertools.count()
        self._conn: Connection | None = None
        self.described = ""
        self._open(connect_s)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One job on the executor: this batch, perhaps beside other workers' jobs.

        Raises:
            ExecutorLost: the executor died with the job, or cannot be reached now.
            RuntimeError: the executor's engine failed on the batch (its message).
        """
        if self._conn is None:
            self._open(0.0)  # restarted meanwhile? else fail at once
        assert self._conn is not None
        job_id = next(self._ids)
        rows, width = next(iter(feeds.values())).shape
        split = split_by_length(feeds, self.buckets)
        try:
            self._conn.send(Job(job_id, split.groups))
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._drop()
            raise ExecutorLost(f"the executor of {self.device} was lost with this batch "
                               f"({type(exc).__name__})") from exc
        assert reply.job_id == job_id, (reply.job_id, job_id)
        if isinstance(reply, Failure):
            raise RuntimeError(reply.message)
        assert isinstance(reply, Answer), type(reply).__name__
        self.device_s, self.queued_s = reply.device_s, reply.queued_s
        return join_groups(reply.outputs, split.places, rows, width, self.per_token)

    def describe(self) -> str:
        """What the executor runs, and that this process reaches it over a socket."""
        return f"{self.described} (in the executor of {self.device}, shared by every worker)"

    def close(self) -> None:
        """Close this session's connection."""
        self._drop()

    def _open(self, within_s: float) -> None:
        """Connect, and say which process this is (the executor answers what it runs).

        Raises:
            ExecutorLost: no connection in time, or it closed at once.
        """
        self._conn = self._connect(within_s)
        try:
            self._conn.send(Hello(os.getpid()))
            described: Described = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._drop()
            raise ExecutorLost(f"the executor of {self.device} closed the connection") from exc
        self.described, self.precision = described.description, described.precision

    def _connect(self, within_s: float) -> Connection:
        """A connection to the executor, trying for ``within_s`` seconds (once at least).

        Raises:
            ExecutorLost: none could be made in time.
        """
        deadline = time.monotonic() + within_s
        while True:
            try:
                return Client(self.address, family="AF_UNIX", authkey=self.authkey)
            except (OSError, EOFError) as exc:
                if time.monotonic() >= deadline:
                    raise ExecutorLost(f"cannot reach the executor of {self.device} "
                                       f"({type(exc).__name__}: {exc})") from exc
                time.sleep(0.05)

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
