"""KServe's Open Inference Protocol (v2), as Triton and its clients speak it: model metadata,
and ``POST /v2/models/{m}/infer`` with text as BYTES tensors, sent as JSON (the binary tensor
data extension is not implemented, so ``/v2`` lists no extension; ``binary_data_output`` is
answered with JSON data, which tritonclient reads as well).

Inputs by task: qa ``question`` and ``context``, embed and classify ``text``, each of shape
``[N]`` or ``[N, 1]``. Outputs: qa ``answer`` (BYTES), ``score`` (FP32), ``start`` and ``end``
(INT64); embed ``embedding`` (FP32 ``[N, dim]``); classify ``label`` (BYTES), ``score`` (FP32)
and ``scores`` (FP32 ``[N, labels]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from http_api.shapes import Call, body_map, optional, refuse_unknown
from protocol.errors import BadRequest

#: Each built-in task's inputs, and its outputs as (name, datatype, shape after the batch).
TENSORS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str, list[int]], ...]]] = {
    "qa": (("question", "context"), (("answer", "BYTES", []), ("score", "FP32", []),
                                     ("start", "INT64", []), ("end", "INT64", []))),
    "embed": (("text",), (("embedding", "FP32", [-1]),)),
    "classify": (("text",), (("label", "BYTES", []), ("score", "FP32", []),
                             ("scores", "FP32", [-1]))),
}
#: Request parameters read (``timeout``: microseconds, Triton's) or answered anyway.
PARAMETERS = ("timeout", "binary_data_output")


def metadata(name: str, op: str, platform: str, labels: Sequence[str] | None) -> dict[str, Any]:
    """``GET /v2/models/{m}``: its inputs and outputs as tensors."""
    inputs, outputs = TENSORS[op]
    out = {"name": name, "versions": ["1"], "platform": platform,
           "inputs": [{"name": n, "datatype": "BYTES", "shape": [-1]} for n in inputs],
           "outputs": [{"name": n, "datatype": kind, "shape": [-1, *shape]}
                       for n, kind, shape in outputs]}
    if labels:
        out["parameters"] = {"labels": ",".join(labels)}
    return out


def check_tensor_form(name: str, op: str) -> None:
    """Refuse a model whose task has no tensor form here (a plug-in's).

    Raises:
        BadRequest: naming the route that serves it.
    """
    if op not in TENSORS:
        raise BadRequest(f"model {name!r} serves {op!r} requests, which have no tensor form "
                         f"here; use POST /ops/{op}")


def infer_call(name: str, op: str, body: Any, limit: int) -> Call:
    """One wire request per element of the batch."""
    check_tensor_form(name, op)
    fields = body_map(body, "infer")
    refuse_unknown(fields, ("id", "inputs", "outputs", "parameters"), "infer")
    parameters = optional(fields, "parameters", Mapping, "an object") or {}
    refuse_unknown(parameters, PARAMETERS, "infer parameters")
    timeout_us = optional(parameters, "timeout", (int, float), "microseconds")
    if timeout_us is not None and timeout_us < 0:
        raise BadRequest("parameter 'timeout' must be microseconds, 0 or more (0: none)")
    names, outputs = TENSORS[op]
    columns = _inputs(fields.get("inputs"), names, limit)
    wanted = _requested(fields.get("outputs"), [o[0] for o in outputs])
    if op == "qa":
        requests = [{"question": q, "context": c}
                    for q, c in zip(columns["question"], columns["context"])]
    else:
        requests = [{"texts": [t]} if op == "embed" else {"text": t} for t in columns["text"]]

    def respond(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
        tensors = [_tensor(out_name, kind, op, results)
                   for out_name, kind, _ in outputs if out_name in wanted]
        reply: dict[str, Any] = {"model_name": name, "model_version": "1", "outputs": tensors}
        if isinstance(fields.get("id"), str):
            reply["id"] = fields["id"]
        return reply

    return Call(op=op, requests=requests, respond=respond, model=name,
                timeout_ms=timeout_us / 1000 if timeout_us else None)  # 0: none, as Triton


def _inputs(value: Any, names: Sequence[str], limit: int) -> dict[str, list[str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("field 'inputs' must be a non-empty array of tensors")
    columns: dict[str, list[str]] = {}
    for tensor in value:
        tensor = body_map(tensor, "an input tensor")
        refuse_unknown(tensor, ("name", "shape", "datatype", "data", "parameters"), "input")
        name = tensor.get("name")
        if name not in names:
            raise BadRequest(f"input {name!r} is not one of this model's ({', '.join(names)})")
        if tensor.get("datatype") != "BYTES":
            raise BadRequest(f"input {name!r} must be BYTES (text), not "
                             f"{tensor.get('datatype')!r}")
        if "data" not in tensor:
            raise BadRequest(f"input {name!r} has no 'data': the binary tensor data extension "
                             "is not supported; send the strings as JSON data")
        columns[name] = _strings(name, tensor)
    missing = [n for n in names if n not in columns]
    if missing:
        raise BadRequest(f"missing input {missing[0]!r} (inputs: {', '.join(names)})")
    sizes = {len(c) for c in columns.values()}
    if len(sizes) != 1:
        raise BadRequest("inputs must have the same batch size")
    if limit and sizes.pop() > limit:
        raise BadRequest(f"the batch is larger than the limit of {limit} (max_texts)")
    return columns


def _strings(name: str, tensor: Mapping[str, Any]) -> list[str]:
    shape, data = tensor.get("shape"), tensor.get("data")
    if not isinstance(data, list) or not data:
        raise BadRequest(f"input {name!r}: 'data' must be a non-empty array of strings")
    flat = [item for row in data for item in (row if isinstance(row, list) else [row])]
    if not all(isinstance(item, str) for item in flat):
        raise BadRequest(f"input {name!r}: every element must be a string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              for d in shape) \
            or shape not in ([len(flat)], [len(flat), 1]):
        raise BadRequest(f"input {name!r}: 'shape' must be [{len(flat)}] or [{len(flat)}, 1] "
                         f"for {len(flat)} strings, got {shape!r}")
    return flat


def _requested(value: Any, names: list[str]) -> set[str]:
    if value is None:
        return set(names)
    if not isinstance(value, list):
        raise BadRequest("field 'outputs' must be an array")
    wanted = set()
    for output in value:
        output = body_map(output, "a requested output")
        refuse_unknown(output, ("name", "parameters"), "requested output")
        if output.get("name") not in names:
            raise BadRequest(f"output {output.get('name')!r} is not one of this model's "
                             f"({', '.join(names)})")
        wanted.add(output["name"])
    return wanted


def _tensor(name: str, kind: str, op: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if op == "embed":
        rows = [result["embeddings"][0] for result in results]
        return {"name": name, "datatype": kind, "shape": [len(rows), len(rows[0])],
                "data": [x for row in rows for x in row]}
    if name == "scores":
        rows = [list(result["scores"].values()) for result in results]
        return {"name": name, "datatype": kind, "shape": [len(rows), len(rows[0])],
                "data": [x for row in rows for x in row]}
    return {"name": name, "datatype": kind, "shape": [len(results)],
            "data": [result[name] for result in results]}
