"""What an executor (workers/executor_loop.py) holds of each worker's work: the connection it
answers on (``Link``), each job as it runs (``JobState``: its pieces' outputs, answered once), the
pieces of rows batches are planned over (``Piece``), a batch run (``Ran``), and ``fill_step``,
which fills a CUDA graph's row step with rows of pieces left out."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from engines.base import Launched
from scheduling.planner import BatchPolicy
from workers.executor_wire import Answer, Failure, Job


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
        self.left = sum(group_rows(group) for group in job.groups)
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
    cost and when it started; or, launched on an overlapping engine and not yet taken, its
    launch in ``pending`` (outputs None)."""

    chosen: list[Piece]
    outputs: Any
    seconds: float
    started: float
    pending: Launched | None = None


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


def group_rows(group: dict[str, np.ndarray]) -> int:
    """The rows of one group of a job (0 for an empty one)."""
    return len(next(iter(group.values()))) if group else 0


def _in_order(parts: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """One group's outputs from its pieces' (first row, outputs), in row order."""
    if len(parts) == 1:
        return parts[0][1]
    parts = sorted(parts, key=lambda part: part[0])
    return {name: np.concatenate([outputs[name] for _, outputs in parts])
            for name in parts[0][1]}
