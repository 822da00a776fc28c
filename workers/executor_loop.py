"""An executor's run loop (``--executors on``): the rows of every worker's jobs in, batches
through the device's one engine, each job's outputs back once all its rows have run.

A job's groups (workers/executor_wire.py: one padded length each) wait as pieces of rows. The
loop plans each batch over the waiting pieces as a GPU session plans over requests
(scheduling/planner.py with ``fill``), then, where the engine pads rows up to steps (CUDA
graphs), fills the step the batch runs at anyway with rows of pieces left out, no longer than
the batch: a piece may be split, its remainder waiting at its place in the queue. So a batch of
30 rows on a graph of 32 takes 2 more rows where any are waiting, and a worker's job of 15 rows
may run across two batches. A job whose deadline passes before all its rows have run is
answered ``deadline_exceeded`` and its rows left out, as are the rows of a job whose batch
failed: the device runs no row whose answer nobody takes.

Two threads: the run loop (plan, pad, run) and the reply thread (cut each batch's outputs back
into its pieces, and answer each job once its last piece has run), so that the device's next
batch is planned and started while the last one's answers are cut and sent. Where nothing
waits, the loop answers itself: a lone job's answer wakes no other thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from queue import SimpleQueue
from typing import Any, NamedTuple

import numpy as np

from engines.base import Engine
from scheduling.planner import BatchPolicy, plan_batch
from scheduling.session import batch_cost
from workers.executor_wire import Answer, Failure, Job, pad_columns

log = logging.getLogger("executor")


class Link:
    """One worker session's connection, as the executor answers on it (the reply thread and
    the connection's own thread both send)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.source = 0  # the worker process's pid, from its hello
        self._lock = threading.Lock()  # a send, and the close, one at a time
        self._closed = False

    def send(self, message: Any) -> None:
        """Send; a worker that is gone (or a connection closed) is nobody to answer."""
        with self._lock:
            if self._closed:
                return
            try:
                self.conn.send(message)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        """Its worker is gone: nobody takes an answer sent on it."""
        return self._closed

    def close(self) -> None:
        """Close the connection, never in the middle of a send (which a close beneath it
        would break with an error other than OSError)."""
        with self._lock:
            self._closed = True
            self.conn.close()


class JobState:
    """One job in the executor: its pieces' outputs as they run; answered once."""

    def __init__(self, link: Link, job: Job) -> None:
        self.link, self.job_id, self.groups = link, job.job_id, job.groups
        self.deadline = job.deadline
        self.arrived = time.monotonic()
        self.parts: list[list[tuple[int, dict[str, np.ndarray]]]] = [[] for _ in job.groups]
        self.left = sum(_rows(group) for group in job.groups)
        self.device_s = 0.0
        self.last_start = self.arrived
        self.answered = False
        self._lock = threading.Lock()  # answered once: the loop expires, the replies complete

    def add(self, group: int, first: int, outputs: dict[str, np.ndarray], device_s: float,
            started: float) -> bool:
        """One piece's outputs; True when that was the job's last and it is now answered."""
        if self.answered:
            return False  # failed already
        self.parts[group].append((first, outputs))
        self.device_s += device_s
        self.last_start = max(self.last_start, started)
        self.left -= len(next(iter(outputs.values())))
        if self.left > 0 or not self._settle():
            return False
        joined = [_in_order(parts) for parts in self.parts]
        self.link.send(Answer(self.job_id, joined, self.device_s, self.last_start - self.arrived,
                              time.monotonic() - self.last_start))
        return True

    def fail(self, code: str, message: str) -> None:
        """Answer the job with a typed error (its wire ``code``), unless it is answered
        already."""
        if self._settle():
            self.link.send(Failure(self.job_id, code, message))

    def _settle(self) -> bool:
        """True the first time only: this caller answers the job."""
        with self._lock:
            if self.answered:
                return False
            self.answered = True
            return True

    def expire(self, now: float) -> Failure | None:
        """The job's ``deadline_exceeded`` answer, for the caller to send, if its deadline
        passed before ``now`` and it is not answered yet (it is answered from now on)."""
        if self.answered or self.deadline is None or now <= self.deadline \
                or not self._settle():
            return None
        return Failure(self.job_id, "deadline_exceeded", f"its deadline passed "
                       f"{now - self.deadline:.3f} s before all its rows ran on the device")

    def abandon(self) -> None:
        """Its worker is gone: answered from now on, with nothing sent."""
        self._settle()


