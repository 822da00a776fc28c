"""The REPL as a person uses it: in a real pseudo-terminal, with long pasted texts, against a
server."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.repl import choose_model, default_qa
from console.session import PICK_PROMPT
from console.text_input import BRACKETED_PASTE_OFF, BRACKETED_PASTE_ON, TextBuffer
from engines import load_engine
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, GatedEngine, wait_until
from tests.text_models import build_tiny_embed_dir

ROOT = Path(__file__).resolve().parent.parent
TERMINAL_LINE_LIMIT = 4095  # what a canonical-mode terminal hands input() of one line


class Terminal:
    """client.py running in a pseudo-terminal: type into it, read what it shows."""

    def __init__(self, *args: str) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "client.py", *args], cwd=ROOT,
                                     stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        self.screen = ""
        self._seen = 0

    def read_until(self, text: str, timeout: float = 60) -> str:
        """Read the output until ``text`` appears after what earlier calls consumed; return
        the output up to and including it."""
        deadline = time.monotonic() + timeout
        while (at := self.screen.find(text, self._seen)) < 0:
            assert time.monotonic() < deadline, f"never showed {text!r}:\n{self.screen[-2000:]}"
            if select.select([self.master], [], [], 0.1)[0]:
                self.screen += os.read(self.master, 1 << 16).decode(errors="replace")
        shown, self._seen = self.screen[self._seen:at + len(text)], at + len(text)
        return shown

    def type(self, text: str) -> threading.Thread:
        """Write ``text`` from a thread (its echo must be read meanwhile, or both sides block)."""
        data = text.encode()

        def write_all() -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.master, view):]

        writer = threading.Thread(target=write_all, daemon=True)
        writer.start()
        return writer

    def close(self) -> int:
        """Wait for the client to exit; its exit status."""
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.kill()

    def kill(self) -> None:
        """End the client (if still running) and the terminal; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


