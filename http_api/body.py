"""Reading one request's JSON body: the content type, the payload limit (413 before the body is
read whole, from ``Content-Length`` at once or as a chunked body passes it), the time the body
may take to arrive (``--frame_timeout``, 408), and the JSON itself (400 where it is not)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from http_api.errors import HttpError, MalformedBody
from protocol.errors import FrameTimeout, FrameTooLarge

Receive = Callable[[], Awaitable[dict[str, Any]]]

#: Content types read as JSON (a missing one is too: some clients send none).
JSON_TYPES = ("application/json", "text/json")


class ClientGone(Exception):
    """The client disconnected before its body arrived: nothing is answered."""


def check_content_type(headers: Mapping[str, str]) -> None:
    """Refuse a body that says it is not JSON (415).

    Raises:
        HttpError: ``unsupported_media_type``.
    """
    declared = headers.get("content-type")
    if declared is None:
        return
    kind = declared.split(";", 1)[0].strip().lower()
    if kind not in JSON_TYPES and not kind.endswith("+json"):
        raise HttpError("unsupported_media_type",
                        f"the body must be JSON (Content-Type: application/json), not {kind!r}; "
                        "with curl, --json or -H 'Content-Type: application/json'")


async def read_body(receive: Receive, headers: Mapping[str, str], limit: int,
                    began: float, timeout_s: float) -> bytes:
    """The whole body, refused at ``limit`` bytes and after ``timeout_s`` from ``began``
    (``time.monotonic()`` when the request began; 0: no time limit).

    Raises:
        FrameTooLarge: over the limit (413), said before the rest is read.
        FrameTimeout: not all there in time (408).
        ClientGone: the client disconnected.
    """
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await _next(receive, began, timeout_s)
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _next(receive: Receive, began: float, timeout_s: float) -> dict[str, Any]:
    if timeout_s <= 0:
        return await receive()
    left = began + timeout_s - time.monotonic()
    try:
        return await asyncio.wait_for(receive(), max(0.0, left))
    except asyncio.TimeoutError:
        raise FrameTimeout(f"the request's body did not arrive within {timeout_s:g} s "
                           "(frame_timeout)") from None


def _too_large(size: int, limit: int) -> FrameTooLarge:
    return FrameTooLarge(f"the body has {size} bytes or more; the limit is {limit} "
                         "(http_payload_limit)")


def parse_json(body: bytes) -> Any:
    """The body's JSON value.

    Raises:
        MalformedBody: not UTF-8, not JSON, truncated, or nested too deep (400).
    """
    if not body.strip():
        raise MalformedBody("the body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"the body is not valid JSON: {exc}") from None
