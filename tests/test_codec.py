"""Framing: bytes in, maps out, fed as plain byte strings (often one byte at a time)."""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from protocol.errors import FrameTooLarge, ProtocolError


def raw_frame(body: bytes) -> bytes:
    """A frame around arbitrary body bytes (valid or not)."""
    return struct.pack(">I", len(body)) + body


def drain(decoder: FrameDecoder) -> list[dict[Any, Any]]:
    """Every message that is complete right now."""
    out = []
    while (message := decoder.next_message()) is not None:
        out.append(message)
    return out


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[dict[Any, Any]]:
    """Feed chunks one by one, collecting messages after each, then EOF."""
    out: list[dict[Any, Any]] = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        out.extend(drain(decoder))
    decoder.receive_data(b"")
    out.extend(drain(decoder))
    return out


def frame_with_body_size(size: int) -> bytes:
    """A valid frame whose msgpack body is exactly ``size`` bytes (size > 70_000)."""
    overhead = len(msgpack.packb({"x": "a" * 70_000})) - 70_000
    frame = encode_frame({"x": "a" * (size - overhead)})
    assert len(frame) == 4 + size
    return frame


def test_encode_frame_is_big_endian_length_then_msgpack_map() -> None:
    frame = encode_frame({"id": 1, "op": "ping"})
    body = msgpack.packb({"id": 1, "op": "ping"}, use_bin_type=True)
    assert frame == struct.pack(">I", len(body)) + body


def test_worked_example_in_the_docs_matches_the_encoder() -> None:
    request = {"id": 1, "op": "qa", "question": "Who?", "context": "Bob."}
    assert encode_frame(request) == bytes.fromhex(
        "00000026 84 a26964 01 a26f70 a27161 a8" + "question".encode().hex()
        + " a4 57686f3f a7" + "context".encode().hex() + " a4 426f622e"
    )
    result = {"answer": "Bob", "score": 0.9375, "start": 0, "end": 3}
    assert encode_frame({"id": 1, "ok": True, "result": result}) == bytes.fromhex(
        "00000037 83 a26964 01 a26f6b c3 a6" + "result".encode().hex() + " 84"
        " a6" + "answer".encode().hex() + " a3 426f62 a5" + "score".encode().hex()
        + " cb 3fee000000000000 a5" + "start".encode().hex() + " 00 a3656e64 03"
    )


def test_encode_frame_rejects_non_map() -> None:
    with pytest.raises(TypeError):
        encode_frame([1, 2])  # type: ignore[arg-type]


def test_round_trip_preserves_str_bytes_and_nesting() -> None:
    message = {
        "id": 7,
        "s": "héllo",
        "b": b"\x00\xff",
        "n": None,
        "l": [1, 2.5, True],
        "m": {"k": 1},
    }
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(message))
    assert decoder.next_message() == message
    assert decoder.next_message() is None
    assert decoder.buffered == 0


def test_frame_fed_one_byte_at_a_time_yields_nothing_until_complete() -> None:
    frame = encode_frame({"id": 1, "op": "qa", "question": "Who?", "context": "Bob."})
    decoder = FrameDecoder()
    for i, byte in enumerate(frame[:-1]):
        decoder.receive_data(bytes([byte]))
        assert decoder.next_message() is None
        assert decoder.buffered == i + 1
    decoder.receive_data(frame[-1:])
    assert decoder.next_message() == {"id": 1, "op": "qa", "question": "Who?", "context": "Bob."}
    assert decoder.next_message() is None
    assert decoder.buffered == 0


def test_several_frames_in_one_chunk_come_out_in_order() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"".join(encode_frame({"id": i}) for i in range(5)))
    assert drain(decoder) == [{"id": i} for i in range(5)]


def test_chunks_split_across_frame_boundaries() -> None:
    expected = [{"id": 1, "pad": "x" * 10}, {"id": 2}, {"id": 3}]
    data = b"".join(encode_frame(message) for message in expected)
    for cut in range(1, len(data)):
        decoder = FrameDecoder()
        assert feed_all(decoder, [data[:cut], data[cut:]]) == expected
        assert decoder.closed


def test_clean_eof_between_frames_closes_the_decoder() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({"id": 1}))
    assert not decoder.closed
    decoder.receive_data(b"")
    assert not decoder.closed  # a complete frame is still waiting
    assert decoder.next_message() == {"id": 1}
    assert decoder.closed
    assert decoder.next_message() is None


def test_data_after_eof_is_a_usage_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"")
    with pytest.raises(RuntimeError):
        decoder.receive_data(b"\x00")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"\x81\xa1", id="truncated-map"),
        pytest.param(b"\x81\xa2\xff\xfe\x01", id="invalid-utf8-key"),
        pytest.param(b"\x81\x91\x01\x02", id="unhashable-key"),
        pytest.param(b"garbage!", id="ascii-garbage"),
    ],
)
def test_undecodable_body_is_a_protocol_error(body: bytes) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(body))
    with pytest.raises(ProtocolError) as info:
        decoder.next_message()
    assert type(info.value) is ProtocolError
    assert not info.value.message.endswith(": "), "the reason is missing"


