"""Test helpers: a raw socket speaking our framing, sample texts, reference answers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.cli import read_address_file
from engines.base import Engine
from protocol import FrameDecoder, encode_frame, qa_request

CONTEXTS = [
    "The Eiffel Tower was completed in 1889 and stands in Paris, on the Champ de Mars.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
    "Zürich liegt am Zürichsee; die Stadt hat etwa 420 000 Einwohner und viele Brücken.",
    "東京は日本の首都です。 Tokyo has about fourteen million people living in the city proper.",
    "Python was created by Guido van Rossum and first released in 1991 as Python 0.9.0.",
    "The river flows north for 6,650 km, through eleven countries, into the Mediterranean Sea.",
]
QUESTIONS = ["When was it completed?", "Who won the prize?", "Wie viele Einwohner?",
             "How many people?", "Who created Python?", "How long is the river?"]


class RawConnection:
    """A plain socket that sends and receives our frames, for tests that misbehave on purpose.

    Args:
        address: (host, port) over TCP, or a Unix socket's ``unix:///path``.
    """

    def __init__(self, address: tuple[str, int] | str, timeout: float = 30.0) -> None:
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(address.removeprefix("unix://"))
        else:
            self.sock = socket.create_connection(address, timeout=timeout)
        self.decoder = FrameDecoder()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_message(self, pace_s: float = 0.0) -> dict[str, Any] | None:
        """The next reply, or None once the server closed the connection.

        Args:
            pace_s: Sleep this long before each read, to be a client that reads slowly.
        """
        while True:
            message = self.decoder.next_message()
            if message is not None:
                return message
            if self.decoder.closed:
                return None
            time.sleep(pace_s)
            self.decoder.receive_data(self.sock.recv(65536))

    def recv_replies(self, count: int) -> dict[int, dict[str, Any]]:
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < count:
            message = self.recv_message()
            assert message is not None, f"closed after {len(replies)} of {count} replies"
            assert message["id"] not in replies, "two replies for one id"
            replies[message["id"]] = message
        return replies

    def server_closed(self) -> bool:
        """True if the server closed its side (EOF) with nothing more to read."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def header(length: int) -> bytes:
    return struct.pack(">I", length)


class Reference:
    """Answers computed in-process with the same task and an engine, to compare with the server."""

    def __init__(self, model_dir: Path, **qa_options: Any) -> None:
        from engines import load_engine
        from tasks.qa import QAConfig, QATask

        self.task = QATask.from_dir(model_dir, QAConfig(**qa_options))
        self.engine = load_engine("onnx", model_dir, threads=1)

    def answer(self, question: str, context: str) -> dict[str, Any]:
        features = [self.task.preprocess(question, context)]
        return self.task.answer_batch(features, self.engine.run(self.task.collate(features)))[0]


def assert_same_answer(result: dict[str, Any], expected: dict[str, Any], context: str) -> None:
    """``result`` (from the server) is ``expected`` (``Reference.answer``) on ``context``."""
    import pytest

    assert context[result["start"]:result["end"]] == result["answer"]
    assert (result["answer"], result["start"], result["end"]) == (
        expected["answer"], expected["start"], expected["end"])
    assert result["score"] == pytest.approx(expected["score"], rel=1e-3, abs=1e-6)


def assert_pipelined_answers(address: Any, reference: Reference, first_id: int,
                             count: int = 60) -> None:
    """``count`` qa requests sent in one write to ``address`` (host and port, or ``unix://``)
    each get one reply, matched by id, with the in-process answer."""
    conn = RawConnection(address)
    pairs = {first_id + i: (QUESTIONS[i % 6], CONTEXTS[(i * 5) % 6]) for i in range(count)}
    conn.send_raw(b"".join(encode_frame(qa_request(rid, q, c)) for rid, (q, c) in pairs.items()))
    replies = conn.recv_replies(len(pairs))
    conn.close()
    assert set(replies) == set(pairs)
    for rid, (question, context) in pairs.items():
        assert replies[rid]["ok"], replies[rid]
        assert_same_answer(replies[rid]["result"], reference.answer(question, context), context)


class GatedEngine(Engine):
    """A real engine that holds every batch until the test opens the gate; counts what it ran."""

    def __init__(self, inner: Engine) -> None:
        self.inner, self.gate = inner, threading.Event()
        self.gate.set()  # open while the server starts (every engine is primed before ready)
        self.input_names, self.name = inner.input_names, "gated"
        self.calls = 0  # batches that entered run()
        self.rows_run = 0  # rows of the batches that went through
        self.shapes: list[tuple[int, int]] = []  # of every batch that entered run()

    def run(self, feeds: Any) -> dict[str, Any]:
        self.calls += 1
        self.shapes.append(tuple(next(iter(feeds.values())).shape))
        assert self.gate.wait(60), "the test never opened the gate"
        self.rows_run += len(next(iter(feeds.values())))
        return self.inner.run(feeds)


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def frozen(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (Linux: /proc/PID/task/*/stat)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        if state not in ("T", "t"):
            return False
    return True


def freeze(pid: int, timeout: float = 30) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it has stopped. ``kill``
    returns once the signal is queued: one thread is woken to stop the others as each next
    runs, so on a busy machine another thread may go on for a while (take an entry from Redis,
    send a reply) after ``kill`` returned."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: frozen(pid), timeout)


def wait_for_address(path: Path, process: subprocess.Popen[Any], timeout: float,
                     what: str = "the server") -> tuple[str, int]:
    """Until the server ``process`` writes its ``--address_file`` at ``path`` (it must not exit
    meanwhile); its (host, port)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, f"{what} did not serve"
        time.sleep(0.1)
    return read_address_file(str(path))


def nan_model_dir(tiny_model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model folder whose model.onnx is a small real graph with logits that
    are NaN on every "explode" token and finite elsewhere: an engine that overflows on some
    inputs, as an fp16 one can."""
    import onnx
    from onnx import TensorProto, helper

    from tasks.qa import QATask

    shutil.copytree(tiny_model_dir, out)
    poison = QATask.from_dir(tiny_model_dir).tokenizer.convert_tokens_to_ids("explode")
    dims = ["batch", "sequence"]
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, dims)
              for name in ("input_ids", "attention_mask", "token_type_ids")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
               for name in ("start_logits", "end_logits")]
    constants = [helper.make_tensor("poison", TensorProto.INT64, [], [poison]),
                 helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")]),
                 helper.make_tensor("scale", TensorProto.FLOAT, [], [0.001])]
    nodes = [helper.make_node("Equal", ["input_ids", "poison"], ["poisoned"]),
             helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["ids", "scale"], ["scaled"]),
             helper.make_node("Where", ["poisoned", "nan", "scaled"], ["start_logits"]),
             helper.make_node("Neg", ["start_logits"], ["end_logits"])]
    graph = helper.make_graph(nodes, "nan_on_explode", inputs, outputs, initializer=constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, out / "model.onnx")
    return out