def long_context(chars: int, paragraph_break: bool = False) -> str:
    """A text of exactly ``chars`` characters from the sample contexts, ending in a marker."""
    body = " ".join(CONTEXTS * (chars // 200 + 1))
    end = " The last sentence says the archive closes at nine."
    text = body[:chars - len(end)] + end
    if paragraph_break:  # an empty line early in the paste
        text = text[:300] + "\n\n" + text[302:]
    assert len(text) == chars
    return text


@pytest.fixture()
def counted(tiny_model_dir: Path) -> Iterator[tuple[InferenceServer, GatedEngine]]:
    """A server whose engine counts the rows (context windows) it runs; gate open."""
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          batching="off")
    with InferenceServer(config, engine_factory=lambda: engine) as srv:
        yield srv, engine


@pytest.fixture()
def terminals() -> Iterator[list[Terminal]]:
    """Terminals a test opens; each is killed at the end, whether the test passed or not."""
    opened: list[Terminal] = []
    yield opened
    for term in opened:
        term.kill()


def rows_for(srv: InferenceServer, question: str, context: str) -> int:
    assert srv.backend.task is not None
    return srv.backend.task.preprocess(question, context).rows


def test_a_20000_character_line_pasted_in_a_terminal_reaches_the_server_whole(
        counted: tuple[InferenceServer, GatedEngine], terminals: list[Terminal]) -> None:
    srv, engine = counted
    context = long_context(20_000)
    assert rows_for(srv, QUESTIONS[0], context) > rows_for(srv, QUESTIONS[0],
                                                           context[:TERMINAL_LINE_LIMIT])
    term = Terminal("--host", srv.address[0], "--port", str(srv.address[1]))
    terminals.append(term)
    intro = term.read_until("text (end with an empty line)> ")
    assert intro.count("NOT MEANINGFUL") == 1  # said once, visibly, before anything else
    assert "empty line" in intro and "new text" in intro and "Ctrl+D quits" in intro
    writer = term.type(context + "\n\n")  # a paste as a terminal without paste marks sends it
    term.read_until("(20,000 characters)")
    writer.join(30)
    rows_before = engine.rows_run
    term.type(QUESTIONS[0] + "\n")
    assert "answer: " in term.read_until("latency: ")
    assert engine.rows_run - rows_before == rows_for(srv, QUESTIONS[0], context)  # all of it
    term.read_until("question (empty: new text)> ")
    term.type("\n")  # a new text
    term.read_until("text (end with an empty line)> ")
    term.type("\x04")  # Ctrl+D quits
    assert term.close() == 0


def test_a_bracketed_paste_keeps_its_empty_lines_and_an_empty_text_gets_a_message(
        counted: tuple[InferenceServer, GatedEngine], terminals: list[Terminal]) -> None:
    srv, engine = counted
    context = long_context(6_000, paragraph_break=True)
    term = Terminal("--host", srv.address[0], "--port", str(srv.address[1]))
    terminals.append(term)
    term.read_until("text (end with an empty line)> ")
    term.type("\n")  # Enter with no text
    assert "empty text" in term.read_until("text (end with an empty line)> ")
    term.type("\x1b[200~" + context + "\n\x1b[201~").join(30)  # as a terminal marks a paste
    term.type("\n")  # then the user's Enter on an empty line
    term.read_until("(6,000 characters)")
    rows_before = engine.rows_run
    term.type(QUESTIONS[5] + "\n")
    term.read_until("latency: ")
    assert engine.rows_run - rows_before == rows_for(srv, QUESTIONS[5], context)
    term.read_until("question (empty: new text)> ")
    term.type("\x04")  # Ctrl+D at a question quits too
    assert term.close() == 0
    assert BRACKETED_PASTE_ON in term.screen and term.screen.count(BRACKETED_PASTE_ON) == \
        term.screen.count(BRACKETED_PASTE_OFF)  # the terminal is left as it was found


def test_typed_lines_end_at_an_empty_line_and_editing_keys_work() -> None:
    buffer = TextBuffer()
    echo = buffer.feed("Ada wrot\x7fte\x1b[D the notes.\nIn 1843.\n")
    assert buffer.text == "Ada wrote the notes.\nIn 1843." and not buffer.blank_pending
    assert "\b \b" in echo and "\x1b" not in echo  # backspace rubs out; arrow keys are dropped
    buffer.feed("\n")
    assert buffer.blank_pending  # an Enter on an empty line: the end, unless more follows at once
    buffer.feed("More.")
    assert buffer.text == "Ada wrote the notes.\nIn 1843.\n\nMore." and not buffer.blank_pending


def test_empty_lines_inside_a_marked_paste_never_end_the_text() -> None:
    buffer = TextBuffer()
    buffer.feed("\x1b[200~One.\n\n\nTwo.\n")
    assert not buffer.blank_pending and buffer.pasting
    buffer.feed("\x1b[201~\n")
    assert buffer.blank_pending and not buffer.pasting
    assert buffer.text == "One.\n\n\nTwo."


def test_ctrl_d_ends_the_text_and_drops_what_follows() -> None:
    buffer = TextBuffer()
    buffer.feed("Short text\x04ignored")
    assert buffer.ended and buffer.text == "Short text"


def test_piped_input_takes_one_line_per_text_of_any_length(
        counted: tuple[InferenceServer, GatedEngine]) -> None:
    srv, engine = counted
    context = long_context(20_000)
    rows_before = engine.rows_run
    done = subprocess.run([sys.executable, "client.py", "--host", srv.address[0], "--port",
                           str(srv.address[1])], cwd=ROOT, input=f"{context}\n{QUESTIONS[1]}\n",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "(20,000 characters)" in done.stdout
    assert done.stdout.count("answer: ") == 1 and done.stdout.count("NOT MEANINGFUL") == 1
    assert engine.rows_run - rows_before == rows_for(srv, QUESTIONS[1], context)


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])  # stdin: surrogateescape, then strict
def test_piped_bytes_that_are_not_utf8_are_replaced_not_fatal(
        counted: tuple[InferenceServer, GatedEngine], locale: str) -> None:
    srv, _ = counted
    done = subprocess.run([sys.executable, "client.py", "--host", srv.address[0], "--port",
                           str(srv.address[1])], cwd=ROOT,
                          input=CONTEXTS[0].encode() + b"\n" + b"Who \xff?\n",
                          capture_output=True, timeout=120,
                          env={**os.environ, "LC_ALL": locale, "PYTHONIOENCODING": ""})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.count(b"answer: ") == 1 and b"Traceback" not in done.stderr


