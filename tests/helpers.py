"""Test helpers: a raw socket speaking our framing, sample texts, reference answers."""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Any

from protocol import FrameDecoder, encode_frame

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
    """A plain TCP socket that sends and receives our frames, for tests that misbehave on purpose."""

    def __init__(self, address: tuple[str, int], timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.decoder = FrameDecoder()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_message(self) -> dict[str, Any] | None:
        """The next reply, or None once the server closed the connection."""
        while True:
            message = self.decoder.next_message()
            if message is not None:
                return message
            if self.decoder.closed:
                return None
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
        from engines.qa import QAConfig, QATask

        self.task = QATask.from_dir(model_dir, QAConfig(**qa_options))
        self.engine = load_engine("onnx", model_dir, threads=1)

    def answer(self, question: str, context: str) -> dict[str, Any]:
        features = [self.task.preprocess(question, context)]
        return self.task.answer_batch(features, self.engine.run(self.task.collate(features)))[0]
