"""What travels through Redis (broker/wire.py): any task's engine inputs and outputs round-trip
exactly, integers narrowed on the way, and an entry that is not well formed is refused before it
costs memory, with its front end named where it can be."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from broker.wire import (
    BadWork,
    decode_reply,
    decode_work,
    encode_answer,
    encode_work,
    pack_array,
    unpack_array,
)


def test_inputs_and_outputs_round_trip_with_their_dtypes() -> None:
    feeds = {"input_ids": np.array([[101, 30000, 102, 0]], dtype=np.int64),
             "attention_mask": np.array([[1, 1, 1, 0]], dtype=np.int64),
             "token_type_ids": np.zeros((1, 4), dtype=np.int64)}
    work = decode_work(encode_work("qa:replies:x", 7, feeds, time.monotonic(), None, "abc"))
    assert (work.reply_to, work.number, work.model) == ("qa:replies:x", 7, "abc")
    for name, value in feeds.items():
        assert work.feeds.arrays[name].dtype == np.int64
        assert np.array_equal(work.feeds.arrays[name], value)
    assert (work.feeds.rows, work.feeds.max_len) == (1, 4)
    outputs = {"embeddings": np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)}
    reply = decode_reply(encode_answer(7, outputs, 0.5))
    got = reply.outputs(2)["embeddings"]
    assert got.dtype == np.float32 and np.array_equal(got, outputs["embeddings"])
    got[0, 0] = 1.0  # writable: a task may change its outputs in place


def test_integers_travel_in_the_narrowest_type_that_holds_them() -> None:
    assert pack_array(np.array([[0, 1]], dtype=np.int64))[1] == "|u1"
    assert pack_array(np.array([[30521, 0]], dtype=np.int64))[1] == "<u2"
    assert pack_array(np.array([[-1, 70000]], dtype=np.int64))[1] == "<i4"
    assert pack_array(np.array([[1.5]], dtype=np.float32))[1] == "<f4"


@pytest.mark.parametrize("packed", [
    ["(100000,100000)f8", "|u1", [1, 1], b"\x00"],  # a subarray dtype: 80 GB from one byte
    ["O", "O", [1, 1], b"\x00" * 8],  # objects
    [{"a": "<i4"}, "<i4", [1, 1], b"\x00" * 4],  # a structured dtype
    ["<i8", "|u1", [1 << 40, 0], b""],  # 2**40 rows of nothing
    ["<i8", "|u1", [1 << 20, 1 << 20], b"\x00"],  # a shape its bytes do not fill
    ["<i8", "|u1", [2, 2], b"\x00" * 3],
    ["<i8", "|u1", [1, 1, 1, 1, 1], b"\x00"],  # too many dimensions
    ["<i8", "|u1", [-1, 1], b"\x00"],
    ["<i8", "|u1", [1, 1]],
])
def test_an_array_that_is_not_plain_numbers_filling_its_shape_is_refused(packed: list) -> None:
    with pytest.raises(ValueError):
        unpack_array(packed)


def test_a_bad_entry_names_its_front_end_where_it_can() -> None:
    base = {"r": "qa:replies:x", "i": 3, "t": time.time()}
    for feeds in ({"input_ids": ["<i8", "|u1", [1], b"\x00"]},  # one dimension
                  {"a": ["<i8", "|u1", [1, 2], b"\x00" * 2],
                   "b": ["<i8", "|u1", [1, 3], b"\x00" * 3]},  # two widths
                  {"a": ["O", "O", [1, 1], b"\x00" * 8]}):
        with pytest.raises(BadWork) as refused:
            decode_work(msgpack.packb({**base, "f": feeds}))
        assert (refused.value.reply_to, refused.value.number) == ("qa:replies:x", 3)
    with pytest.raises(ValueError) as unreadable:
        decode_work(b"\xc1 not msgpack")
    assert not isinstance(unreadable.value, BadWork)
