"""What the front end hands admitted requests to: the interface every way of serving implements.

Two implementations today: ``LocalBackend`` (``--workers 1``: tokenize, batch and run in this
process) and ``ProcessBackend`` (``--workers N``: a queue in the front end that N worker processes
pull from). A networked broker (Redis Streams: front ends on one side, GPU workers on the other)
implements the same: ``submit``, ``flush`` and ``purge`` on the way in, answers through each
request's ``respond`` on the way out, plus ``ready``, ``describe`` and a draining ``stop``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from protocol.messages import ModelRequest
from scheduling.queue import Responder, WorkItem
from telemetry.stats import ServerStats


class Backend(Protocol):
    """Where admitted requests go, and how they come back."""

    def start(self, cancel: threading.Event | None = None) -> None:
        """Load and warm up everything; return once serving. Raises RuntimeError if it cannot,
        and ``StartCancelled`` (scheduling/waits.py) once ``cancel`` is set before it serves;
        ``stop`` then releases what was started."""

    def submit(self, request: ModelRequest, respond: Responder,
               alive: Callable[[], bool], enqueued_at: float, deadline: float | None) -> None:
        """Admit one request of the model's op now or raise a ServerError now (BadRequest,
        Overloaded, ShuttingDown); once admitted, ``respond`` is called exactly once, with the
        answer or a typed error (deadline_exceeded, engine_error, worker_lost, ...), unless
        its client left first (``respond.abandon()``, where the responder has one)."""

    def flush(self) -> None:
        """Hand on what was submitted so far (called once per read of a connection, so that a
        pipelined burst can travel on as one message)."""

    def purge(self, drop: Callable[[WorkItem], bool]) -> list[WorkItem]:
        """Remove still-waiting requests for which ``drop`` is true; return them unanswered."""

    @property
    def ready(self) -> bool:
        """Loaded, warmed up and serving, everywhere."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting to be run."""

    def describe(self) -> dict[str, Any]:
        """The engine and batching figures, for stats."""

    def worker_figures(self) -> list[dict[str, Any]]:
        """One entry per worker process: worker, pid, device, state, in_flight, restarts,
        figures (its batch figures if it answered now) and known_figures (else its last)."""

    def summed(self, stats: ServerStats, figures: list[dict[str, Any]]) -> ServerStats:
        """``stats`` with the figures kept elsewhere (other processes) added in."""

    def stop(self, timeout: float) -> bool:
        """Refuse new work, answer all admitted work (``shutting_down`` past ``timeout``),
        release everything; True if all was run in time."""
