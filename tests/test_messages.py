"""Request validation, reply building and client-side reply parsing, on plain dicts."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.codec import FrameDecoder, encode_frame
from protocol.errors import (
    ERRORS_BY_CODE,
    BadRequest,
    DeadlineExceeded,
    EngineError,
    FrameTimeout,
    FrameTooLarge,
    IdleTimeout,
    InternalError,
    Overloaded,
    ProtocolError,
    ServerError,
    ShuttingDown,
    TooManyConnections,
    Unauthorized,
    UnknownServerError,
)
from protocol.limits import FieldLimits
from protocol.messages import (
    REQUEST_PARSERS,
    AuthRequest,
    PingRequest,
    QARequest,
    Reply,
    auth_request,
    error_reply,
    ok_reply,
    parse_reply,
    parse_request,
    ping_request,
    qa_request,
)


def qa(**overrides: Any) -> dict[Any, Any]:
    """A valid qa request map with some fields replaced (``None`` here means: drop the field)."""
    obj: dict[Any, Any] = {"id": 1, "op": "qa", "question": "Who?", "context": "Bob."}
    obj.update(overrides)
    return {key: value for key, value in obj.items() if value is not None}


def over_the_wire(message: dict[str, Any]) -> dict[Any, Any]:
    """Encode and decode a map through the real codec."""
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(message))
    decoded = decoder.next_message()
    assert decoded is not None
    return decoded


# --------------------------------------------------------------------------- requests


def test_valid_qa_request_parses() -> None:
    assert parse_request(qa()) == QARequest(id=1, question="Who?", context="Bob.")


def test_valid_ping_request_parses() -> None:
    assert parse_request({"id": 5, "op": "ping"}) == PingRequest(id=5)


def test_client_builders_produce_requests_the_server_accepts() -> None:
    assert parse_request(over_the_wire(qa_request(3, "Q?", "C."))) == QARequest(
        id=3, question="Q?", context="C."
    )
    assert parse_request(over_the_wire(ping_request(4))) == PingRequest(id=4)
    assert qa_request(3, "Q?", "C.") == {"id": 3, "op": "qa", "question": "Q?", "context": "C."}
    assert ping_request(4) == {"id": 4, "op": "ping"}


@pytest.mark.parametrize("request_id", [0, -1, 2**63 - 1, -(2**63), 2**64 - 1])
def test_any_msgpack_int_is_a_valid_id(request_id: int) -> None:
    assert parse_request(over_the_wire(qa(id=request_id))).id == request_id


def test_requests_are_frozen_and_carry_their_op() -> None:
    request = parse_request(qa())
    with pytest.raises(AttributeError):
        request.id = 2  # type: ignore[misc]
    assert QARequest.op == "qa" and PingRequest.op == "ping"
    assert set(REQUEST_PARSERS) == {"qa", "embed", "classify", "ping", "stats", "models", "auth"}


def test_an_auth_request_carries_its_token_and_never_shows_it() -> None:
    request = parse_request(over_the_wire(auth_request(9, "s3cret-token")))
    assert request == AuthRequest(id=9, token="s3cret-token")
    assert "s3cret" not in repr(request) and "s3cret" not in str(request)
    for bad in ({"id": 9, "op": "auth"}, {"id": 9, "op": "auth", "token": 42}):
        with pytest.raises(BadRequest, match="'token'") as info:
            parse_request(bad)
        assert info.value.request_id == 9


def test_unknown_fields_are_ignored() -> None:
    assert parse_request(qa(extra=1, deadline_ms=5.0)) == QARequest(
        id=1, question="Who?", context="Bob."
    )


def test_non_str_keys_are_ignored() -> None:
    obj = {**qa(), 1: "x", b"id": "bad", None: [1]}
    assert parse_request(obj) == QARequest(id=1, question="Who?", context="Bob.")


def test_missing_id_is_a_bad_request_without_an_id() -> None:
    with pytest.raises(BadRequest, match="'id'") as info:
        parse_request(qa(id=None))
    assert info.value.request_id is None


@pytest.mark.parametrize("bad_id", ["1", 1.0, True, False, [1], b"\x01"])
def test_wrongly_typed_id_is_a_bad_request_without_an_id(bad_id: object) -> None:
    with pytest.raises(BadRequest, match="'id'") as info:
        parse_request(qa(id=bad_id))
    assert info.value.request_id is None


@pytest.mark.parametrize("field", ["op", "question", "context"])
def test_missing_field_is_a_bad_request_naming_it(field: str) -> None:
    with pytest.raises(BadRequest, match=f"missing field '{field}'") as info:
        parse_request(qa(**{field: None}))
    assert info.value.request_id == 1
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("field", ["op", "question", "context"])
@pytest.mark.parametrize("value", [1, 2.5, True, b"bytes", ["a"], {"a": 1}])
def test_wrongly_typed_field_is_a_bad_request_naming_it(field: str, value: object) -> None:
    with pytest.raises(BadRequest, match=f"field '{field}' must be a string") as info:
        parse_request(qa(**{field: value}))
    assert info.value.request_id == 1


def test_unknown_op_is_a_bad_request_with_the_id() -> None:
    with pytest.raises(BadRequest, match="unknown op 'train'") as info:
        parse_request(qa(op="train"))
    assert info.value.request_id == 1


def test_unknown_op_message_does_not_echo_huge_input() -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(qa(op="x" * 100_000))
    assert len(info.value.message) < 200


@pytest.mark.parametrize("field", ["question", "context"])
@pytest.mark.parametrize("blank", ["", " ", "\t\n ", "\u3000"])
def test_empty_or_whitespace_text_is_a_bad_request(field: str, blank: str) -> None:
    with pytest.raises(BadRequest, match=f"'{field}' must not be empty") as info:
        parse_request(qa(**{field: blank}))
    assert info.value.request_id == 1


@pytest.mark.parametrize("obj", [[1, 2], "qa", None, 3])
def test_non_map_request_is_a_bad_request(obj: object) -> None:
    with pytest.raises(BadRequest, match="map") as info:
        parse_request(obj)
    assert info.value.request_id is None


# --------------------------------------------------------------------------- replies


def test_ok_reply_shape() -> None:
    result = {"answer": "Bob", "score": 0.9, "start": 0, "end": 3}
    assert ok_reply(1, result) == {"id": 1, "ok": True, "result": result}


def test_error_reply_shape() -> None:
    assert error_reply(7, BadRequest("missing field 'question'")) == {
        "id": 7,
        "ok": False,
        "error": {"code": "bad_request", "message": "missing field 'question'"},
    }


def test_error_reply_for_a_framing_error_has_nil_id() -> None:
    reply = error_reply(None, FrameTooLarge("too big"))
    assert reply["id"] is None
    assert reply["error"]["code"] == "frame_too_large"


def test_parse_reply_round_trips_an_ok_reply() -> None:
    reply = parse_reply(over_the_wire(ok_reply(2, {"pong": True, "ready": False})))
    assert reply == Reply(id=2, ok=True, result={"pong": True, "ready": False}, error=None)
    assert reply.unwrap() == {"pong": True, "ready": False}


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (BadRequest("b"), BadRequest),
        (ProtocolError("p"), ProtocolError),
        (FrameTooLarge("f"), FrameTooLarge),
        (InternalError("i"), InternalError),
        (EngineError("e"), EngineError),
        (ShuttingDown("s"), ShuttingDown),
        (Overloaded("o"), Overloaded),
        (DeadlineExceeded("d"), DeadlineExceeded),
        (TooManyConnections("t"), TooManyConnections),
        (IdleTimeout("i"), IdleTimeout),
        (FrameTimeout("f"), FrameTimeout),
        (Unauthorized("u"), Unauthorized),
    ],
)
def test_parse_reply_round_trips_each_error_code(error: ServerError, expected: type) -> None:
    reply = parse_reply(over_the_wire(error_reply(9, error)))
    assert reply.id == 9 and reply.ok is False and reply.result is None
    assert reply.error is not None and type(reply.error) is expected
    assert reply.error.message == str(error)
    assert reply.error.request_id == 9
    with pytest.raises(expected):
        reply.unwrap()


def test_parse_reply_keeps_unknown_error_codes() -> None:
    wire = {"id": None, "ok": False, "error": {"code": "rate_limited", "message": "busy"}}
    reply = parse_reply(over_the_wire(wire))
    assert isinstance(reply.error, UnknownServerError)
    assert reply.error.code == "rate_limited" and reply.error.message == "busy"
    assert reply.id is None


def test_parse_reply_ignores_unknown_fields() -> None:
    wire = {"id": 1, "ok": True, "result": {"pong": True}, "trace": "abc", 5: 6}
    assert parse_reply(wire).result == {"pong": True}


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([1], "map"),
        ({"ok": True, "result": {}}, "'id'"),
        ({"id": "1", "ok": True, "result": {}}, "'id'"),
        ({"id": True, "ok": True, "result": {}}, "'id'"),
        ({"id": 1, "result": {}}, "'ok'"),
        ({"id": 1, "ok": 1, "result": {}}, "'ok'"),
        ({"id": 1, "ok": True}, "'result'"),
        ({"id": 1, "ok": True, "result": [1]}, "'result'"),
        ({"id": 1, "ok": False}, "'error'"),
        ({"id": 1, "ok": False, "error": "boom"}, "'error'"),
        ({"id": 1, "ok": False, "error": {"message": "m"}}, "'error.code'"),
        ({"id": 1, "ok": False, "error": {"code": 3, "message": "m"}}, "'error.code'"),
        ({"id": 1, "ok": False, "error": {"code": "internal"}}, "'error.message'"),
        ({"id": 1, "ok": False, "error": {"code": "internal", "message": None}}, "'error.message'"),
    ],
)
def test_malformed_reply_is_a_protocol_error(obj: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=field) as info:
        parse_reply(obj)
    assert type(info.value) is ProtocolError


def test_stats_request_round_trips_and_takes_no_fields() -> None:
    from protocol import StatsRequest, stats_request

    assert parse_request(stats_request(9)) == StatsRequest(id=9)
    assert parse_request({"id": 4, "op": "stats", "extra": [1, 2]}) == StatsRequest(id=4)


# --------------------------------------------------------------------------- deadlines and caps


@pytest.mark.parametrize("timeout_ms", [1, 250, 0.5, 60_000.0, 86_400_000, None])
def test_timeout_ms_is_an_optional_positive_number(timeout_ms: float | None) -> None:
    request = parse_request(over_the_wire(qa_request(3, "Who?", "Bob.", timeout_ms)))
    assert isinstance(request, QARequest) and request.timeout_ms == timeout_ms


@pytest.mark.parametrize("bad", [0, -1, -0.5, float("nan"), float("inf"), 86_400_001, 10**13,
                                 True, "100", [100]])
def test_a_timeout_ms_that_is_not_a_positive_number_is_a_bad_request(bad: object) -> None:
    with pytest.raises(BadRequest, match="timeout_ms") as info:
        parse_request(qa(timeout_ms=bad))
    assert info.value.request_id == 1


def test_field_limits_name_the_option_that_sets_them() -> None:
    limits = FieldLimits(max_question_chars=5, max_context_chars=10)
    limits.check(QARequest(id=1, question="Who?!", context="0123456789"))  # at the caps: fine
    with pytest.raises(BadRequest, match=r"'question' has 6 characters; the limit is 5 "
                                         r"\(max_question_chars\)"):
        limits.check(QARequest(id=1, question="Who?!!", context="Bob."))
    with pytest.raises(BadRequest, match="max_context_chars") as info:
        limits.check(QARequest(id=7, question="Who?", context="x" * 11))
    assert info.value.request_id == 7
    FieldLimits(max_question_chars=0, max_context_chars=0).check(
        QARequest(id=1, question="?" * 10**5, context="x" * 10**6))  # 0: no cap


def test_only_connection_ending_errors_are_fatal() -> None:
    fatal = {code for code, cls in ERRORS_BY_CODE.items() if cls.fatal}
    assert fatal == {"protocol_error", "frame_too_large", "frame_timeout", "idle_timeout",
                     "too_many_connections", "unauthorized"}
    assert ERRORS_BY_CODE["unauthorized"] is Unauthorized
