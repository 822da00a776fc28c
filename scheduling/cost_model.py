"""How long the engine takes for a batch shape, learnt from measurements (warm-up, then online).

Shapes are bucketed: rows to powers of two, padded length to multiples of ``LENGTH_STEP``. An
engine that pads each batch's rows up to fixed row counts (CUDA graphs: ``Engine.row_steps``)
gives them as the row buckets instead: a batch of 42 rows then costs what the 64-row shape it
runs on costs, so estimates rise in steps, as the device's time does. Likewise its lengths
(``Engine.length_steps``): 30 tokens run as the 64-token graph and cost what 36 do. Each bucket
keeps its most recent measurements and answers with their lower median, so one outlier (a pause,
a noisy neighbour, a batch held up elsewhere) cannot swing a decision: noise only ever adds
time. For the same reason, at each length no batch is held as cheaper than a smaller one
(``monotone``): a bigger batch measured cheaper means the smaller one's figure was inflated (a
warm-up beside other processes warming up, a live batch in a busy spell), so that figure is
left out while a bigger batch undercuts it. The shape is then estimated from the bigger
batches (proportionally below the smallest held), which leans towards running it on its own,
where it is measured again: learning corrects the figure rather than batching on the strength
of it forever. ``estimate`` interpolates over rows at the nearest measured length and scales by
the tokens ratio, so a model warmed on a few shapes can rank any candidate batch. Pure Python,
thread-safe; it knows nothing of engines or sockets.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Sequence

LENGTH_STEP = 32
WINDOW = 9  # recent measurements kept per bucket


def rows_bucket(rows: int) -> int:
    """Rows rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, rows))))


