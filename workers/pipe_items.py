"""What crosses the pipe between the front end and a worker process (workers/processes.py and
workers/worker_main.py), as small named types both sides import from here.

A worker runs as ``python -m workers.worker_main``: were these defined there, unpickling one in
the worker would import that module a second time, under its own name beside ``__main__``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from protocol.messages import ModelRequest


class Job(NamedTuple):
    """One admitted request as it travels the pipe to a worker (a tuple: cheap to pickle)."""

    job_id: int  #: the front end's number for it, which its answer carries back
    request: ModelRequest
    enqueued_at: float  #: when the front end admitted it (``time.monotonic()``)
    deadline: float | None  #: ``time.monotonic()`` after which it must not run


#: One answer as it travels back: (job_id, result, error code, error message).
Answer = tuple[int, "dict[str, Any] | None", "str | None", "str | None"]
