"""Request and reply shapes: validation of wire maps and builders for them.

The server turns each decoded map into a typed request with :func:`parse_request` and answers with
:func:`ok_reply` or :func:`error_reply`. The client builds requests with :func:`qa_request` /
:func:`ping_request` and reads answers with :func:`parse_reply`.

Ops live in :data:`REQUEST_PARSERS`, a table from op name to parser; adding an op is one parser
function, one dataclass and one entry in that table.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

from protocol.errors import BadRequest, ProtocolError, ServerError, error_for_code
from protocol.fields import (
    MAX_TIMEOUT_MS,
    echo,
    is_bool,
    is_int,
    is_map,
    is_optional_int,
    is_str,
    is_timeout,
    take,
    take_text,
    wire_type,
)
from protocol.qa_options import QAOptions, parse_qa_options

__all__ = [
    "REQUEST_PARSERS",
    "AuthRequest",
    "ClassifyRequest",
    "EmbedRequest",
    "ModelRequest",
    "ModelsRequest",
    "PingRequest",
    "QARequest",
    "TaskRequest",
    "StatsRequest",
    "Reply",
    "Request",
    "error_reply",
    "ok_reply",
    "op_name",
    "parse_reply",
    "parse_request",
    "auth_request",
    "classify_request",
    "embed_request",
    "known_ops",
    "model_request",
    "models_request",
    "ping_request",
    "qa_request",
    "stats_request",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class QARequest:
    """Extractive question answering: find the span of ``context`` that answers ``question``."""

    op: ClassVar[str] = "qa"
    id: int
    question: str
    context: str
    timeout_ms: float | None = None  # None: the server's default deadline
    model: str | None = None  # None: the server's only (or default) model
    options: QAOptions | None = None  # how answers are chosen (None: the server's settings)


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbedRequest:
    """Sentence embeddings: one L2-normalised vector per text."""

    op: ClassVar[str] = "embed"
    id: int
    texts: tuple[str, ...]
    timeout_ms: float | None = None
    model: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassifyRequest:
    """Sequence classification: the label of one text, with every label's probability."""

    op: ClassVar[str] = "classify"
    id: int
    text: str
    timeout_ms: float | None = None
    model: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskRequest:
    """A request for an op no built-in task has (a plug-in task's, docs/tasks.md): its fields
    are checked by the task that serves ``op``."""

    op: str  # type: ignore[misc]
    id: int
    fields: dict[str, Any]
    timeout_ms: float | None = None
    model: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PingRequest:
    """Liveness check; the server answers ``{"pong": True, ...}``."""

    op: ClassVar[str] = "ping"
    id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelsRequest:
    """The models served: name, task, op, inputs, and whether their outputs mean anything."""

    op: ClassVar[str] = "models"
    id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsRequest:
    """The server's counters, timings and configuration; see docs/metrics.md."""

    op: ClassVar[str] = "stats"
    id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class AuthRequest:
    """Authentication: the first request of a connection to a server that requires a token
    (``--auth_token_file``); the server answers ``{"authenticated": True, ...}`` or closes."""

    op: ClassVar[str] = "auth"
    id: int
    token: str = field(repr=False)  # a secret: never in a repr, a log line or an error message


ModelRequest: TypeAlias = QARequest | EmbedRequest | ClassifyRequest | TaskRequest
"""A request that runs a model (it is admitted, queued and batched)."""
Request: TypeAlias = ModelRequest | PingRequest | StatsRequest | ModelsRequest | AuthRequest


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


# --------------------------------------------------------------------------- requests


def _common(obj: Mapping[Any, Any], request_id: int) -> dict[str, Any]:
    """The fields every model request may carry: ``timeout_ms`` and ``model``."""
    out: dict[str, Any] = {"id": request_id, "timeout_ms": None, "model": None}
    if obj.get("timeout_ms") is not None:
        out["timeout_ms"] = take(obj, "timeout_ms", is_timeout,
                                 f"a positive number of milliseconds up to {MAX_TIMEOUT_MS}",
                                 BadRequest, request_id)
    if obj.get("model") is not None:
        out["model"] = take(obj, "model", is_str, "a string", BadRequest, request_id)
    return out


def _parse_qa(obj: Mapping[Any, Any], request_id: int) -> QARequest:
    question = take_text(obj, "question", request_id)
    context = take_text(obj, "context", request_id)
    return QARequest(question=question, context=context,
                     options=parse_qa_options(obj, request_id), **_common(obj, request_id))


def _is_texts(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(item, str) and item.strip() for item in value)


def _parse_embed(obj: Mapping[Any, Any], request_id: int) -> EmbedRequest:
    texts = take(obj, "texts", _is_texts, "a non-empty array of non-empty strings", BadRequest,
                 request_id)
    return EmbedRequest(texts=tuple(texts), **_common(obj, request_id))


def _parse_classify(obj: Mapping[Any, Any], request_id: int) -> ClassifyRequest:
    return ClassifyRequest(text=take_text(obj, "text", request_id), **_common(obj, request_id))


def _parse_task(obj: Mapping[Any, Any], request_id: int, op: str) -> TaskRequest:
    common = _common(obj, request_id)
    fields = {k: v for k, v in obj.items()
              if isinstance(k, str) and k not in ("id", "op", "timeout_ms", "model")}
    return TaskRequest(op=op, fields=fields, **common)


def _parse_ping(obj: Mapping[Any, Any], request_id: int) -> PingRequest:
    return PingRequest(id=request_id)


