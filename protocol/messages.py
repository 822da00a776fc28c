"""Request and reply shapes: validation of wire maps and builders for them.

The server turns each decoded map into a typed request with :func:`parse_request` and answers with
:func:`ok_reply` or :func:`error_reply`. The client builds requests with :func:`qa_request` /
:func:`ping_request` and reads answers with :func:`parse_reply`.

Ops live in :data:`REQUEST_PARSERS`, a table from op name to parser; adding an op is one parser
function, one dataclass and one entry in that table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from protocol.errors import BadRequest, ProtocolError, ServerError, error_for_code

__all__ = [
    "REQUEST_PARSERS",
    "FieldLimits",
    "PingRequest",
    "QARequest",
    "StatsRequest",
    "Reply",
    "Request",
    "error_reply",
    "ok_reply",
    "op_name",
    "parse_reply",
    "parse_request",
    "ping_request",
    "qa_request",
    "stats_request",
]

_MAX_ECHO = 64  # longest client-supplied text echoed back inside an error message


@dataclass(frozen=True, kw_only=True, slots=True)
class QARequest:
    """Extractive question answering: find the span of ``context`` that answers ``question``."""

    op: ClassVar[str] = "qa"
    id: int
    question: str
    context: str
    timeout_ms: float | None = None  # None: the server's default deadline


@dataclass(frozen=True, kw_only=True, slots=True)
class PingRequest:
    """Liveness check; the server answers ``{"pong": True, ...}``."""

    op: ClassVar[str] = "ping"
    id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsRequest:
    """The server's counters, timings and configuration; see docs/metrics.md."""

    op: ClassVar[str] = "stats"
    id: int


Request: TypeAlias = QARequest | PingRequest | StatsRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    """One decoded reply, as the client sees it.

    Exactly one of ``result`` (when ``ok``) and ``error`` (when not) is set. ``id`` is ``None`` only
    for errors that could not be matched to a request (fatal framing errors, unreadable ids).
    """

    id: int | None
    ok: bool
    result: dict[str, Any] | None
    error: ServerError | None

    def unwrap(self) -> dict[str, Any]:
        """Return ``result``, or raise ``error`` when the reply is an error.

        Raises:
            ServerError: the subclass matching the reply's error code.
        """
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


# --------------------------------------------------------------------------- field checks