@dataclass(eq=False)
class Piece:
    """Rows ``first`` to ``first + rows`` of one group of a job (what the planner reads: rows,
    length, enqueued_at)."""

    state: JobState
    group: int
    first: int
    rows: int
    length: int
    enqueued_at: float = field(default_factory=time.monotonic)

    def take(self, rows: int) -> Piece:
        """The first ``rows`` of this piece as a piece of its own; this one keeps the rest."""
        head = Piece(self.state, self.group, self.first, rows, self.length, self.enqueued_at)
        self.first, self.rows = self.first + rows, self.rows - rows
        return head

    def feed(self, name: str) -> np.ndarray:
        """This piece's rows of input ``name``."""
        return self.state.groups[self.group][name][self.first:self.first + self.rows]


class Ran(NamedTuple):
    """A batch run: its pieces, its outputs or the exception it raised, the device seconds it
    cost and when it started."""

    chosen: list[Piece]
    outputs: Any
    seconds: float
    started: float


def fill_step(chosen: list[Piece], window: list[Piece], policy: BatchPolicy) -> list[Piece]:
    """``chosen`` and, where the engine pads rows up to steps, rows of the pieces of ``window``
    left out (no longer than the batch, its own length first) up to the step the batch runs
    at, within the token budget and the cap; the last piece taken may be split."""
    cost = policy.cost
    if cost is None or not cost.stepped:
        return chosen
    rows, length = sum(p.rows for p in chosen), max(p.length for p in chosen)
    room = cost.padded_rows(rows) - rows
    if policy.max_tokens:
        room = min(room, policy.max_tokens // length - rows)
    taken = set(map(id, chosen))
    left_out = sorted((p for p in window if id(p) not in taken and p.length <= length),
                      key=lambda p: length - p.length)  # stable: oldest first among equals
    out = list(chosen)
    for piece in left_out:
        if room <= 0 or len(out) >= policy.cap:
            break
        rows_taken = min(room, piece.rows)
        out.append(piece if rows_taken == piece.rows else piece.take(rows_taken))
        room -= rows_taken
    return out


class Executor:
    """The run loop and the reply thread over one engine (see the module docstring)."""

    def __init__(self, engine: Engine, policy: BatchPolicy, per_token: bool) -> None:
        self.engine, self.policy, self.per_token = engine, policy, per_token
        self._pieces: list[Piece] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._ran: SimpleQueue[Ran | None] = SimpleQueue()
        self._replying = threading.Lock()  # one thread cuts and answers a batch at a time
        self.counts = {"batches": 0, "rows": 0, "jobs": 0, "expired_jobs": 0,
                       "shared_batches": 0, "most_processes_in_a_batch": 0}
        self.engine_s = 0.0  # wall seconds in the engine's runs
        self.idle_s = 0.0  # seconds the loop waited with nothing to run
        self._threads = [threading.Thread(target=_or_exit(self._loop), name="run-loop",
                                          daemon=True),
                         threading.Thread(target=_or_exit(self._replies), name="replies",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def figures(self) -> dict[str, Any]:
        """Batches, rows and jobs run, jobs failed for their deadline, batches holding rows of
        several worker processes, the most processes in one, pieces waiting now, the seconds in
        the engine and idle, and the device's busy share where the engine knows it."""
        with self._cond:
            waiting = len(self._pieces)
        out = {**self.counts, "pieces_waiting": waiting, "engine_s": round(self.engine_s, 3),
               "idle_s": round(self.idle_s, 3)}
        busy = self.engine.device_busy()
        return out if busy is None else {**out, "device_busy": busy}

    def submit(self, link: Link, job: Job) -> None:
        """Queue a job's groups for the coming batches."""
        state = JobState(link, job)
        if state.left == 0:  # a session never sends one: nothing to run, nothing to answer with
            state.fail("engine_error", "a job of no rows")
            return
        pieces = [Piece(state, number, 0, _rows(group), next(iter(group.values())).shape[1],
                        state.arrived) for number, group in enumerate(job.groups) if _rows(group)]
        with self._cond:
            self._pieces.extend(pieces)
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        """Run what is queued, answer it, then end both threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    expired = self._drop_unwanted()
                for state, failure in expired:  # sent with the queue open to connections
                    state.link.send(failure)
                with self._cond:
                    if not self._pieces and not self._stopping:
                        waited = time.monotonic()
                        self._cond.wait_for(lambda: bool(self._pieces) or self._stopping)
                        self.idle_s += time.monotonic() - waited
                        continue  # what came may be past its deadline already
                    if not self._pieces:
                        return
                    chosen = self._plan()
                self._hand_over(self._run(chosen))
        finally:
            self._ran.put(None)

    def _hand_over(self, ran: Ran) -> None:
        """Answer ``ran`` on this thread where nothing else waits (no piece to plan, no batch
        being cut): a lone job's answer then wakes no reply thread. Else the reply thread
        cuts and sends it while the next batch runs."""
        with self._cond:
            alone = not self._pieces and not self._stopping
        if alone and self._ran.empty() and self._replying.acquire(blocking=False):
            try:
                self._reply(ran)
            finally:
                self._replying.release()
            return
        self._ran.put(ran)

    def _drop_unwanted(self) -> list[tuple[JobState, Failure]]:
        """Out of the queue: the pieces of jobs answered already (a batch holding some of their
        rows failed), of jobs whose worker is gone, and of jobs whose deadline has passed
        (returned with their ``deadline_exceeded`` answers, to send), so that the device runs
        no row whose answer nobody takes."""
        now, expired = time.monotonic(), []
        for piece in self._pieces:
            state = piece.state
            if state.link.closed:
                state.abandon()
            elif (failure := state.expire(now)) is not None:
                expired.append((state, failure))
        self.counts["expired_jobs"] += len(expired)
        self._pieces = [piece for piece in self._pieces if not piece.state.answered]
        return expired

    def _plan(self) -> list[Piece]:
        """The next batch's pieces, out of the queue (a split piece's rest stays in it)."""
        window = self._pieces[:self.policy.lookahead]
        chosen = fill_step(plan_batch(window, self.policy), window, self.policy)
        taken = set(map(id, chosen))
        self._pieces = [piece for piece in self._pieces if id(piece) not in taken]
        return chosen

    def _run(self, chosen: list[Piece]) -> Ran:
        """One batch: its pieces, outputs (or the error), device seconds and start."""
        length = max(piece.length for piece in chosen)
        rows = sum(piece.rows for piece in chosen)
        started = time.monotonic()
        try:
            feeds = {name: np.concatenate([pad_columns(piece.feed(name), length)
                                            for piece in chosen])
                     for name in self.engine.input_names}
            outputs: Any = self.engine.run(feeds)
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            log.exception("a batch of %d rows failed", rows)
            return Ran(chosen, exc, 0.0, started)
        wall = time.monotonic() - started
        seconds = batch_cost(self.engine, wall)
        if self.policy.cost is not None:
            self.policy.cost.observe(rows, length, seconds)
        self.engine_s += wall
        sources = len({piece.state.link.source for piece in chosen})
        counts = self.counts
        counts["batches"] += 1
        counts["rows"] += rows
        counts["shared_batches"] += sources > 1
        counts["most_processes_in_a_batch"] = max(counts["most_processes_in_a_batch"], sources)
        return Ran(chosen, outputs, seconds, started)

    def _replies(self) -> None:
        """The reply thread: each batch the loop hands over, cut and answered."""
        while (ran := self._ran.get()) is not None:
            with self._replying:
                self._reply(ran)

    def _reply(self, ran: Ran) -> None:
        """Cut a batch's outputs into its pieces; answer the jobs they complete (or fail its
        jobs, where it failed)."""
        chosen, outputs, seconds, started = ran
        if not isinstance(outputs, Exception):
            try:
                self._answer(chosen, outputs, seconds, started)
                return
            except Exception as exc:  # noqa: BLE001 - outputs it cannot cut: they fail
                log.exception("cutting a batch's outputs failed")
                outputs = exc
        for piece in chosen:  # answered already: no second answer
            piece.state.fail("engine_error", f"{type(outputs).__name__}: {outputs}")

    def _answer(self, chosen: list[Piece], outputs: dict[str, np.ndarray], seconds: float,
                started: float) -> None:
        """Each piece its rows of ``outputs``; the jobs they complete answered."""
        rows, first = sum(piece.rows for piece in chosen), 0
        for piece in chosen:
            part = slice(first, first + piece.rows)
            first += piece.rows
            mine = {name: (value[part, :piece.length] if self.per_token else value[part])
                    for name, value in outputs.items()}
            if piece.state.add(piece.group, piece.first, mine, seconds * piece.rows / rows,
                               started):
                self.counts["jobs"] += 1


def _or_exit(body: Callable[[], None]) -> Callable[[], None]:
    """``body``, ending the process should anything escape it: a thread of the executor
    gone would leave jobs unanswered while the process lives on, where its exit fails them
    (the workers see the connection close) and the front end starts a new executor."""
    def guarded() -> None:
        try:
            body()
        except BaseException:  # noqa: BLE001 - said, then the process ends
            log.critical("the executor's %s thread failed: exiting",
                         threading.current_thread().name, exc_info=True)
            logging.shutdown()
            os._exit(1)
    return guarded


def _rows(group: dict[str, np.ndarray]) -> int:
    return len(next(iter(group.values()))) if group else 0


def _in_order(parts: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """One group's outputs from its pieces' (first row, outputs), in row order."""
    if len(parts) == 1:
        return parts[0][1]
    parts = sorted(parts, key=lambda part: part[0])
    return {name: np.concatenate([outputs[name] for _, outputs in parts])
            for name in parts[0][1]}
