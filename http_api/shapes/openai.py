"""OpenAI's embeddings API (``POST /v1/embeddings``, ``GET /v1/models``), as the OpenAI SDK
calls it: ``input`` a string or a list of them, ``encoding_format`` float or base64
(little-endian float32, which the SDK asks for by default)."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from http_api.shapes import Call, body_map, optional, refuse_unknown, take_texts
from protocol.errors import BadRequest


def embeddings_call(body: Any, limit: int) -> Call:
    """One embed request of every input; ``model`` names the served model (required, as in
    OpenAI's API)."""
    fields = body_map(body, "/v1/embeddings")
    refuse_unknown(fields, ("input", "model", "encoding_format", "user", "timeout_ms"),
                   "/v1/embeddings")
    model = optional(fields, "model", str, "a string")
    if model is None:
        raise BadRequest("missing field 'model': name a served embed model (GET /v1/models)")
    encoding = optional(fields, "encoding_format", str, "'float' or 'base64'") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest(f"'encoding_format' must be 'float' or 'base64', not {encoding!r}")
    value = fields.get("input")
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        raise BadRequest("field 'input' must be a string or an array of strings: token arrays "
                         "are not supported")
    texts, _ = take_texts(value, "input", limit)
    timeout_ms = optional(fields, "timeout_ms", (int, float), "a number of milliseconds")

    def respond(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
        result = results[0]
        data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, encoding)}
                for i, vector in enumerate(result["embeddings"])]
        tokens = int(result.get("tokens", 0))
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return Call(op="embed", requests=[{"texts": texts}], respond=respond, model=model,
                timeout_ms=timeout_ms)


def _encoded(vector: list[float], encoding: str) -> Any:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def model_list(names: Iterable[str], created: int) -> dict[str, Any]:
    """``GET /v1/models``: every served model."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "qa-server"} for name in names]}
