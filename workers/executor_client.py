"""The engine a worker process runs when the devices' engines live in executor processes
(``--executors on``): each run goes, as one job, to one executor, which batches its rows with
those of every other worker (workers/executor_loop.py). The batch goes cut into groups by each
row's own length and comes back joined (workers/executor_wire.py).

**Which executor:** the one this worker process has the fewest jobs in flight on, its own
device's on a tie. A busy or stalled executor holds this process's jobs longer, so new ones go
to the others: with several GPUs, an idle one is not passed over while another is busy.

Each session of a worker holds one connection to each executor it has used (a Unix socket), so
a session's run is one send and one receive, with nothing to share between threads but the
count of jobs in flight and the link's timings. A job carries its batch's deadline, and every
failure comes back typed (protocol/errors.py), for the session to answer its requests with:

- ``worker_lost``: the connection broke with the job (the executor died); the next run
  connects again, to the executor the front end has restarted by then, or to another;
- ``unavailable``: no executor can be reached now (restarting);
- ``deadline_exceeded``: the deadline passed before the job's rows ran (the executor dropped
  them unrun);
- ``engine_error``: the engine failed on a batch holding the job's rows.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.model_dir import load_model_info
from protocol.errors import DeadlineExceeded, Unavailable, WorkerLost, error_for_code
from telemetry.stats import Timing
from workers.executor_socket import connect, set_limit
from workers.executor_wire import (
    FIXED_WIDTH_TASKS,
    Answer,
    Described,
    ExecutorRoutes,
    Failure,
    Hello,
    Job,
    join_groups,
    split_by_length,
)

#: Seconds a new engine waits for its executor to accept (it is started before the workers).
CONNECT_S = 30.0
#: Seconds past a job's deadline that a session still waits for its executor's answer: an
#: executor that is alive drops an expired job and answers by then.
ANSWER_GRACE_S = 1.0
#: Seconds a connection made for a job without a deadline may take (key exchange included).
HANDSHAKE_S = 10.0
#: Seconds an executor that let a job's deadline pass unanswered comes after the others.
SUSPECT_S = 5.0


#: This process's jobs in flight on each executor (by address), over all its sessions.
_IN_FLIGHT: Counter[str] = Counter()
_IN_FLIGHT_LOCK = threading.Lock()


@contextmanager
def _in_flight(address: str) -> Iterator[None]:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[address] += 1
    try:
        yield
    finally:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[address] -= 1


#: Executors (by address) that let a job's deadline pass unanswered, and until when they
#: come after the others (guarded by _IN_FLIGHT_LOCK).
_SUSPECT: dict[str, float] = {}


def _limit_s(deadline: float | None) -> float | None:
    """How long a job's exchange may take from now: to its deadline and the grace."""
    return None if deadline is None else deadline + ANSWER_GRACE_S - time.monotonic()


class ExecutorLost(RuntimeError):
    """The executor closed the connection, or could not be reached."""


class LinkTimes:
    """This process's jobs' timings on the executors, over all its sessions (thread-safe):
    ``queued``, from a job's arrival in the executor to its last batch's start; ``run``, from
    that start to its answer; ``hop``, the rest of its round trip (both ways over the socket,
    and the threads' wake-ups on each side)."""

    NAMES = ("queued", "run", "hop")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timings = {name: Timing() for name in self.NAMES}

    def observe(self, queued_s: float, run_s: float, round_trip_s: float) -> None:
        """One answered job."""
        with self._lock:
            hop_s = max(0.0, round_trip_s - queued_s - run_s)
            for name, seconds in zip(self.NAMES, (queued_s, run_s, hop_s), strict=True):
                self._timings[name].observe(seconds)

    def to_raw(self) -> dict[str, dict[str, object]] | None:
        """Every timing as plain data (``Timing.to_raw``); None before the first answer."""
        with self._lock:
            if not self._timings["hop"].count:
                return None
            return {name: timing.to_raw() for name, timing in self._timings.items()}


#: The timings of every job this process's sessions sent to an executor.
LINK_TIMES = LinkTimes()


