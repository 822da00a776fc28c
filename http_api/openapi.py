"""The OpenAPI 3 document of the HTTP API (``GET /openapi.json``), made from the models served:
one ``/ops/{op}`` path per served op, with its fields, besides the fixed routes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from protocol.fields import MAX_TIMEOUT_MS
from protocol.qa_options import MAX_ANSWER_LEN, MAX_TOP_K

_JSON = "application/json"
_ERROR = {"$ref": "#/components/schemas/Error"}
#: A text to read: not empty or whitespace only (the server refuses those, 422).
_TEXT = {"type": "string", "pattern": "\\S"}
_TEXTS = {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]}
#: A deadline in milliseconds: above 0, up to a day (OpenAPI 3.0: a boolean exclusiveMinimum).
_MS = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": MAX_TIMEOUT_MS}
_TIMEOUT = {**_MS, "description": "its deadline in milliseconds (else X-Timeout-Ms)"}
_QA_ANSWER = {"type": "object", "required": ["answer", "score", "start", "end"],
              "properties": {"answer": {"type": "string"}, "score": {"type": "number"},
                             "start": {"type": "integer"}, "end": {"type": "integer"}}}
_LABELS = {"type": "array", "items": {"type": "object", "required": ["label", "score"],
                                      "properties": {"label": {"type": "string"},
                                                     "score": {"type": "number"}}}}
_QA_PARAMETERS = {"type": "object", "additionalProperties": False, "properties": {
    "top_k": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K},
    "max_answer_len": {"type": "integer", "minimum": 1, "maximum": MAX_ANSWER_LEN},
    "handle_impossible_answer": {"type": "boolean"}, "align_to_words": {"type": "boolean"}}}
_QA_INPUT = {"type": "object", "required": ["question", "context"], "additionalProperties": False,
             "properties": {"question": _TEXT, "context": _TEXT}}
_TENSOR = {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
    "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
    "datatype": {"type": "string"}, "data": {"type": "array"}}}
_PROBE = {"type": "object", "properties": {"status": {"type": "string"}}}


def _obj(required: Iterable[str], properties: dict[str, Any], extra: bool = False) -> dict:
    return {"type": "object", "required": list(required), "properties": properties,
            "additionalProperties": extra}


def _responses(ok: dict[str, Any] | None, content: str = _JSON, *,
               ok_status: str = "200") -> dict[str, Any]:
    out: dict[str, Any] = {"default": {"description": "a typed error (docs/http.md)",
                                       "content": {_JSON: {"schema": _ERROR}}}}
    out[ok_status] = {"description": "success"} if ok is None else \
        {"description": "success", "content": {content: {"schema": ok}}}
    return out


def _get(summary: str, ok: dict[str, Any] | None, *, open_: bool = False,
         content: str = _JSON) -> dict[str, Any]:
    op = {"summary": summary, "responses": _responses(ok, content)}
    if open_:
        op["security"] = []
    return {"get": op}


def _kserve_ready(summary: str) -> dict[str, Any]:
    """KServe's readiness: 200 with an empty body, or 503 with an empty JSON object."""
    methods = _get(summary, None, open_=True)
    methods["get"]["responses"]["503"] = {"description": "not ready", "content": {
        _JSON: {"schema": {"type": "object", "maxProperties": 0}}}}
    return methods


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "parameters": [
        {"name": "X-Timeout-Ms", "in": "header", "required": False,
         "schema": _MS}],
        "requestBody": {"required": True, "content": {_JSON: {"schema": body}}},
        "responses": _responses(ok)}}


def _infer(summary: str) -> dict[str, Any]:
    return _post(summary, _obj(["inputs"], {
        "id": {"type": "string"}, "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "items": {"type": "object"}},
        "parameters": {"type": "object"}}),
        _obj(["model_name", "outputs"], {"model_name": {"type": "string"},
                                         "outputs": {"type": "array", "items": _TENSOR}},
             extra=True))


def _one_of(names: list[str]) -> dict[str, Any]:
    """A string naming one of ``names`` (any string where there are none: then every name is
    refused alike)."""
    return {"type": "string", "enum": names} if names else {"type": "string"}


