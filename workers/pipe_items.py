"""What crosses the pipe between the front end and a process it starts (a worker,
workers/processes.py and workers/worker_main.py; an executor, workers/executors.py and
workers/executor_main.py), as small named types both sides import from here.

Front end -> process: a ``WorkerStart`` or ``ExecutorStart`` first, then ``Jobs`` (workers
only), ``AskStats`` and, last, ``Stop``. Process -> front end: ``Ready`` or ``Failed``, then
``Answers`` (workers only) and a ``Stats`` for each ``AskStats``.

A worker runs as ``python -m workers.worker_main``: were these defined there, unpickling one in
the worker would import that module a second time, under its own name beside ``__main__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from protocol.messages import ModelRequest

if TYPE_CHECKING:
    from settings.server_config import ServerConfig
    from workers.executor_wire import ExecutorRoutes


class WorkerStart(NamedTuple):
    """A worker's first message: its settings, slot, device, log level and, with
    ``--executors on``, where it reaches the executors."""

    config: ServerConfig
    index: int
    device: str
    log_level: int
    executor: ExecutorRoutes | None


class ExecutorStart(NamedTuple):
    """An executor's first message: its settings, device, the Unix socket it listens on and
    that listener's key, and its log level."""

    config: ServerConfig
    device: str
    address: str
    authkey: bytes
    log_level: int


class Job(NamedTuple):
    """One admitted request as it travels the pipe to a worker (a tuple: cheap to pickle)."""

    job_id: int  #: the front end's number for it, which its answer carries back
    request: ModelRequest
    enqueued_at: float  #: when the front end admitted it (``time.monotonic()``)
    deadline: float | None  #: ``time.monotonic()`` after which it must not run


class Jobs(NamedTuple):
    """Requests handed to a worker in one message."""

    jobs: list[Job]


class Answer(NamedTuple):
    """One request's answer as it travels back: its result, or its typed error's wire code and
    message (protocol/errors.py)."""

    job_id: int
    result: dict[str, Any] | None
    error_code: str | None
    error_message: str | None


class Answers(NamedTuple):
    """A worker's answers, sent in bulk."""

    answers: list[Answer]


class AskStats(NamedTuple):
    """Asks for the process's figures; ``token`` comes back with them."""

    token: int = 0


class Stats(NamedTuple):
    """The figures asked for with ``token``."""

    token: int
    figures: dict[str, Any]


class Ready(NamedTuple):
    """Loaded and warmed up: what it runs (a worker's ``describe()``, an executor's engine
    description)."""

    detail: Any


class Failed(NamedTuple):
    """It could not load: why."""

    message: str


class Stop(NamedTuple):
    """Drain and exit."""