def test_garbage_stream_is_refused_as_too_large_from_its_header() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"GET / HTTP/1.1\r\n")  # "GET " reads as a length of ~1.2 GB
    with pytest.raises(FrameTooLarge):
        decoder.next_message()


def test_trailing_bytes_inside_a_frame_are_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(msgpack.packb({"id": 1}) + b"\x00"))
    with pytest.raises(ProtocolError, match="trailing"):
        decoder.next_message()


@pytest.mark.parametrize("value", [[1, 2], 5, "text", None, b"bin"])
def test_non_map_top_level_is_a_protocol_error(value: object) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(msgpack.packb(value, use_bin_type=True)))
    with pytest.raises(ProtocolError, match="map"):
        decoder.next_message()


def test_non_str_map_keys_are_kept_for_validation_to_ignore() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(msgpack.packb({1: "a", b"k": 2, "id": 3}, use_bin_type=True)))
    assert decoder.next_message() == {1: "a", b"k": 2, "id": 3}


def test_zero_length_frame_is_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="zero"):
        decoder.next_message()


def test_oversized_length_is_refused_from_the_header_alone() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    header = struct.pack(">I", 101)
    for byte in header[:-1]:
        decoder.receive_data(bytes([byte]))
        assert decoder.next_message() is None
    decoder.receive_data(header[-1:])
    with pytest.raises(FrameTooLarge):
        decoder.next_message()


def test_default_cap_refuses_one_byte_over_a_mebibyte() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack(">I", DEFAULT_MAX_FRAME_SIZE + 1))
    with pytest.raises(FrameTooLarge, match=str(DEFAULT_MAX_FRAME_SIZE)):
        decoder.next_message()


def test_frame_exactly_at_the_cap_is_accepted() -> None:
    assert DEFAULT_MAX_FRAME_SIZE == 1 << 20
    frame = frame_with_body_size(DEFAULT_MAX_FRAME_SIZE)
    decoder = FrameDecoder()
    decoder.receive_data(frame)
    message = decoder.next_message()
    assert message is not None and len(message["x"]) > 1_000_000


def test_large_frame_fed_in_small_chunks_is_fast() -> None:
    frame = frame_with_body_size(DEFAULT_MAX_FRAME_SIZE)
    decoder = FrameDecoder()
    started = time.perf_counter()
    messages = feed_all(decoder, [frame[i : i + 4096] for i in range(0, len(frame), 4096)])
    elapsed = time.perf_counter() - started
    assert len(messages) == 1
    assert elapsed < 1.0, f"decoding a 1 MiB frame in 4 KiB chunks took {elapsed:.2f}s"


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_eof_in_the_middle_of_a_header_is_a_protocol_error(kept: int) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({"id": 1})[:kept])
    assert decoder.next_message() is None
    decoder.receive_data(b"")
    assert not decoder.closed
    with pytest.raises(ProtocolError, match="header"):
        decoder.next_message()


def test_eof_in_the_middle_of_a_body_is_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({"id": 1})[:-1])
    assert decoder.next_message() is None
    decoder.receive_data(b"")
    with pytest.raises(ProtocolError, match="body"):
        decoder.next_message()


def test_eof_right_after_a_header_is_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({"id": 1})[:4])
    decoder.receive_data(b"")
    with pytest.raises(ProtocolError):
        decoder.next_message()


def test_decoder_stays_broken_after_an_error() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(struct.pack(">I", 11))
    with pytest.raises(FrameTooLarge):
        decoder.next_message()
    decoder.receive_data(encode_frame({"id": 1}))  # dropped, never decoded
    assert decoder.buffered == 0
    for _ in range(3):
        with pytest.raises(ProtocolError, match="earlier error"):
            decoder.next_message()


def test_messages_before_a_bad_frame_are_still_delivered() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({"id": 1}) + encode_frame({"id": 2}) + raw_frame(b"\xc1"))
    decoder.receive_data(encode_frame({"id": 3}))
    assert decoder.next_message() == {"id": 1}
    assert decoder.next_message() == {"id": 2}
    with pytest.raises(ProtocolError):
        decoder.next_message()
    with pytest.raises(ProtocolError):
        decoder.next_message()


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=0)


scalars = (
    st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.text(max_size=20)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.none()
)
values = scalars | st.lists(scalars, max_size=5)
messages = st.dictionaries(st.text(max_size=10), values, max_size=6)


@given(batch=st.lists(messages, max_size=8), data=st.data())
def test_property_concatenated_frames_split_anywhere_decode_back_equal(
    batch: list[dict[str, Any]], data: st.DataObject
) -> None:
    stream = b"".join(encode_frame(message) for message in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    decoder = FrameDecoder()
    assert feed_all(decoder, [chunk for chunk in chunks if chunk]) == batch
    assert decoder.closed
