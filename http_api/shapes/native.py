"""Our own shape, one route per served op (``POST /ops/{op}``): the body is the TCP request's
map without ``id`` and ``op`` (docs/protocol.md), and the reply's body is its ``result`` map."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from http_api.shapes import Call, body_map, common


def native_call(op: str, body: Any) -> Call:
    """One request of ``op`` with the body's fields."""
    fields = dict(body_map(body, f"/ops/{op}"))
    model, timeout_ms = common(fields)
    for name in ("id", "op", "model", "timeout_ms"):
        fields.pop(name, None)
    return Call(op=op, requests=[fields], respond=_first, model=model, timeout_ms=timeout_ms)


def _first(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return results[0]
