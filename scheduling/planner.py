"""How a free session forms its next batch: pure functions of what is waiting, no threads.

* the oldest waiting request is always in the batch, so nothing starves;
* the rest come from a bounded look-ahead, similar padded lengths first, then by arrival;
* caps: ``max_items`` requests and ``max_tokens`` (rows x padded length) per batch;
* ``auto`` adds a request only if the cost model predicts that adding it costs no more than
  running it on its own, and keeps a batch only if it is at least MIN_GAIN cheaper than running
  its requests one by one (so on hardware where batching does not pay it serves batch 1);
  ``fixed`` fills up to the caps; ``off`` takes one request;
* ``fill`` (a device-bound engine, a GPU: engines/base.py): ``auto`` fills up to the caps as
  ``fixed`` does, except where the cost model has estimates (the device's own times) and a
  request's length differs from the batch's: a longer one, which would pad the whole batch,
  joins only if that is no dearer than running it apart; a shorter one joins only while what
  it adds, padded to the batch's length, is at most SHORTER_SLACK times what its rows cost in
  the cheapest batch of its own length. Requests of the batch's length always join, so
  batches never shrink below them; a request left out leads a batch of its own length once
  it is the oldest. On an engine that pads rows up to steps (CUDA graphs), the batch is then
  cut back to its cheapest prefix per row (``cheapest_prefix``): it fills a step rather than
  spilling a few rows into the next, twice as dear;
* the queue delay (from the oldest request's arrival) is spent only when waiting can help: a
  bigger batch would be cheaper per request, other sessions are busy (real load), and requests
  are arriving fast enough that one is expected before the delay runs out.

scheduling/queue.py calls these under its lock; tests call them on plain lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduling.cost_model import CostModel

BATCHING_MODES = ("auto", "fixed", "off")
#: The server setting whose values these are (settings/choices.py).
SETTING_CHOICES = {"batching": BATCHING_MODES}
#: Smallest predicted saving of a batch over running its requests one by one, for auto to batch
#: at all: ties and noise keep batch 1, the safe choice where batching does not pay.
MIN_GAIN = 0.05
#: With ``fill``, a request shorter than the batch joins while what it adds, padded to the
#: batch's length, is at most this many times its rows' cost in a batch of its own length.
SHORTER_SLACK = 1.5


class Waiting(Protocol):
    """What planning reads of a waiting request."""

    rows: int
    length: int
    enqueued_at: float


@dataclass(frozen=True, kw_only=True)
class BatchPolicy:
    """How a free session forms its next batch (see the module docstring)."""

    mode: str = "auto"
    max_items: int = 32
    max_tokens: int | None = None
    max_delay_s: float = 0.0
    lookahead: int = 128
    cost: CostModel | None = None
    fill: bool = False

    def __post_init__(self) -> None:
        if self.mode not in BATCHING_MODES:
            raise ValueError(f"batching mode must be one of {BATCHING_MODES}, got {self.mode!r}")
        if self.max_items < 1 or self.lookahead < 1:
            raise ValueError("max_items and lookahead must be at least 1")

    @property
    def cap(self) -> int:
        """Most requests per batch under this policy."""
        return 1 if self.mode == "off" else self.max_items

    @property
    def judged(self) -> bool:
        """Whether the cost model decides how far batches grow (``auto`` without ``fill``)."""
        return self.mode == "auto" and not self.fill


def plan_batch(waiting: Sequence[Waiting], policy: BatchPolicy) -> list:
    """The batch to run now out of ``waiting`` (oldest first, not empty), under ``policy``."""
    oldest = waiting[0]
    if policy.cap == 1 or (policy.judged and policy.cost is None):
        return [oldest]  # nothing may join it (auto with no cost data batches nothing)
    chosen, rows, length = [oldest], oldest.rows, oldest.length
    others = list(itertools.islice(waiting, 1, policy.lookahead))
    others.sort(key=lambda item: abs(item.length - oldest.length))  # stable: FIFO among equals
    estimate = _Estimates(policy.cost) if policy.mode == "auto" else None
    # Whether a request may join depends only on its shape and the batch so far: a shape
    # refused stays refused until the batch grows, so a long queue is judged once per shape.
    refused: set[tuple[int, int]] = set()
    for item in others:
        if len(chosen) >= policy.cap:
            break
        shape = (item.rows, item.length)
        if shape in refused:
            continue
        new_rows, new_length = rows + item.rows, max(length, item.length)
        if (policy.max_tokens and new_rows * new_length > policy.max_tokens) or (
                estimate is not None and _dearer(estimate, policy, (rows, length), shape)):
            refused.add(shape)  # over the token cap, or dearer together than on its own
            continue
        chosen.append(item)
        rows, length = new_rows, new_length
        refused.clear()
    if policy.judged and estimate is not None and len(chosen) > 1 and not estimate.no_dearer(
            rows, length, [(i.rows, i.length) for i in chosen], MIN_GAIN):
        return [oldest]  # not clearly cheaper than running them one by one
    if policy.fill and estimate is not None and len(chosen) > 1 and policy.cost is not None \
            and policy.cost.stepped:
        return cheapest_prefix(chosen, estimate)
    return chosen


def cheapest_prefix(chosen: list, estimate: Callable[[int, int], float | None]) -> list:
    """The longest prefix of ``chosen`` (in the order it was chosen, the oldest first) whose
    predicted cost per row is the least of any prefix's: where an engine pads rows up to steps
    (CUDA graphs), 42 rows run as 64 and cost more per row than 32, so the batch stops at 32
    and the rest leads the next one. All of ``chosen`` where some estimate is missing."""
    per_row: list[float] = []
    rows = length = 0
    for item in chosen:
        rows, length = rows + item.rows, max(length, item.length)
        cost = estimate(rows, length)
        if cost is None:
            return chosen
        per_row.append(cost / rows)
    least = min(per_row) * (1 + 1e-9)  # ties: the longer prefix
    return chosen[:max(i for i, cost in enumerate(per_row) if cost <= least) + 1]


def _dearer(estimate: _Estimates, policy: BatchPolicy, batch: tuple[int, int],
            shape: tuple[int, int]) -> bool:
    """Whether a request of ``shape`` must stay out of ``batch`` (rows, padded length), by the
    cost model (``auto`` only; without estimates it joins):

    - without ``fill``: the batch with it is predicted dearer than the two apart;
    - with ``fill``, a request longer than the batch: likewise;
    - with ``fill``, a shorter one: what it adds to the batch, padded to the batch's length,
      is over SHORTER_SLACK times what its rows cost in the cheapest batch of its own length
      (so a batch takes short requests only into rows it pays for anyway).
    """
    together = (batch[0] + shape[0], max(batch[1], shape[1]))
    if policy.judged:
        return not estimate.no_dearer(*together, [batch, shape])
    if shape[1] == batch[1] or None in (estimate(*together), estimate(*batch), estimate(*shape)):
        return False
    if shape[1] > batch[1]:
        return not estimate.no_dearer(*together, [batch, shape])
    adds = estimate(*together) - estimate(*batch)  # type: ignore[operator]
    own = estimate.best_per_row(shape[1], policy)
    return own is not None and adds > SHORTER_SLACK * own * shape[0]


class _Estimates:
    """The cost model's estimates for one plan, each shape asked once (planning one batch asks
    for the same few shapes over and over)."""

    def __init__(self, cost: CostModel | None) -> None:
        self.cost = cost
        self.known: dict[tuple[int, int], float | None] = {}

    def __call__(self, rows: int, length: int) -> float | None:
        key = (rows, length)
        if key not in self.known:
            self.known[key] = None if self.cost is None else self.cost.estimate(rows, length)
        return self.known[key]

    def best_per_row(self, length: int, policy: BatchPolicy) -> float | None:
        """The least predicted cost per row of a batch of ``length``: over row counts 1, 2,
        4, ... up to the policy's caps."""
        costs = []
        rows = 1
        while rows <= policy.cap and (not policy.max_tokens or rows * length <= policy.max_tokens
                                      or rows == 1):
            cost = self(rows, length)
            if cost is None:
                return None
            costs.append(cost / rows)
            rows *= 2
        return min(costs)

    def no_dearer(self, rows: int, length: int, apart: list[tuple[int, int]],
                  gain: float = 0.0) -> bool:
        """Whether one batch of ``rows`` padded to ``length`` is predicted at least ``gain``
        cheaper than the shapes ``apart`` run one after another (False without estimates)."""
        together = self(rows, length)
        costs = [self(*shape) for shape in apart]
        if together is None or None in costs:
            return False
        return together <= (1 - gain) * sum(costs)  # type: ignore[arg-type]


