"""Each API family's JSON bodies as wire requests, and its replies made from their results.

A route's shape turns a parsed body into a ``Call``: the op, the model where the body or path
names one, each wire request's fields, and how to make the reply's body once every request has
its result. Fields a shape does not know are refused by name (422), so a client never believes
a parameter took effect that did not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import BadRequest

Respond = Callable[[Sequence[dict[str, Any]]], Any]
"""Builds the reply's JSON value from every wire request's result, in order."""


@dataclass
class Call:
    """What one HTTP request asks of the models.

    Attributes:
        op: The wire op of every request it makes.
        requests: Each wire request's own fields (``id``, ``op``, ``model`` and ``timeout_ms``
            are added by the route).
        respond: The reply's body, from the results.
        model: The served model it names (None: the only one serving ``op``).
        timeout_ms: Its deadline, from its body (None: the header's, else the server's).
    """

    op: str
    requests: list[dict[str, Any]]
    respond: Respond
    model: str | None = None
    timeout_ms: float | None = None


def body_map(body: Any, what: str) -> Mapping[str, Any]:
    """The body as a JSON object, or BadRequest."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"{what}: the body must be a JSON object, got {_json_type(body)}")
    return body


def refuse_unknown(fields: Mapping[str, Any], known: Sequence[str], where: str,
                   hint: str = "") -> None:
    """BadRequest naming the first field of ``fields`` not in ``known``."""
    for name in fields:
        if name not in known:
            raise BadRequest(f"{where}: {name!r} is not supported here{hint} (supported: "
                             f"{', '.join(known) or 'none'})")


def take_texts(value: Any, name: str, limit: int) -> tuple[list[str], bool]:
    """A string or a non-empty list of strings; and whether it was one string.

    Raises:
        BadRequest: another type, an empty list, or more than ``limit`` (0: no cap) texts.
    """
    if isinstance(value, str):
        return [value], True
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"field {name!r} must be a string or a non-empty array of strings, "
                         f"got {_json_type(value)}")
    if limit and len(value) > limit:
        raise BadRequest(f"field {name!r} has {len(value)} inputs; the limit is {limit} "
                         "(max_texts)")
    return list(value), False


def optional(fields: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
             what: str) -> Any:
    """``fields[name]`` if given (None if absent or null), checked to be ``kind``."""
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise BadRequest(f"field {name!r} must be {what}, got {_json_type(value)}")
    return value


def common(fields: Mapping[str, Any]) -> tuple[str | None, float | None]:
    """Our own fields every JSON body may carry: ``model`` and ``timeout_ms``."""
    model = optional(fields, "model", str, "a string")
    timeout_ms = optional(fields, "timeout_ms", (int, float), "a number of milliseconds")
    return model, timeout_ms


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"),
                       (list, "array"), (Mapping, "object")):
        if isinstance(value, kind):
            return name
    return "null"
