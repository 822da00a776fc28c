"""What the REPL does for each task: qa (a text, then questions about it), embed (two texts, then
their cosine similarity), classify (a text, then its label) and, for a plug-in task, each of its
input fields, then its result. Each mode loops until the input ends or the model is switched."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from clients.blocking import Client
from console.session import Session
from protocol import ServerError

TEXT_PROMPT = "\ntext (end with an empty line)> "
QUESTION_PROMPT = "question (empty: new text)> "
FIRST_PROMPT = "\nfirst text (end with an empty line)> "
SECOND_PROMPT = "second text (end with an empty line)> "
EMPTY_TEXT = ("  (empty text: paste or type a text, then press Enter on an empty line; "
              "Ctrl+D quits)")

HELP = {
    "qa": "Paste or type a text, then press Enter on an empty line; ask questions about it, one "
          "per line.\nAn empty question asks for a new text. Ctrl+D quits.",
    "embed": "Paste or type two texts, each ended by an empty line: their cosine similarity "
             "follows.\nCtrl+D quits.",
    "classify": "Paste or type a text, then press Enter on an empty line: its label and score "
                "follow.\nCtrl+D quits.",
}
GENERIC_HELP = "Type each input field, ended by an empty line: the result follows. Ctrl+D quits."


def print_answer(result: dict[str, Any], elapsed_ms: float) -> None:
    """Print one qa answer."""
    answer = result["answer"] or "(no answer)"
    print(f"  answer: {answer}")
    print(f"  score: {result['score']:.4f}  span: [{result['start']}, {result['end']})  "
          f"latency: {elapsed_ms:.1f} ms")


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 if either is all zeros)."""
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0


def print_similarity(result: dict[str, Any], elapsed_ms: float) -> None:
    """Print the cosine similarity of the two embeddings of an embed result."""
    first, second = result["embeddings"]
    print(f"  cosine similarity: {cosine(first, second):.4f}  dim: {result['dim']}  "
          f"latency: {elapsed_ms:.1f} ms")


def print_label(result: dict[str, Any], elapsed_ms: float) -> None:
    """Print a classify result: the label and its score, then every label's probability."""
    print(f"  label: {result['label']}  score: {result['score']:.4f}  "
          f"latency: {elapsed_ms:.1f} ms")
    ranked = sorted(result.get("scores", {}).items(), key=lambda item: -item[1])
    print("  scores: " + "  ".join(f"{label} {p:.4f}" for label, p in ranked))


def print_result(result: dict[str, Any], elapsed_ms: float) -> None:
    """Print any result map, one field a line (long values cut)."""
    for key, value in result.items():
        text = repr(value)
        print(f"  {key}: {text if len(text) <= 200 else text[:197] + '...'}")
    print(f"  latency: {elapsed_ms:.1f} ms")


def timed(session: Session, call: Callable[[Client], dict[str, Any]],
          show: Callable[[dict[str, Any], float], None]) -> None:
    """Run one request through the session and show its result, or its error."""
    started = time.perf_counter()
    try:
        result = session.run(call)
    except ServerError as exc:
        print(f"  error [{exc.code}]: {exc.message}")
        return
    show(result, (time.perf_counter() - started) * 1000)


def next_text(session: Session, prompt: str, first: str | None) -> str:
    """``first`` if given, else a text from the user; an empty one is said to be empty."""
    text = first or session.read_text(prompt)
    if not text:
        print(EMPTY_TEXT)
    return text


def qa_mode(session: Session, first: str | None = None) -> None:
    """A text, then questions about it until an empty one; again."""
    while True:
        text, first = next_text(session, TEXT_PROMPT, first), None
        if not text:
            continue
        print(f"  ({len(text):,} characters)")
        while question := session.read_line(QUESTION_PROMPT):
            timed(session, lambda c, q=question, t=text: c.answer(q, t, model=session.name),
                  print_answer)


def embed_mode(session: Session, first: str | None = None) -> None:
    """Two texts, then their cosine similarity; again."""
    while True:
        one, first = next_text(session, FIRST_PROMPT, first), None
        two = next_text(session, SECOND_PROMPT, None) if one else ""
        if one and two:
            timed(session, lambda c, texts=[one, two]: c.call("embed", {"texts": texts},
                                                                model=session.name),
                  print_similarity)


def classify_mode(session: Session, first: str | None = None) -> None:
    """A text, then its label and score; again."""
    while True:
        text, first = next_text(session, TEXT_PROMPT, first), None
        if text:
            timed(session, lambda c, t=text: c.classify(t, model=session.name), print_label)


def generic_mode(session: Session, first: str | None = None) -> None:
    """A plug-in task: each input field the ``models`` op lists (a field described as an array
    gets the text as its one item), then the result."""
    inputs: dict[str, str] = session.model.get("inputs", {})
    op = session.model["op"]
    while True:
        if not inputs:
            session.read_line("(Enter sends a request)> ")
        fields: dict[str, Any] = {}
        for field, description in inputs.items():
            text, first = next_text(session, f"\n{field} ({description})> ", first), None
            if not text:
                break
            fields[field] = [text] if "array" in description.lower() else text
        else:
            timed(session, lambda c, f=fields: c.call(op, f, model=session.name), print_result)


MODES: dict[str, Callable[[Session, str | None], None]] = {
    "qa": qa_mode, "embed": embed_mode, "classify": classify_mode}
"""Op -> the REPL's loop for it; any other op gets ``generic_mode``."""
