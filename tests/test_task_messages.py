"""Wire shapes of the model requests besides qa: embed, classify, a plug-in task's op, models."""

from __future__ import annotations

import pytest

from protocol.errors import BadRequest
from protocol.limits import FieldLimits
from protocol.messages import (
    ClassifyRequest,
    EmbedRequest,
    ModelsRequest,
    QARequest,
    TaskRequest,
    classify_request,
    embed_request,
    models_request,
    op_name,
    parse_request,
    qa_request,
)


def test_builders_and_parser_agree_for_every_model_op() -> None:
    embed = parse_request(embed_request(1, ["a b", "c"], timeout_ms=50, model="minilm"))
    assert embed == EmbedRequest(id=1, texts=("a b", "c"), timeout_ms=50, model="minilm")
    classify = parse_request(classify_request(2, "great film"))
    assert classify == ClassifyRequest(id=2, text="great film")
    qa = parse_request(qa_request(3, "Who?", "Ada.", model="squad"))
    assert isinstance(qa, QARequest) and qa.model == "squad"
    assert parse_request(models_request(4)) == ModelsRequest(id=4)


@pytest.mark.parametrize("texts", [[], ["ok", ""], ["ok", "  "], ["ok", 3], "one string", None])
def test_embed_texts_must_be_a_non_empty_array_of_non_empty_strings(texts: object) -> None:
    with pytest.raises(BadRequest, match="field 'texts' must be a non-empty array") as info:
        parse_request({"id": 7, "op": "embed", "texts": texts})
    assert info.value.request_id == 7


@pytest.mark.parametrize("model", [1, b"x", ["m"]])
def test_model_must_be_a_string(model: object) -> None:
    with pytest.raises(BadRequest, match="field 'model' must be a string"):
        parse_request({"id": 1, "op": "classify", "text": "hi", "model": model})


def test_a_plug_in_op_is_parsed_only_when_served() -> None:
    message = {"id": 5, "op": "sentiment", "text": "hi", "model": "m", "timeout_ms": 9}
    with pytest.raises(BadRequest, match="unknown op 'sentiment'"):
        parse_request(message)
    request = parse_request(message, task_ops={"sentiment"})
    assert request == TaskRequest(op="sentiment", id=5, fields={"text": "hi"}, timeout_ms=9,
                                  model="m")
    assert op_name(message) == "invalid" and op_name(message, {"sentiment"}) == "sentiment"


def test_limits_cap_texts_and_their_length() -> None:
    limits = FieldLimits(max_context_chars=5, max_texts=2)
    limits.check(EmbedRequest(id=1, texts=("abc", "de")))
    with pytest.raises(BadRequest, match=r"3 texts; the limit is 2 \(max_texts\)"):
        limits.check(EmbedRequest(id=1, texts=("a", "b", "c")))
    with pytest.raises(BadRequest, match=r"'texts\[1\]' has 6 characters.*max_context_chars"):
        limits.check(EmbedRequest(id=1, texts=("a", "abcdef")))
    with pytest.raises(BadRequest, match=r"'text' has 6 characters"):
        limits.check(ClassifyRequest(id=1, text="abcdef"))