def test_an_embed_model_in_a_terminal_compares_two_pasted_texts(
        tmp_path: Path, terminals: list[Terminal]) -> None:
    from tests.text_models import build_tiny_embed_dir

    config = ServerConfig(port=0, model_dir=str(build_tiny_embed_dir(tmp_path / "emb")),
                          num_inference_sessions=1, threads_per_session=1)
    with InferenceServer(config) as srv:
        term = Terminal("--host", srv.address[0], "--port", str(srv.address[1]))
        terminals.append(term)
        intro = term.read_until("first text (end with an empty line)> ")
        assert "model emb (embed)" in intro and intro.count("random weights") == 1
        assert "cosine similarity" in intro and "Ctrl+D quits" in intro
        text = long_context(6_000, paragraph_break=True)
        term.type("\x1b[200~" + text + "\n\x1b[201~").join(30)  # a marked paste, then Enter
        term.type("\n")
        term.read_until("second text (end with an empty line)> ")
        term.type("\x1b[200~" + text + "\x1b[201~").join(30)  # the same text, whole again
        term.type("\n\n")
        shown = term.read_until("latency: ")
        assert "cosine similarity: 1.0000  dim: 32" in shown
        term.read_until("first text (end with an empty line)> ")
        term.type("\x04")
        assert term.close() == 0


@pytest.fixture()
def server_process(tiny_model_dir: Path, tmp_path: Path) -> Iterator[int]:
    """``python server.py`` with its defaults on a repository like the default one (a qa model
    and an embed model, tiny here), on a free port; yields the port."""
    repository = tmp_path / "saved_models"
    shutil.copytree(tiny_model_dir, repository / "qa")
    build_tiny_embed_dir(repository / "embed")
    address_file = tmp_path / "address"
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "server.py", "--port", "0", "--model_dir",
                                 str(repository), "--address_file", str(address_file)],
                                cwd=ROOT, stdout=log, stderr=log)
    try:
        wait_until(lambda: address_file.exists() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        yield int(address_file.read_text().rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(60)


def test_the_repl_of_a_server_with_a_qa_model_starts_in_qa_and_answers(
        server_process: int, terminals: list[Terminal]) -> None:
    term = Terminal("--port", str(server_process))  # no --model: the defaults
    terminals.append(term)
    intro = term.read_until("text (end with an empty line)> ")
    assert PICK_PROMPT not in intro and "model qa (qa)" in intro
    assert intro.count("NOT MEANINGFUL") == 1
    hint = [line for line in intro.splitlines() if "/model NAME" in line]
    assert len(hint) == 1 and "/models" in hint[0] and "embed (embed)" in hint[0]
    term.type(CONTEXTS[0] + "\n\n")
    term.read_until(f"({len(CONTEXTS[0])} characters)")
    term.read_until("question (empty: new text)> ")
    term.type(QUESTIONS[0] + "\n")
    answer = term.read_until("latency: ")
    assert "answer: " in answer and "error" not in answer
    term.read_until("question (empty: new text)> ")
    term.type("\x04")
    assert term.close() == 0


def _model(name: str, op: str) -> dict[str, object]:
    """An entry of the ``models`` op."""
    return {"name": name, "task": op, "op": op, "inputs": {}, "meaningful": True, "ready": True}


def test_the_first_model_is_the_qa_one_named_qa_else_the_first_qa_by_name() -> None:
    embed, qa, qa_b, qa_z = (_model("embed", "embed"), _model("qa", "qa"), _model("b", "qa"),
                             _model("z", "qa"))
    assert choose_model([embed, qa_z, qa, qa_b], None) is qa
    assert choose_model([embed, qa_z, qa_b], None) is qa_b
    assert choose_model([embed, qa_z, qa_b], "embed") is embed  # --model says otherwise
    assert default_qa([embed, _model("cls", "classify")]) is None
    assert choose_model([embed], None) is embed  # no qa model: the only one
