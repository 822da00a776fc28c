"""What crosses the socket between a worker's sessions and a device's executor (``--executors
on``): small named messages, and how a worker's batch is cut into groups of rows by length and
put back together.

A worker session's batch is padded to its longest request. Before it goes to the executor it is
cut into groups, one per length: each row is trimmed to the shortest of the engine's lengths
(``capture_lengths``, the CUDA graphs' lengths) that holds its real tokens (its attention
mask), so that a short request's rows run in the executor's batches of short rows, not padded
to another request's length. Only padding goes: a row's real tokens, and so its outputs, do
not change. The executor answers each group's rows; ``join_groups`` puts them back in the
batch's order, per-token outputs padded with zeros past each group's length (columns past a
row's length are padding, which no task reads).

Worker -> executor: ``Hello`` first on each connection, then ``Job``s. Executor -> worker:
``Described`` for the hello, then one ``Answer`` or ``Failure`` per job, in any order.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from engines.shapes import capture_lengths

#: Tasks whose outputs are one row of numbers per input row, not one per token.
FIXED_WIDTH_TASKS = frozenset({"embed", "classify"})


class ExecutorRoutes(NamedTuple):
    """Where a worker reaches the executors (front end -> worker, in its first message): each
    (device, Unix socket address), the worker's own device's first, and their listeners' key."""

    executors: tuple[tuple[str, str], ...]
    authkey: bytes


class Hello(NamedTuple):
    """A worker session's first message: which process it is."""

    pid: int


class Described(NamedTuple):
    """The executor's answer to a hello: what it runs."""

    description: str
    precision: str


class Job(NamedTuple):
    """One worker batch's rows, as groups of one padded length each (``split_by_length``), and
    the ``time.monotonic()`` after which none of its requests wants an answer (None: never).
    One clock serves every process of a machine."""

    job_id: int
    groups: list[dict[str, np.ndarray]]
    deadline: float | None = None


class Answer(NamedTuple):
    """A job's outputs, one dict per group, rows in the group's order, and its timings in the
    executor: the device seconds its rows' share of their batches came to, the seconds from its
    arrival to its last batch's start (queued), and from that start to this answer (run)."""

    job_id: int
    outputs: list[dict[str, np.ndarray]]
    device_s: float
    queued_s: float
    run_s: float


class Failure(NamedTuple):
    """A job that did not run, or not all of it: its typed error's wire code
    (protocol/errors.py: ``engine_error``, the engine failed on a batch holding its rows;
    ``deadline_exceeded``, its deadline passed before its rows ran) and message."""

    job_id: int
    code: str
    message: str


class Split(NamedTuple):
    """A batch cut into groups: the groups, and each group's rows' places in the batch."""

    groups: list[dict[str, np.ndarray]]
    places: list[np.ndarray]


def split_by_length(feeds: Mapping[str, np.ndarray], buckets: Sequence[int]) -> Split:
    """``feeds`` cut into groups of rows by the length that holds each row's real tokens: the
    first of ``capture_lengths(buckets, width)`` at or over the row's attention-mask count. One
    group of every row where the feeds have no ``attention_mask``."""
    mask = feeds.get("attention_mask")
    rows, width = next(iter(feeds.values())).shape
    if mask is None or rows == 0:
        return Split([dict(feeds)], [np.arange(rows)])
    lengths = capture_lengths(buckets, width)
    real = np.asarray(mask).sum(axis=1)
    fitted = np.array([lengths[min(bisect.bisect_left(lengths, n), len(lengths) - 1)]
                       for n in real.tolist()])
    groups, places = [], []
    for length in sorted(set(fitted.tolist())):
        place = np.flatnonzero(fitted == length)
        whole = len(place) == rows
        groups.append({name: (value if whole else value[place])[:, :length]
                       for name, value in feeds.items()})
        places.append(place)
    return Split(groups, places)


def join_groups(outputs: Sequence[Mapping[str, np.ndarray]], places: Sequence[np.ndarray],
                rows: int, width: int, per_token: bool) -> dict[str, np.ndarray]:
    """The groups' outputs back in the batch's row order; per-token outputs (``[rows,
    length]``) padded with zeros up to the batch's ``width``."""
    if len(outputs) == 1 and len(places[0]) == rows:
        only = outputs[0]
        if not per_token:
            return dict(only)
        return {name: pad_columns(value, width) for name, value in only.items()}
    joined: dict[str, np.ndarray] = {}
    for group, place in zip(outputs, places, strict=True):
        for name, value in group.items():
            if name not in joined:
                shape = (rows, width, *value.shape[2:]) if per_token else (rows, *value.shape[1:])
                joined[name] = np.zeros(shape, dtype=value.dtype)
            if per_token:
                joined[name][place, :value.shape[1]] = value
            else:
                joined[name][place] = value
    return joined


def pad_columns(value: np.ndarray, width: int) -> np.ndarray:
    """``value`` (rows first) padded with zeros along its second axis up to ``width``: for
    inputs, pad ids with no attention in segment 0; for per-token outputs, columns no task
    reads."""
    short = width - value.shape[1]
    pads = [(0, 0), (0, short)] + [(0, 0)] * (value.ndim - 2)
    return value if short <= 0 else np.pad(value, pads)