def _wire_type(value: object) -> str:
    """Name a value by its msgpack type, for error messages."""
    if value is None:
        return "nil"
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if isinstance(value, kind):
            return name
    for kind, name in ((bytes, "bin"), (list, "array"), (tuple, "array"), (Mapping, "map")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_optional_int(value: object) -> bool:
    return value is None or _is_int(value)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


#: Longest ``timeout_ms`` accepted: one day.
MAX_TIMEOUT_MS = 86_400_000


def _is_timeout(value: object) -> bool:
    """A positive number of milliseconds up to MAX_TIMEOUT_MS, or nil."""
    if value is None:
        return True
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and 0 < value <= MAX_TIMEOUT_MS  # type: ignore[operator]


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_map(value: object) -> bool:
    return isinstance(value, Mapping)


def _take(
    obj: Mapping[Any, Any],
    name: str,
    check: Callable[[object], bool],
    expected: str,
    error: type[ServerError],
    request_id: int | None,
    prefix: str = "",
) -> Any:
    """Return ``obj[name]`` after checking it, or raise ``error`` naming the field."""
    label = f"{prefix}{name}"
    if name not in obj:
        raise error(f"missing field {label!r}", request_id=request_id)
    value = obj[name]
    if not check(value):
        message = f"field {label!r} must be {expected}, got {_wire_type(value)}"
        raise error(message, request_id=request_id)
    return value


def _text(obj: Mapping[Any, Any], name: str, request_id: int) -> str:
    """Return a required string field that is not empty or whitespace only."""
    value: str = _take(obj, name, _is_str, "a string", BadRequest, request_id)
    if not value.strip():
        raise BadRequest(f"field {name!r} must not be empty", request_id=request_id)
    return value


def _echo(text: str) -> str:
    """Quote client text for an error message, cut short so a reply never balloons."""
    if len(text) > _MAX_ECHO:
        text = text[:_MAX_ECHO] + "..."
    return repr(text)


# --------------------------------------------------------------------------- requests


def _parse_qa(obj: Mapping[Any, Any], request_id: int) -> QARequest:
    question = _text(obj, "question", request_id)
    context = _text(obj, "context", request_id)
    timeout_ms = None
    if obj.get("timeout_ms") is not None:
        timeout_ms = _take(obj, "timeout_ms", _is_timeout,
                           f"a positive number of milliseconds up to {MAX_TIMEOUT_MS}",
                           BadRequest, request_id)
    return QARequest(id=request_id, question=question, context=context, timeout_ms=timeout_ms)


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldLimits:
    """Caps on a ``qa`` request's text, in characters (Unicode code points); 0 means no cap.

    The names are the server options that set them, and the error message names the option.
    """

    max_question_chars: int = 1_000
    max_context_chars: int = 100_000

    def check(self, request: QARequest) -> None:
        """Raise BadRequest naming the limit if ``request`` has a field over its cap."""
        for name, text, option in (("question", request.question, "max_question_chars"),
                                   ("context", request.context, "max_context_chars")):
            limit = getattr(self, option)
            if limit and len(text) > limit:
                raise BadRequest(f"field {name!r} has {len(text)} characters; the limit is "
                                 f"{limit} ({option})", request_id=request.id)


def _parse_ping(obj: Mapping[Any, Any], request_id: int) -> PingRequest:
    return PingRequest(id=request_id)


def _parse_stats(obj: Mapping[Any, Any], request_id: int) -> StatsRequest:
    return StatsRequest(id=request_id)


RequestParser: TypeAlias = Callable[[Mapping[Any, Any], int], Request]

REQUEST_PARSERS: dict[str, RequestParser] = {
    QARequest.op: _parse_qa,
    PingRequest.op: _parse_ping,
    StatsRequest.op: _parse_stats,
}
"""Op name -> parser taking the request map and its already validated ``id``."""


def parse_request(obj: object) -> Request:
    """Validate one decoded request map and build its typed request.

    Fields this version does not know, and keys that are not strings, are ignored.

    Args:
        obj: The map decoded from a frame.

    Returns:
        A :class:`QARequest`, :class:`PingRequest` or :class:`StatsRequest`.

    Raises:
        BadRequest: not a map, a missing or wrongly typed field, an unknown op, or an empty
            question or context. ``request_id`` is set whenever ``id`` itself was a valid int.
    """
    if not isinstance(obj, Mapping):
        raise BadRequest(f"a request must be a map, got {_wire_type(obj)}")
    request_id: int = _take(obj, "id", _is_int, "an int", BadRequest, None)
    op: str = _take(obj, "op", _is_str, "a string", BadRequest, request_id)
    parser = REQUEST_PARSERS.get(op)
    if parser is None:
        known = ", ".join(sorted(REQUEST_PARSERS))
        raise BadRequest(f"unknown op {_echo(op)} (known: {known})", request_id=request_id)
    return parser(obj, request_id)


def op_name(message: object) -> str:
    """A decoded request's op for counting: a known op's name, else "invalid"."""
    op = message.get("op") if isinstance(message, Mapping) else None
    return op if isinstance(op, str) and op in REQUEST_PARSERS else "invalid"


def qa_request(request_id: int, question: str, context: str,
               timeout_ms: float | None = None) -> dict[str, Any]:
    """Build the wire map of a ``qa`` request (``timeout_ms``: its deadline, from admission)."""
    message: dict[str, Any] = {"id": request_id, "op": QARequest.op, "question": question,
                               "context": context}
    if timeout_ms is not None:
        message["timeout_ms"] = timeout_ms
    return message


def ping_request(request_id: int) -> dict[str, Any]:
    """Build the wire map of a ``ping`` request."""
    return {"id": request_id, "op": PingRequest.op}


def stats_request(request_id: int) -> dict[str, Any]:
    """Build the wire map of a ``stats`` request."""
    return {"id": request_id, "op": StatsRequest.op}


# --------------------------------------------------------------------------- replies


def ok_reply(request_id: int | None, result: Mapping[str, Any]) -> dict[str, Any]:
    """Build the wire map of a successful reply: ``{"id", "ok": True, "result"}``."""
    return {"id": request_id, "ok": True, "result": dict(result)}


def error_reply(request_id: int | None, error: ServerError) -> dict[str, Any]:
    """Build the wire map of an error reply: ``{"id", "ok": False, "error": {"code", "message"}}``.

    Args:
        request_id: The id being answered, or ``None`` when it is unknown (framing errors).
        error: The error; its class gives ``code`` and its ``message`` is sent as is.
    """
    return {
        "id": request_id,
        "ok": False,
        "error": {"code": error.code, "message": error.message},
    }


def parse_reply(obj: object) -> Reply:
    """Validate one decoded reply map (client side).

    Unknown fields are ignored. An unknown error code becomes
    :class:`~protocol.errors.UnknownServerError`, which keeps the code and message.

    Args:
        obj: The map decoded from a frame.

    Returns:
        The reply, with ``error`` built by :func:`protocol.errors.error_for_code`.

    Raises:
        ProtocolError: not a map, or ``id``, ``ok``, ``result`` or ``error`` is missing or of the
            wrong type.
    """
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"a reply must be a map, got {_wire_type(obj)}")
    reply_id: int | None = _take(obj, "id", _is_optional_int, "an int or nil", ProtocolError, None)
    ok: bool = _take(obj, "ok", _is_bool, "a bool", ProtocolError, reply_id)
    if ok:
        result = _take(obj, "result", _is_map, "a map", ProtocolError, reply_id)
        return Reply(id=reply_id, ok=True, result=dict(result), error=None)
    body = _take(obj, "error", _is_map, "a map", ProtocolError, reply_id)
    code: str = _take(body, "code", _is_str, "a string", ProtocolError, reply_id, "error.")
    message: str = _take(body, "message", _is_str, "a string", ProtocolError, reply_id, "error.")
    error = error_for_code(code, message, request_id=reply_id)
    return Reply(id=reply_id, ok=False, result=None, error=error)
