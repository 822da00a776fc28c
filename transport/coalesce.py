"""Replies written in bulk: inside ``coalesced_sends()``, the frames a thread sends to each
connection gather and go out as one write per connection when the block ends.

A worker's bulk of answers, or a session's batch, often holds several replies for one
pipelined connection; one ``send`` for all of them saves a system call per reply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

log = logging.getLogger(__name__)
_local = threading.local()


class Holder(Protocol):
    """A connection that can hold frames and write them later."""

    def flush_held(self) -> None:
        """Write the frames held so far."""


@contextmanager
def coalesced_sends() -> Iterator[None]:
    """Hold this thread's replies per connection until the block ends (nesting is harmless)."""
    if getattr(_local, "held", None) is not None:
        yield
        return
    _local.held = {}
    try:
        yield
    finally:
        held, _local.held = _local.held, None
        for conn in held:  # each one's failure is its own: the others still get theirs
            try:
                conn.flush_held()
            except Exception:  # noqa: BLE001 - logged; a connection closes itself on failure
                log.exception("writing held replies failed")


def holding(conn: Holder) -> bool:
    """True if this thread is coalescing: ``conn`` is then flushed when the block ends."""
    held = getattr(_local, "held", None)
    if held is None:
        return False
    held[conn] = None
    return True