def wait_for_more(policy: BatchPolicy, chosen: Sequence[Waiting], waiting: int, busy: int,
                  arrival_rate: float, now: float) -> float:
    """Seconds left to wait for a bigger batch than ``chosen``, or 0 to run it now.

    Args:
        waiting: Requests waiting in all (``chosen`` among them).
        busy: Sessions running a batch now.
        arrival_rate: Recent arrivals per second.
        now: The monotonic clock now.
    """
    if policy.max_delay_s <= 0 or len(chosen) >= policy.cap:
        return 0.0
    if len(chosen) < waiting or busy == 0:
        return 0.0  # the caps or costs already refused waiting work, or no real load
    left = chosen[0].enqueued_at + policy.max_delay_s - now
    if left <= 0 or arrival_rate * left < 1.0:
        return 0.0
    if policy.judged:
        rows, length = sum(i.rows for i in chosen), max(i.length for i in chosen)
        like_oldest = (chosen[0].rows, chosen[0].length)
        if not cheaper_together(policy.cost, (rows, length), [like_oldest], MIN_GAIN):
            return 0.0  # one more such request would not be clearly cheaper in the batch
    return left


def cheaper_together(cost: CostModel | None, batch: tuple[int, int] | None,
                     extra: list[tuple[int, int]], gain: float) -> bool:
    """Whether running ``batch`` (rows, padded length; None for empty) together with the
    ``extra`` requests, each (rows, length), is predicted at least ``gain`` cheaper than running
    the batch and then each extra request on its own. Throughput is what counts: requests of
    different sizes are compared by what they cost, not by their number."""
    shapes = ([batch] if batch else []) + extra
    return _Estimates(cost).no_dearer(sum(r for r, _ in shapes), max(n for _, n in shapes),
                                      shapes, gain)


def worth_batching(policy: BatchPolicy, length: int) -> int:
    """Requests worth batching together at ``length`` tokens, by the policy's cost model: the
    largest power of two up to its cap whose cost per request is at least MIN_GAIN below the
    last one's (1 where batching does not pay, as on most CPUs; the cap without a cost model
    or outside ``auto``)."""
    cap, cost = policy.cap, policy.cost
    if policy.mode != "auto" or cost is None:
        return cap
    best, rows = 1, 2
    while rows <= cap:
        now, before = cost.estimate(rows, length), cost.estimate(best, length)
        if now is None or before is None or now / rows > before / best * (1 - MIN_GAIN):
            break
        best, rows = rows, rows * 2
    return best
