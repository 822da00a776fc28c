"""What travels through Redis: one work entry per request, one reply entry per answer.

A work entry (field ``m`` of an entry of the work stream) is a msgpack map:

    r  the front end's reply stream            i  the request's number at that front end
    t  admitted at, Unix seconds               d  deadline, Unix seconds (absent: none)
    p  padding id   n  padded length           l  real tokens per row
    ids  int32 token ids, rows x max_len       tt  uint8 segment ids, same shape
    m  the front end's model fingerprint (engines.model_dir.model_fingerprint; absent: none)

A reply entry (field ``m`` of the front end's reply stream) is ``{"i": number, "s": start
logits, "e": end logits}`` (float32, rows x max_len) or ``{"i": number, "c": error code,
"x": message}``, either with ``"w"``: seconds the worker held the request.

Times are wall-clock seconds because front ends and workers may be on different machines
(their clocks are assumed to agree to within a small part of a deadline, as NTP keeps them);
each side turns them into its own ``time.monotonic()`` at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from engines.model_dir import ModelInfo
from tasks.qa import QATask
from tasks.rows import EngineRows, TokenRows

#: The one field of every entry.
FIELD = b"m"


@dataclass(frozen=True, slots=True)
class Work:
    """One decoded work entry."""

    reply_to: str
    number: int
    rows: EngineRows
    enqueued_at: float  # time.monotonic() of this process
    deadline: float | None  # time.monotonic() of this process
    taken_at: float  # time.monotonic() when this process read it
    model: str | None = None  # the front end's model_fingerprint (None: it sent none)


def require_qa(info: ModelInfo) -> None:
    """Work and replies carry QA rows and logits: a front end or worker serves qa models only.

    Raises:
        RuntimeError: ``info`` is a model of another task.
    """
    if info.task != QATask.name:
        raise RuntimeError(f"--broker serves qa models only; this one's task is {info.task!r} "
                           "(serve it without --broker)")


def encode_work(reply_to: str, number: int, rows: TokenRows, pad_id: int, padded_length: int,
                enqueued_at: float, deadline: float | None, model: str | None = None) -> bytes:
    """A work entry for one request; ``enqueued_at`` and ``deadline`` in ``time.monotonic()``;
    ``model``: the front end's model fingerprint, which a worker checks against its own."""
    ids = np.ascontiguousarray(rows.input_ids, dtype=np.int32)
    entry: dict[str, Any] = {
        "r": reply_to, "i": number, "t": to_wall(enqueued_at), "p": pad_id, "n": padded_length,
        "l": rows.lengths.tolist(), "ids": ids.tobytes(),
        "tt": np.ascontiguousarray(rows.token_type_ids, dtype=np.uint8).tobytes()}
    if deadline is not None:
        entry["d"] = to_wall(deadline)
    if model is not None:
        entry["m"] = model
    return msgpack.packb(entry)


def decode_work(payload: bytes) -> Work:
    """The work entry in ``payload``.

    Raises:
        ValueError: not a work entry of this format (the message says what is wrong).
    """
    try:
        entry = msgpack.unpackb(payload)
        lengths = np.asarray(entry["l"], dtype=np.int64)
        rows = len(lengths)
        ids = np.frombuffer(entry["ids"], dtype=np.int32).reshape(rows, -1)
        types = np.frombuffer(entry["tt"], dtype=np.uint8).reshape(rows, -1)
        number, reply_to = int(entry["i"]), str(entry["r"])
        deadline = entry.get("d")
        work = Work(reply_to=reply_to, number=number,
                    rows=EngineRows(input_ids=ids, token_type_ids=types, lengths=lengths,
                                    pad_id=int(entry["p"]), padded_length=int(entry["n"])),
                    enqueued_at=to_monotonic(float(entry["t"])),
                    deadline=None if deadline is None else to_monotonic(float(deadline)),
                    taken_at=time.monotonic(),
                    model=None if entry.get("m") is None else str(entry["m"]))
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a work entry: {type(exc).__name__}: {exc}") from exc
    if rows == 0 or ids.shape != types.shape or work.rows.padded_length < ids.shape[1] \
            or lengths.max() > ids.shape[1]:
        raise ValueError(f"inconsistent work entry: {rows} rows, ids {ids.shape}, types "
                         f"{types.shape}, padded to {work.rows.padded_length}")
    return work


def encode_answer(number: int, start: np.ndarray, end: np.ndarray, held_s: float) -> bytes:
    """A reply entry carrying one request's start and end logits, and how long the worker held
    it (read to reply: its queue and engine time), so the front end can tell the hop's share."""
    return msgpack.packb({"i": number, "s": _float_rows(start), "e": _float_rows(end),
                          "w": held_s})


def encode_error(number: int, code: str, message: str, held_s: float = 0.0) -> bytes:
    """A reply entry carrying a typed error."""
    return msgpack.packb({"i": number, "c": code, "x": message, "w": held_s})


@dataclass(frozen=True, slots=True)
class Reply:
    """One decoded reply entry: logits (still bytes) or a typed error."""

    number: int
    start: bytes = b""
    end: bytes = b""
    code: str | None = None
    message: str = ""
    held_s: float = 0.0  # how long the worker held the request

    def logits(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The start and end logits as ``[rows, length]`` float32 arrays.

        Raises:
            ValueError: they do not have ``rows`` rows of one length.
        """
        start = np.frombuffer(self.start, dtype=np.float32).reshape(rows, -1)
        return start, np.frombuffer(self.end, dtype=np.float32).reshape(rows, -1)


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
        return Reply(int(reply["i"]), start=reply["s"], end=reply["e"], held_s=held)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a reply entry: {type(exc).__name__}: {exc}") from exc


def _float_rows(logits: np.ndarray) -> bytes:
    return np.ascontiguousarray(logits, dtype=np.float32).tobytes()


def to_wall(monotonic: float) -> float:
    """A ``time.monotonic()`` instant as Unix seconds."""
    return time.time() + (monotonic - time.monotonic())


def to_monotonic(wall: float) -> float:
    """Unix seconds as a ``time.monotonic()`` instant of this process."""
    return time.monotonic() + (wall - time.time())
