"""A brokered front end's record of its requests: each one on its way through Redis, and those
it answered without their reply, so that a reply coming after all (a worker ran it anyway) is
told from a second reply to a request a first reply answered."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from scheduling.queue import WorkItem

#: Requests remembered; the oldest are forgotten past this many.
KEPT = 65536


@dataclass(eq=False, slots=True)
class InFlight:
    """A request on its way through Redis."""

    number: int
    item: WorkItem
    entry: bytes | None = None  # its work entry's id, once added
    sent_at: float = 0.0  # time.monotonic() when it went to Redis


class GivenUp:
    """A bounded record of request numbers (not thread-safe: the front end's lock guards it)."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._numbers: OrderedDict[int, None] = OrderedDict()

    def add(self, numbers: Iterable[int]) -> None:
        """These were answered without a reply (deadline, unavailable, client gone)."""
        for number in numbers:
            self._numbers[number] = None
        while len(self._numbers) > self.kept:
            self._numbers.popitem(last=False)

    def take(self, number: int) -> bool:
        """True (once) if ``number`` was given up on: its reply is late, not a duplicate."""
        if number not in self._numbers:
            return False
        del self._numbers[number]
        return True
