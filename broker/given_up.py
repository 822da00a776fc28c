"""The requests a front end answered without their reply, so that a reply coming after all
(a worker that ran it anyway) is told from a second reply to a request a first reply answered."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

#: Requests remembered; the oldest are forgotten past this many.
KEPT = 65536


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