def _parse_stats(obj: Mapping[Any, Any], request_id: int) -> StatsRequest:
    return StatsRequest(id=request_id)


def _parse_models(obj: Mapping[Any, Any], request_id: int) -> ModelsRequest:
    return ModelsRequest(id=request_id)


def _parse_auth(obj: Mapping[Any, Any], request_id: int) -> AuthRequest:
    return AuthRequest(id=request_id, token=take(obj, "token", is_str, "a string", BadRequest,
                                                 request_id))


RequestParser: TypeAlias = Callable[[Mapping[Any, Any], int], Request]

REQUEST_PARSERS: dict[str, RequestParser] = {
    QARequest.op: _parse_qa,
    EmbedRequest.op: _parse_embed,
    ClassifyRequest.op: _parse_classify,
    PingRequest.op: _parse_ping,
    StatsRequest.op: _parse_stats,
    ModelsRequest.op: _parse_models,
    AuthRequest.op: _parse_auth,
}
"""Op name -> parser taking the request map and its already validated ``id``."""


def parse_request(obj: object, task_ops: Collection[str] = ()) -> Request:
    """Validate one decoded request map and build its typed request.

    Fields this version does not know, and keys that are not strings, are ignored.

    Args:
        obj: The map decoded from a frame.
        task_ops: The ops of the plug-in tasks served (docs/tasks.md), parsed as
            :class:`TaskRequest`; any other op not built in is unknown.

    Returns:
        The typed request of its op.

    Raises:
        BadRequest: not a map, a missing or wrongly typed field, an unknown op, or an empty
            question or context. ``request_id`` is set whenever ``id`` itself was a valid int.
    """
    if not isinstance(obj, Mapping):
        raise BadRequest(f"a request must be a map, got {wire_type(obj)}")
    request_id: int = take(obj, "id", is_int, "an int", BadRequest, None)
    op: str = take(obj, "op", is_str, "a string", BadRequest, request_id)
    parser = REQUEST_PARSERS.get(op)
    if parser is not None:
        return parser(obj, request_id)
    if op in task_ops:
        return _parse_task(obj, request_id, op)
    raise BadRequest(f"unknown op {echo(op)} (known: {known_ops(task_ops)})",
                     request_id=request_id)


def known_ops(extra: Collection[str] = ()) -> str:
    """The built-in ops and ``extra`` (served plug-in ops), for an "unknown op" message."""
    return ", ".join(sorted({*REQUEST_PARSERS, *extra}))


def op_name(message: object, task_ops: Collection[str] = ()) -> str:
    """A decoded request's op for counting: a known op's name, else "invalid"."""
    op = message.get("op") if isinstance(message, Mapping) else None
    known = isinstance(op, str) and (op in REQUEST_PARSERS or op in task_ops)
    return op if known else "invalid"  # type: ignore[return-value]


def model_request(request_id: int, op: str, fields: Mapping[str, Any],
                  timeout_ms: float | None = None, model: str | None = None) -> dict[str, Any]:
    """Build the wire map of a request of ``op`` with ``fields`` (``timeout_ms``: its deadline,
    from admission; ``model``: which model serves it, None for the default)."""
    message: dict[str, Any] = {"id": request_id, "op": op, **fields}
    if timeout_ms is not None:
        message["timeout_ms"] = timeout_ms
    if model is not None:
        message["model"] = model
    return message


def qa_request(request_id: int, question: str, context: str,
               timeout_ms: float | None = None, model: str | None = None) -> dict[str, Any]:
    """Build the wire map of a ``qa`` request."""
    return model_request(request_id, QARequest.op, {"question": question, "context": context},
                         timeout_ms, model)


def embed_request(request_id: int, texts: list[str], timeout_ms: float | None = None,
                  model: str | None = None) -> dict[str, Any]:
    """Build the wire map of an ``embed`` request."""
    return model_request(request_id, EmbedRequest.op, {"texts": list(texts)}, timeout_ms, model)


def classify_request(request_id: int, text: str, timeout_ms: float | None = None,
                     model: str | None = None) -> dict[str, Any]:
    """Build the wire map of a ``classify`` request."""
    return model_request(request_id, ClassifyRequest.op, {"text": text}, timeout_ms, model)


def models_request(request_id: int) -> dict[str, Any]:
    """Build the wire map of a ``models`` request."""
    return {"id": request_id, "op": ModelsRequest.op}


def auth_request(request_id: int, token: str) -> dict[str, Any]:
    """Build the wire map of an ``auth`` request."""
    return {"id": request_id, "op": AuthRequest.op, "token": token}


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
        raise ProtocolError(f"a reply must be a map, got {wire_type(obj)}")
    reply_id: int | None = take(obj, "id", is_optional_int, "an int or nil", ProtocolError, None)
    ok: bool = take(obj, "ok", is_bool, "a bool", ProtocolError, reply_id)
    if ok:
        result = take(obj, "result", is_map, "a map", ProtocolError, reply_id)
        return Reply(id=reply_id, ok=True, result=dict(result), error=None)
    body = take(obj, "error", is_map, "a map", ProtocolError, reply_id)
    code: str = take(body, "code", is_str, "a string", ProtocolError, reply_id, "error.")
    message: str = take(body, "message", is_str, "a string", ProtocolError, reply_id, "error.")
    error = error_for_code(code, message, request_id=reply_id)
    return Reply(id=reply_id, ok=False, result=None, error=error)
