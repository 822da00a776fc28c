"""The Hugging Face shapes: the Inference API's question answering and text classification
(``{"inputs", "parameters"}``), and feature extraction, which text-embeddings-inference's
``/embed`` and ``/predict`` share. ``huggingface_hub.InferenceClient(model=URL)`` posts these
bodies to the URL it is given, whatever the task, so ``POST /`` tells them apart by shape
(``task_of_body``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from http_api.shapes import Call, body_map, common, optional, refuse_unknown, take_texts
from protocol.errors import BadRequest
from protocol.qa_options import QA_OPTION_FIELDS

#: The pipeline's QA parameters that cut the text into windows: the server's settings here.
SERVER_QA_SETTINGS = {"doc_stride": "--doc_stride", "max_seq_len": "--max_seq_len",
                      "max_question_len": "--max_question_chars", "padding": None}
_OURS = ("model", "timeout_ms")


def task_of_body(body: Any) -> str:
    """The op a body of ``POST /`` asks for: ``qa`` for ``{"inputs": {question, context}}``,
    ``classify`` where it has ``parameters`` (text classification), else ``embed`` (feature
    extraction, whose parameters stand at the top level)."""
    fields = body_map(body, "POST /")
    inputs = fields.get("inputs")
    if isinstance(inputs, Mapping) or (isinstance(inputs, list) and inputs
                                       and isinstance(inputs[0], Mapping)):
        return "qa"
    return "classify" if "parameters" in fields else "embed"


def qa_call(body: Any, limit: int) -> Call:
    """``{"inputs": {"question", "context"} (or a list of them), "parameters": {...}}``;
    the reply is ``{"answer", "score", "start", "end"}``, a list of them with ``top_k`` above
    1, and a list per input for a list of inputs."""
    fields = body_map(body, "question answering")
    refuse_unknown(fields, ("inputs", "parameters", *_OURS), "question answering")
    parameters = optional(fields, "parameters", Mapping, "an object") or {}
    for name in parameters:
        if name in SERVER_QA_SETTINGS:
            flag = SERVER_QA_SETTINGS[name]
            raise BadRequest(f"parameter {name!r} is not supported per request" + (
                f" (the server's {flag} applies)" if flag else "") +
                f"; supported: {', '.join(QA_OPTION_FIELDS)}")
    refuse_unknown(parameters, QA_OPTION_FIELDS, "question answering parameters")
    inputs = fields.get("inputs")
    single = isinstance(inputs, Mapping)
    pairs = [inputs] if single else inputs
    if not isinstance(pairs, list) or not pairs or not all(isinstance(p, Mapping) for p in pairs):
        raise BadRequest("field 'inputs' must be an object {\"question\", \"context\"} or a "
                         "non-empty array of them")
    if limit and len(pairs) > limit:
        raise BadRequest(f"field 'inputs' has {len(pairs)} inputs; the limit is {limit} "
                         "(max_texts)")
    for pair in pairs:
        refuse_unknown(pair, ("question", "context"), "inputs")
    requests = [{"question": pair.get("question"), "context": pair.get("context"),
                 **parameters} for pair in pairs]
    model, timeout_ms = common(fields)
    top_k = parameters.get("top_k") or 1

    def respond(results: Sequence[dict[str, Any]]) -> Any:
        answers = [_qa_answer(result, top_k) for result in results]
        return answers[0] if single else answers

    return Call(op="qa", requests=requests, respond=respond, model=model, timeout_ms=timeout_ms)


def _qa_answer(result: dict[str, Any], top_k: int) -> Any:
    if top_k > 1:
        return result.get("answers", [_best(result)])
    return _best(result)


def _best(result: dict[str, Any]) -> dict[str, Any]:
    return {key: result[key] for key in ("answer", "score", "start", "end")}


def embed_call(body: Any, limit: int) -> Call:
    """Feature extraction, text-embeddings-inference's ``/embed``: ``{"inputs": text or
    [texts], "normalize", "truncate", "truncation_direction"}``; the reply is one vector per
    text (a list of lists, for one text too)."""
    fields = body_map(body, "feature extraction")
    refuse_unknown(fields, ("inputs", "normalize", "truncate", "truncation_direction", *_OURS),
                   "feature extraction")
    if optional(fields, "normalize", bool, "a boolean") is False:
        raise BadRequest("'normalize': false is not supported: this server's embeddings are "
                         "always L2-normalised")
    optional(fields, "truncate", bool, "a boolean")  # texts are always cut to the model's length
    _right_only(fields)
    texts, _ = take_texts(fields.get("inputs"), "inputs", limit)
    model, timeout_ms = common(fields)
    return Call(op="embed", requests=[{"texts": texts}], respond=_vectors, model=model,
                timeout_ms=timeout_ms)


def _right_only(fields: Mapping[str, Any]) -> None:
    """Texts are always cut to the model's length at their end."""
    if optional(fields, "truncation_direction", str, "a string") not in (None, "right", "Right"):
        raise BadRequest("'truncation_direction' must be 'right': texts are cut at their end")


def _vectors(results: Sequence[dict[str, Any]]) -> Any:
    return results[0]["embeddings"]


def classify_call(body: Any, limit: int, *, tei: bool) -> Call:
    """Text classification. ``tei``: text-embeddings-inference's ``/predict`` (``{"inputs",
    "raw_scores", "truncate"}``; one input answers a flat list of ``{"label", "score"}``,
    several a list per input); else the Inference API's (``{"inputs", "parameters":
    {"top_k", "function_to_apply"}}``, answered a list per input). Labels come highest first."""
    fields = body_map(body, "text classification")
    known = ("inputs", "raw_scores", "truncate", "truncation_direction") if tei \
        else ("inputs", "parameters")
    refuse_unknown(fields, (*known, *_OURS), "text classification")
    top_k = None
    if tei:
        if optional(fields, "raw_scores", bool, "a boolean"):
            raise BadRequest("'raw_scores': true is not supported: scores are softmax "
                             "probabilities")
        optional(fields, "truncate", bool, "a boolean")
        _right_only(fields)
    else:
        parameters = optional(fields, "parameters", Mapping, "an object") or {}
        refuse_unknown(parameters, ("top_k", "function_to_apply"), "parameters")
        top_k = optional(parameters, "top_k", int, "a positive integer")
        if top_k is not None and top_k < 1:
            raise BadRequest("parameter 'top_k' must be a positive integer")
        if optional(parameters, "function_to_apply", str, "a string") not in (None, "softmax"):
            raise BadRequest("parameter 'function_to_apply' must be 'softmax', the only "
                             "function this server applies")
    texts, single = take_texts(fields.get("inputs"), "inputs", limit)
    model, timeout_ms = common(fields)

    def respond(results: Sequence[dict[str, Any]]) -> Any:
        ranked = [ranked_labels(result, top_k) for result in results]
        return ranked[0] if single and tei else ranked

    return Call(op="classify", requests=[{"text": text} for text in texts], respond=respond,
                model=model, timeout_ms=timeout_ms)


def ranked_labels(result: dict[str, Any], top_k: int | None = None) -> list[dict[str, Any]]:
    """A classify result's labels with their scores, highest first (``top_k`` of them)."""
    ranked = sorted(result["scores"].items(), key=lambda item: item[1], reverse=True)
    return [{"label": label, "score": score} for label, score in ranked[:top_k]]
