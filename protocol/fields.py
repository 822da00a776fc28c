"""Checks of single wire fields, shared by the request and reply parsers: each names the field and
what it must be in its error."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from protocol.errors import BadRequest, ServerError

#: Longest client-supplied text echoed back inside an error message.
MAX_ECHO = 64


def wire_type(value: object) -> str:
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_optional_int(value: object) -> bool:
    return value is None or is_int(value)


def is_str(value: object) -> bool:
    return isinstance(value, str)


#: Longest ``timeout_ms`` accepted: one day.
MAX_TIMEOUT_MS = 86_400_000


def is_timeout(value: object) -> bool:
    """A positive number of milliseconds up to MAX_TIMEOUT_MS, or nil."""
    if value is None:
        return True
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and 0 < value <= MAX_TIMEOUT_MS  # type: ignore[operator]


def is_bool(value: object) -> bool:
    return isinstance(value, bool)


def is_map(value: object) -> bool:
    return isinstance(value, Mapping)


def take(
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
        message = f"field {label!r} must be {expected}, got {wire_type(value)}"
        raise error(message, request_id=request_id)
    return value


def take_text(obj: Mapping[Any, Any], name: str, request_id: int) -> str:
    """Return a required string field that is not empty or whitespace only."""
    value: str = take(obj, name, is_str, "a string", BadRequest, request_id)
    if not value.strip():
        raise BadRequest(f"field {name!r} must not be empty", request_id=request_id)
    return value


def echo(text: str) -> str:
    """Quote client text for an error message, cut short so a reply never balloons."""
    if len(text) > MAX_ECHO:
        text = text[:MAX_ECHO] + "..."
    return repr(text)