def executor_address(folder: str, device: str) -> str:
    """The Unix socket of the executor that owns ``device``, in the front end's folder."""
    return str(Path(folder) / f"executor-{device.replace(':', '-')}.sock")


class ExecutorEngine(Engine):
    """Sends each batch to the least busy executor of ``routes`` and returns its outputs.

    Args:
        model_dir: The model folder (for its input and output names).
        routes: The executors (device, Unix socket), this worker's own device's first, and the
            key their listeners check.
        buckets: The server's length buckets (``--length_buckets``): rows are trimmed to the
            first of them (else the graphs' default lengths) that holds their tokens.
        connect_s: How long the first connection (to the first executor) may take.
    """

    name = "executor"
    device_bound = True

    def __init__(self, model_dir: str | Path, routes: ExecutorRoutes,
                 buckets: tuple[int, ...] = (), connect_s: float = CONNECT_S) -> None:
        info = load_model_info(model_dir)
        self.input_names = tuple(info.input_names)
        self.output_names = tuple(info.output_names)
        self.buckets = buckets
        self.per_token = info.task not in FIXED_WIDTH_TASKS
        self.routes = routes
        self.device = routes.executors[0][0]
        self._devices = dict((address, device) for device, address in routes.executors)
        self._ids = itertools.count()
        self._conns: dict[str, Connection] = {}
        self.described = ""
        self._conns[routes.executors[0][1]] = self._open(routes.executors[0][1], connect_s)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One job with no deadline (``run_by``)."""
        return self.run_by(feeds, None)

    def run_by(self, feeds: Mapping[str, np.ndarray],
               deadline: float | None) -> dict[str, np.ndarray]:
        """One job on the executor with the fewest of this process's jobs in flight, which
        drops it unrun once ``deadline`` (``time.monotonic()``) has passed.

        Raises:
            ServerError: typed (see the module docstring): ``WorkerLost``, ``Unavailable``,
                ``DeadlineExceeded`` or ``EngineError``.
        """
        job_id = next(self._ids)
        rows, width = next(iter(feeds.values())).shape
        split = split_by_length(feeds, self.buckets)
        job = Job(job_id, split.groups, deadline)
        reply, round_trip_s = self._exchange(job)
        if isinstance(reply, Failure):
            raise error_for_code(reply.code, reply.message)
        assert isinstance(reply, Answer), type(reply).__name__
        self.device_s = reply.device_s
        LINK_TIMES.observe(reply.queued_s, reply.run_s, round_trip_s)
        return join_groups(reply.outputs, split.places, rows, width, self.per_token)

    def _exchange(self, job: Job) -> tuple[Answer | Failure, float]:
        """Send ``job`` to the least busy executor that takes it; its reply, and the seconds
        from the send to the reply.

        Raises:
            Unavailable: no executor can be reached now.
            WorkerLost: the executor's connection broke with the job.
            DeadlineExceeded: the job's deadline and ``ANSWER_GRACE_S`` passed in the
                connect, the send or the wait for the reply (a stalled executor; one that
                lives drops an expired job itself). The connection is closed, so that a late
                reply cannot be taken for the next job's, and the executor comes after the
                others for ``SUSPECT_S``.
        """
        tried: set[str] = set()
        while True:
            address, conn, opened = self._least_busy(tried, job.deadline)
            limit = _limit_s(job.deadline)
            if limit is not None and limit <= 0:  # no fault of the executor's
                raise DeadlineExceeded("the deadline passed before the job went to the device")
            with _in_flight(address):
                sent = time.monotonic()
                try:
                    set_limit(conn, limit)
                    conn.send(job)
                except BlockingIOError as exc:
                    raise self._stalled(address) from exc
                except OSError:  # it never reached that executor: on a connection kept
                    self._drop(address)  # from before, it may have been restarted since,
                    if opened:  # so once more on a new one; else the next executor
                        tried.add(address)
                    continue
                try:
                    reply = conn.recv()
                except BlockingIOError as exc:
                    raise self._stalled(address) from exc
                except (EOFError, OSError) as exc:
                    self._drop(address)
                    raise WorkerLost(f"the executor of {self._devices[address]} was lost "
                                     f"with this batch ({type(exc).__name__})") from exc
                if reply.job_id != job.job_id:  # never: a connection out of step is dropped
                    self._drop(address)
                    raise WorkerLost(f"the executor of {self._devices[address]} answered job "
                                     f"{reply.job_id} for {job.job_id}")
                return reply, time.monotonic() - sent

    def _stalled(self, address: str) -> DeadlineExceeded:
        """The executor at ``address`` let a job's deadline pass: its connection dropped, it
        comes after the others for a while; the error to raise."""
        self._drop(address)
        with _IN_FLIGHT_LOCK:
            _SUSPECT[address] = time.monotonic() + SUSPECT_S
        return DeadlineExceeded(f"the executor of {self._devices[address]} did not answer by "
                                f"the deadline and {ANSWER_GRACE_S:g} s more (stalled?); the "
                                "rows may have run")

    def describe(self) -> str:
        """What the executors run, and that this process reaches them over sockets."""
        devices = [device for device, _ in self.routes.executors]
        if len(devices) == 1:
            return f"{self.described} (in the executor of {devices[0]}, shared by every worker)"
        return (f"{self.described} (in the executors of {', '.join(devices)}, shared by every "
                "worker; each job to the least busy)")

    def close(self) -> None:
        """Close this session's connections."""
        for address in list(self._conns):
            self._drop(address)

    def _least_busy(self, tried: set[str],
                    deadline: float | None) -> tuple[str, Connection, bool]:
        """The executor with the fewest of this process's jobs in flight (the first listed on
        a tie; one that stalled of late last) that can be reached now, other than ``tried``,
        this session's connection to it, and whether that connection was opened now (by
        ``deadline`` and the grace).

        Raises:
            Unavailable: none can be reached.
            DeadlineExceeded: the deadline passed while connecting.
        """
        now = time.monotonic()
        with _IN_FLIGHT_LOCK:
            order = sorted(self._devices, key=lambda address: (  # stable
                _SUSPECT.get(address, 0.0) > now, _IN_FLIGHT[address]))
        why = "its executor's connection broke"
        for address in (a for a in order if a not in tried):
            if address in self._conns:
                return address, self._conns[address], False
            limit = _limit_s(deadline)
            if limit is not None and limit <= 0:
                raise DeadlineExceeded("the deadline passed while connecting to the executors")
            try:  # restarted meanwhile?
                self._conns[address] = self._open(address, 0.0, limit or HANDSHAKE_S)
            except ExecutorLost as exc:
                why = str(exc)
                continue
            return address, self._conns[address], True
        if deadline is not None and time.monotonic() >= deadline:  # it took that long
            raise DeadlineExceeded(f"the deadline passed while connecting ({why})")
        raise Unavailable(f"no executor can be reached now ({why})")

    def _open(self, address: str, within_s: float,
              limit_s: float = HANDSHAKE_S) -> Connection:
        """A connection to the executor at ``address``, told which process this is (it
        answers what it runs): tried for ``within_s`` seconds (once at least), each try and
        the hello within ``limit_s``.

        Raises:
            ExecutorLost: no connection in time, or it closed at once.
        """
        device = self._devices[address]
        conn = self._connect(address, device, within_s, limit_s)
        try:
            conn.send(Hello(os.getpid()))
            described: Described = conn.recv()
        except (EOFError, OSError) as exc:
            conn.close()
            raise ExecutorLost(f"the executor of {device} closed the connection, or did "
                               f"not answer ({type(exc).__name__})") from exc
        self.described, self.precision = described.description, described.precision
        return conn

    def _connect(self, address: str, device: str, within_s: float,
                 limit_s: float) -> Connection:
        """A connection to the executor, trying for ``within_s`` seconds (once at least),
        each try within ``limit_s``.

        Raises:
            ExecutorLost: none could be made in time.
        """
        deadline = time.monotonic() + within_s
        while True:
            try:
                return connect(address, self.routes.authkey, limit_s)
            except (OSError, EOFError, AuthenticationError) as exc:
                if time.monotonic() >= deadline:
                    raise ExecutorLost(f"cannot reach the executor of {device} "
                                       f"({type(exc).__name__}: {exc})") from exc
                time.sleep(0.05)

    def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass
