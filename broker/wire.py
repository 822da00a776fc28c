"""What travels through Redis: one work entry per request, one reply entry per answer, for a
model of any task.

A front end does all of a task's work (tokenizing, choosing the answer); a worker runs engine
rows. So an entry carries what an executor's job carries (workers/executor_wire.py): the
request's engine inputs by input name, and the reply its engine outputs by output name.

A work entry (field ``m`` of an entry of a model's work stream) is a msgpack map:

    r  the front end's reply stream            i  the request's number at that front end
    t  admitted at, Unix seconds               d  deadline, Unix seconds (absent: none)
    f  the request's engine inputs: {name: array}, rows x padded length
    m  the front end's model fingerprint (engines.model_dir.model_fingerprint; absent: none)

A reply entry (field ``m`` of the front end's reply stream) is ``{"i": number, "o": {name:
array}}`` (the request's rows of each engine output) or ``{"i": number, "c": error code, "x":
message}``, either with ``"w"``: seconds the worker held the request.

An array is ``[dtype, wire dtype, shape, bytes]``: integers travel in the narrowest integer
type that holds their values (token ids in 2 bytes, masks in 1) and are widened back on
arrival, so the engine sees the dtype the task made.

Times are wall-clock seconds because front ends and workers may be on different machines
(their clocks are assumed to agree to within a small part of a deadline, as NTP keeps them);
each side turns them into its own ``time.monotonic()`` at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

#: The one field of every entry.
FIELD = b"m"
#: Integer types an integer array may travel in, narrowest first.
NARROW = (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32)
#: Kinds of arrays an entry may carry: booleans, integers, floats; at most 4 dimensions.
KINDS, MAX_DIMS = "biuf", 4


class BadWork(ValueError):
    """A work entry whose reply stream and number could be read, and nothing else: its front
    end is answered this error's message, typed ``internal``."""

    def __init__(self, reply_to: str, number: int, message: str) -> None:
        super().__init__(message)
        self.reply_to, self.number = reply_to, number


@dataclass(frozen=True, slots=True)
class Feeds:
    """One request's engine inputs, as a worker's queue and batch planner see them."""

    arrays: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        """Engine rows (QA windows, texts)."""
        return int(next(iter(self.arrays.values())).shape[0])

    @property
    def max_len(self) -> int:
        """Its padded length: the width of its arrays (``[rows, width]``, as decode_work
        checks)."""
        return int(next(iter(self.arrays.values())).shape[1])


@dataclass(frozen=True, slots=True)
class Work:
    """One decoded work entry."""

    reply_to: str
    number: int
    feeds: Feeds
    enqueued_at: float  # time.monotonic() of this process
    deadline: float | None  # time.monotonic() of this process
    taken_at: float  # time.monotonic() when this process read it
    model: str | None = None  # the front end's model_fingerprint (None: it sent none)


def pack_array(value: np.ndarray) -> list[Any]:
    """``value`` as the wire's ``[dtype, wire dtype, shape, bytes]``."""
    value = np.asarray(value)
    wire = value.dtype
    if value.dtype.kind in "iu" and value.size:
        low, high = int(value.min()), int(value.max())
        wire = next((np.dtype(t) for t in NARROW if np.iinfo(t).min <= low
                     and high <= np.iinfo(t).max), value.dtype)
    data = np.ascontiguousarray(value, dtype=wire).tobytes()
    return [value.dtype.str, wire.str, list(value.shape), data]


def unpack_array(packed: Any) -> np.ndarray:
    """The array of a wire's ``[dtype, wire dtype, shape, bytes]``: booleans, integers or
    floats of at most 8 bytes and ``MAX_DIMS`` dimensions of at least 1, whose bytes fill its
    shape exactly (so no entry makes an array more than 8 times its own size). Where it
    travelled in its own dtype it is a read-only view of ``bytes``, not a copy.

    Raises:
        ValueError: the parts do not make such an array.
    """
    if not isinstance(packed, list | tuple) or len(packed) != 4:
        raise ValueError("an array is [dtype, wire dtype, shape, bytes]")
    dtype, wire, shape, data = _dtype(packed[0]), _dtype(packed[1]), packed[2], packed[3]
    if not isinstance(shape, list | tuple) or not 0 < len(shape) <= MAX_DIMS \
            or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"bad shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape)) * wire.itemsize:
        raise ValueError(f"{len(data) if isinstance(data, bytes) else 'no'} bytes for shape "
                         f"{list(shape)} of {wire}")
    value = np.frombuffer(data, dtype=wire).reshape(shape)
    return value.astype(dtype) if value.dtype != dtype else value


def _dtype(text: Any) -> np.dtype:
    """The plain numeric dtype ``text`` names.

    Raises:
        ValueError: not one (a structured, subarray or object dtype, say).
    """
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in KINDS or dtype.subdtype is not None \
            or dtype.fields is not None or dtype.itemsize > 8:
        raise ValueError(f"not a numeric dtype: {str(text)[:40]!r}")
    return dtype


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, list[Any]]:
    """Each named array packed."""
    return {name: pack_array(value) for name, value in arrays.items()}


def unpack_arrays(packed: Any) -> dict[str, np.ndarray]:
    """Each named array unpacked.

    Raises:
        ValueError: not a map of packed arrays.
    """
    if not isinstance(packed, dict) or not packed:
        raise ValueError("expected a map of arrays")
    return {str(name): unpack_array(value) for name, value in packed.items()}


def encode_work(reply_to: str, number: int, feeds: Mapping[str, np.ndarray],
                enqueued_at: float, deadline: float | None, model: str | None = None) -> bytes:
    """A work entry for one request (``feeds``: its engine inputs, as its task collates them
    alone); ``enqueued_at`` and ``deadline`` in ``time.monotonic()``; ``model``: the front
    end's model fingerprint, which a worker checks against its own."""
    entry: dict[str, Any] = {"r": reply_to, "i": number, "t": to_wall(enqueued_at),
                             "f": pack_arrays(feeds)}
    if deadline is not None:
        entry["d"] = to_wall(deadline)
    if model is not None:
        entry["m"] = model
    return msgpack.packb(entry)


def decode_work(payload: bytes) -> Work:
    """The work entry in ``payload``.

    Raises:
        BadWork: its reply stream and number are readable, the rest is not (or is not engine
            inputs: arrays of one shape, ``[rows, width]``, rows at least 1).
        ValueError: not even those are readable.
    """
    try:
        entry = msgpack.unpackb(payload)
        reply_to, number = str(entry["r"]), int(entry["i"])
    except Exception as exc:  # noqa: BLE001 - whatever the bytes: not a work entry
        raise ValueError(f"not a work entry: {type(exc).__name__}: {exc}") from exc
    try:
        arrays = unpack_arrays(entry["f"])
        deadline = entry.get("d")
        work = Work(reply_to=reply_to, number=number, feeds=Feeds(arrays),
                    enqueued_at=to_monotonic(float(entry["t"])),
                    deadline=None if deadline is None else to_monotonic(float(deadline)),
                    taken_at=time.monotonic(),
                    model=None if entry.get("m") is None else str(entry["m"]))
    except Exception as exc:  # noqa: BLE001 - whatever the bytes: answered, not run
        raise BadWork(reply_to, number, f"unreadable work entry: {type(exc).__name__}: "
                      f"{str(exc)[:200]}") from exc
    if problem := feeds_problem(arrays):
        raise BadWork(reply_to, number, f"not engine inputs: {problem}")
    return work


def feeds_problem(feeds: Mapping[str, np.ndarray]) -> str | None:
    """What makes ``feeds`` something the Redis layout cannot carry as one request's engine
    inputs (arrays of one shape, ``[rows, width]``, at least one row), or None."""
    shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
    if not shapes or len(set(shapes.values())) != 1 or any(len(s) != 2 for s in shapes.values()):
        return f"inputs must be [rows, width] arrays of one shape, got {shapes}"
    if any(s[0] == 0 for s in shapes.values()):
        return "no rows"
    return None


def encode_answer(number: int, outputs: Mapping[str, np.ndarray], held_s: float) -> bytes:
    """A reply entry carrying one request's rows of the engine's outputs, and how long the
    worker held it (read to reply: its queue and engine time), so the front end can tell the
    hop's share."""
    return msgpack.packb({"i": number, "o": pack_arrays(outputs), "w": held_s})


def encode_error(number: int, code: str, message: str, held_s: float = 0.0) -> bytes:
    """A reply entry carrying a typed error."""
    return msgpack.packb({"i": number, "c": code, "x": message, "w": held_s})


@dataclass(frozen=True, slots=True)
class Reply:
    """One decoded reply entry: outputs (still packed) or a typed error."""

    number: int
    packed: Any = None
    code: str | None = None
    message: str = ""
    held_s: float = 0.0  # how long the worker held the request

    def outputs(self, rows: int) -> dict[str, np.ndarray]:
        """The engine's outputs for the request's ``rows`` rows.

        Raises:
            ValueError: unreadable, or an output without ``rows`` rows.
        """
        arrays = {name: value if value.flags.writeable else value.copy()  # a task may write
                  for name, value in unpack_arrays(self.packed).items()}  # into its outputs
        for name, value in arrays.items():
            if value.ndim == 0 or value.shape[0] != rows:
                raise ValueError(f"output {name} has shape {value.shape}, not {rows} rows")
        return arrays


def decode_reply(payload: bytes) -> Reply:
    """The reply entry in ``payload``.

    Raises:
        ValueError: not a reply entry of this format.
    """
    try:
        reply = msgpack.unpackb(payload)
        held = float(reply.get("w", 0.0))
        if "c" in reply:
            return Reply(int(reply["i"]), code=str(reply["c"]), message=str(reply["x"]),
                         held_s=held)
        return Reply(int(reply["i"]), packed=reply["o"], held_s=held)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a reply entry: {type(exc).__name__}: {exc}") from exc


def to_wall(monotonic: float) -> float:
    """A ``time.monotonic()`` instant as Unix seconds."""
    return time.time() + (monotonic - time.monotonic())


def to_monotonic(wall: float) -> float:
    """Unix seconds as a ``time.monotonic()`` instant of this process."""
    return time.monotonic() + (wall - time.time())