def document(models: Iterable[Any]) -> dict[str, Any]:
    """The document for these served models (each with ``name``, ``op`` and ``fields``)."""
    models = list(models)

    def served(op: str | None = None) -> dict[str, Any]:
        """A served model's name (of those serving ``op``)."""
        return _one_of([m.name for m in models if op is None or m.op == op])

    def ours(op: str) -> dict[str, Any]:
        """Our own fields every model route's body may carry."""
        return {"model": {**served(op), "description": "the served model to run it"},
                "timeout_ms": _TIMEOUT}

    def named(methods: dict[str, Any]) -> dict[str, Any]:
        for method in methods.values():
            method.setdefault("parameters", []).append(
                {"name": "name", "in": "path", "required": True, "schema": served()})
        return methods

    paths = {
        "/health": _get("ready? (an alias of /health/ready)", _PROBE, open_=True),
        "/health/ready": _get("200 when every model is loaded and serving, else 503",
                              _PROBE, open_=True),
        "/health/live": _get("200 while the process answers", _PROBE, open_=True),
        "/v2/health/live": _get("KServe v2: live", None, open_=True),
        "/v2/health/ready": _kserve_ready("KServe v2: ready"),
        "/info": _get("models, version and limits", {"type": "object"}),
        "/metrics": _get("Prometheus metrics", {"type": "string"},
                         content=CONTENT_TYPE_LATEST),  # what GET /metrics sends
        "/openapi.json": _get("this document", {"type": "object"}),
        "/v1/models": _get("OpenAI: the served models", {"type": "object"}),
        "/v2": _get("KServe v2: server metadata", {"type": "object"}),
        "/v2/models/{name}": named(_get("KServe v2: model metadata", {"type": "object"})),
        "/v2/models/{name}/ready": named(_kserve_ready("KServe v2: model ready")),
        "/v2/models/{name}/versions/1": named(_get("KServe v2: model metadata (its one "
                                                   "version)", {"type": "object"})),
        "/v2/models/{name}/versions/1/ready": named(_kserve_ready("KServe v2: model ready")),
        "/v1/models/{name}": named(_get("OpenAI: one served model", {"type": "object"})),
        "/v2/models/{name}/infer": named(_infer("KServe v2: inference with BYTES (text) "
                                                "inputs")),
        "/v2/models/{name}/versions/1/infer": named(_infer("KServe v2: inference (its one "
                                                           "version)")),
        "/qa": _post("Hugging Face question answering",
                     _obj(["inputs"], {"inputs": {"oneOf": [_QA_INPUT, {
                         "type": "array", "items": _QA_INPUT, "minItems": 1}]},
                         "parameters": _QA_PARAMETERS, **ours("qa")}),
                     {"oneOf": [_QA_ANSWER, {"type": "array"}]}),
        "/embed": _post("text-embeddings-inference: embeddings",
                        _obj(["inputs"], {"inputs": _TEXTS,
                                          # always L2-normalised; always cut at their end
                                          "normalize": {"type": "boolean", "enum": [True]},
                                          "truncate": {"type": "boolean"},
                                          "truncation_direction": {
                                              "type": "string", "enum": ["right", "Right"]},
                                          **ours("embed")}),
                        {"type": "array", "items": {"type": "array",
                                                    "items": {"type": "number"}}}),
        "/predict": _post("text-embeddings-inference: classification, highest first",
                          _obj(["inputs"], {"inputs": _TEXTS,  # softmax probabilities only
                                            "raw_scores": {"type": "boolean", "enum": [False]},
                                            "truncate": {"type": "boolean"},
                                            **ours("classify")}),
                          {"oneOf": [_LABELS, {"type": "array", "items": _LABELS}]}),
        "/v1/embeddings": _post("OpenAI: embeddings", _obj(["input", "model"], {
            "input": _TEXTS, "model": served("embed"),
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "user": {"type": "string"}, "timeout_ms": _TIMEOUT}),
            _obj(["object", "data", "model", "usage"], {
                "object": {"type": "string"}, "data": {"type": "array"},
                "model": {"type": "string"}, "usage": {"type": "object"}})),
        "/": _post("Hugging Face Inference API shapes, told apart by the body",
                   {"type": "object", "required": ["inputs"]}, {}),
        "/models/{name}": named(_post("Hugging Face shape of the model's task",
                                      {"type": "object", "required": ["inputs"]}, {})),
    }
    for op, fields in sorted({m.op: m.fields for m in models}.items()):
        properties = {name: _field_schema(kind) for name, kind in fields.items()}
        paths[f"/ops/{op}"] = _post(f"the {op!r} op: the TCP request's fields and result",
                                    _obj(fields, {**properties, **ours(op)}, extra=True),
                                    {"type": "object"})
    return {"openapi": "3.0.3",
            "info": {"title": "qa-inference-server HTTP API", "version": "0.1.0",
                     "description": "docs/http.md"},
            "paths": paths,
            "components": {"schemas": {"Error": _obj(["error", "error_type"], {
                "error": {"type": "string"}, "error_type": {"type": "string"}}, extra=True)},
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"bearer": []}]}


def _field_schema(kind: str) -> dict[str, Any]:
    if kind.startswith("array"):
        return {"type": "array", "items": {"type": "string"}}
    return {"type": "string"} if kind == "string" else {}