def length_bucket(length: int) -> int:
    """Padded length rounded up to a multiple of LENGTH_STEP."""
    return max(LENGTH_STEP, -(-length // LENGTH_STEP) * LENGTH_STEP)


class CostModel:
    """Seconds per batch as a function of (rows, padded length).

    Args:
        row_steps, length_steps: The row counts and lengths the engine pads batches up to
            (``Engine.row_steps``, ``Engine.length_steps``), if it does; also settable once
            the engine is loaded (``set_steps``).
    """

    def __init__(self, row_steps: Sequence[int] | None = None,
                 length_steps: Sequence[int] | None = None) -> None:
        self._steps, self._length_steps = _ascending(row_steps), _ascending(length_steps)
        self._lock = threading.Lock()
        self._samples: dict[tuple[int, int], deque[float]] = {}
        self._seconds: dict[tuple[int, int], float] = {}  # lower median of each bucket's samples
        self._prior: set[tuple[int, int]] = set()  # buckets holding warm-up samples only
        # by length: (rows, seconds) by rows, held monotone in rows (what estimates and stats use)
        self._curves: dict[int, list[tuple[int, float]]] = {}
        self._nearest_length: dict[int, int] = {}  # length asked for: nearest measured length
        # estimates since the last observation: batch after batch, planning (and a broker
        # worker's pull size) asks for the same few shapes
        self._estimates: dict[tuple[int, int], float | None] = {}

    def set_steps(self, row_steps: Sequence[int] | None,
                  length_steps: Sequence[int] | None = None) -> None:
        """The row counts and lengths the engine pads batches up to (None or empty: it runs
        any); set before it measures, as a session loads its engine."""
        with self._lock:
            self._steps, self._length_steps = _ascending(row_steps), _ascending(length_steps)
            self._estimates.clear()

    @property
    def stepped(self) -> bool:
        """Whether the engine pads batches' rows up to steps (``set_steps``)."""
        return bool(self._steps)

    def padded_rows(self, rows: int) -> int:
        """The rows a batch of ``rows`` runs as: the engine's next row step where it pads to
        steps and one holds it, else ``rows``."""
        return _next_step(self._steps, rows) or rows

    def _length_key(self, length: int) -> int:
        """The length bucket of ``length``: the engine's next length step where it pads to
        steps and one holds it, else the next multiple of LENGTH_STEP."""
        return _next_step(self._length_steps, length) or length_bucket(length)

    def observe(self, rows: int, length: int, seconds: float, warmup: bool = False) -> None:
        """Record one measured batch (engine time only).

        Warm-up samples are a prior: they are taken with the server idle, while live batches run
        beside other sessions' work. A bucket's first live sample replaces its warm-up samples,
        so a bucket used rarely is never compared at idle cost against one used often at
        loaded cost.
        """
        with self._lock:
            step = _next_step(self._steps, rows)  # the device ran a step's whole shape
            key = (step or rows_bucket(rows), self._length_key(length))
            scaled = seconds * key[0] / max(1, step or rows)  # to the bucket's own row count
            samples = self._samples.setdefault(key, deque(maxlen=WINDOW))
            if warmup:
                self._prior.add(key)
            elif key in self._prior:
                self._prior.discard(key)
                samples.clear()
            samples.append(scaled)
            self._seconds[key] = sorted(samples)[(len(samples) - 1) // 2]
            if key[1] not in self._curves:
                self._nearest_length.clear()  # a new length may be nearer to some
            self._curves[key[1]] = monotone(sorted(
                (r, seconds) for (r, n), seconds in self._seconds.items() if n == key[1]))
            self._estimates.clear()

    def estimate(self, rows: int, length: int) -> float | None:
        """Predicted seconds for a batch of ``rows`` padded to ``length``; None before any data."""
        with self._lock:
            key = (self.padded_rows(rows), self._length_key(length))
            if key not in self._estimates:
                self._estimates[key] = self._nearest(*key)
            return self._estimates[key]

    def _nearest(self, rows: int, want: int) -> float | None:
        """Interpolate over rows at the nearest measured length (the shorter of two as near),
        then scale by the length ratio."""
        if not self._curves:
            return None
        length = self._nearest_length.get(want)
        if length is None:
            length = min(self._curves, key=lambda n: (abs(math.log2(n / want)), n))
            self._nearest_length[want] = length
        return _interpolate(self._curves[length], rows) * want / length

    def table(self) -> dict[str, float]:
        """Measured buckets as {"ROWSxLENGTH": milliseconds per batch}, those held (none that
        a bigger batch of its length undercuts), for stats."""
        with self._lock:
            return {f"{r}x{n}": 1000 * s for n, curve in sorted(self._curves.items())
                    for r, s in curve}


def monotone(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``curve`` ((rows, seconds), rows ascending) less every point that a bigger batch's
    figure undercuts: seconds never fall as rows grow. Noise only adds time, so where a bigger
    batch measured cheaper, the smaller one's figure is the inflated one."""
    held: list[tuple[int, float]] = []
    least = math.inf
    for rows, seconds in reversed(curve):
        if seconds <= least:
            held.append((rows, seconds))
            least = seconds
    return held[::-1]


def _ascending(steps: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(sorted(set(steps or ())))


def _next_step(steps: tuple[int, ...], value: int) -> int | None:
    """The first of ``steps`` (ascending) at or over ``value``; None when none is."""
    return steps[bisect.bisect_left(steps, value)] if steps and value <= steps[-1] else None


def _interpolate(points: list[tuple[int, float]], rows: int) -> float:
    """Seconds at ``rows`` from measured (rows, seconds) points: linear between neighbours (so a
    fixed per-batch overhead shows), proportional below the first, extended along the last
    segment (never falling) beyond the last."""
    first_rows, first_s = points[0]
    if rows <= first_rows or len(points) == 1:
        return first_s * rows / first_rows
    for (r1, s1), (r2, s2) in zip(points, points[1:]):
        if rows <= r2:
            return s1 + (s2 - s1) * (rows - r1) / (r2 - r1)
    (r1, s1), (r2, s2) = points[-2:]
    return s2 + max(0.0, (s2 - s1) / (r2 - r1)) * (rows - r2)
