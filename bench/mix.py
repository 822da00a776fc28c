"""The request mix of stress_test.py and the benchmarks: (question, context) pairs for qa, and
texts for embed and classify, from a JSON-lines file or a JSON list of objects (the shipped mix is
``bench/data/qa_pairs.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.figures import check_positive
from bench.loadgen import Item

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "qa_pairs.jsonl"
#: The tasks stress_test.py loads a server with: the op of their requests.
TASKS = ("qa", "embed", "classify")


def load_pairs(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(question, context) pairs from a JSON-lines file or a JSON list of objects.

    Each object needs string ``question`` and ``context`` fields; other fields are ignored.

    Args:
        path: The file; None: the shipped mix, ``bench/data/qa_pairs.jsonl``.

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not valid JSON, an object lacks a field, or it holds no pairs.
    """
    path, records = _records(path)
    pairs = [_pair(record, where) for where, record in records]
    if not pairs:
        raise ValueError(f"{path} holds no question/context pairs")
    return pairs


def load_texts(path: str | Path | None = None) -> list[str]:
    """The texts of a mix, for embed and classify: each object's ``text``, or else its
    ``question`` and its ``context`` (so the shipped mix gives short and long texts alike).

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not valid JSON, an object has none of those string fields, or it
            holds no texts.
    """
    path, records = _records(path)
    texts = [text for where, record in records for text in _texts(record, where)]
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return texts


def load_mix(task: str = "qa", path: str | Path | None = None,
             texts_per_request: int = 1) -> list[Item]:
    """The requests of ``task`` made from a mix: (question, context) pairs for qa,
    ``{"texts": [...]}`` of ``texts_per_request`` consecutive texts for embed (one request per
    text of the mix, starting there, wrapping round), ``{"text": ...}`` for classify.

    Raises:
        OSError, ValueError: As ``load_pairs`` and ``load_texts``; an unknown task.
    """
    check_positive(texts_per_request=texts_per_request)
    if task == "qa":
        return list(load_pairs(path))
    texts = load_texts(path)
    if task == "classify":
        return [{"text": text} for text in texts]
    if task == "embed":
        n = len(texts)
        return [{"texts": [texts[(i * texts_per_request + j) % n]
                           for j in range(texts_per_request)]} for i in range(n)]
    raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")


def _records(path: str | Path | None) -> tuple[Path, list[tuple[str, Any]]]:
    """The file's path and its objects, each with where it is ("FILE, line N")."""
    path = Path(path) if path is not None else DEFAULT_DATA
    text = path.read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("["):
        records = list(enumerate(json.loads(text)))
        where = "item"
    else:
        records = [(n, _json_line(path, n, line)) for n, line in enumerate(text.splitlines(), 1)
                   if line.strip()]
        where = "line"
    return path, [(f"{path}, {where} {n}", record) for n, record in records]


def _json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None


def _pair(record: Any, where: str) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'question' and 'context'")
    for field in ("question", "context"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{where}: field {field!r} must be a string")
    return record["question"], record["context"]


def _texts(record: Any, where: str) -> list[str]:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return [record["text"]]
    texts = [record[f] for f in ("question", "context")
             if isinstance(record, dict) and isinstance(record.get(f), str)]
    if not texts:
        raise ValueError(f"{where}: expected an object with a string 'text', or 'question' "
                         "and 'context'")
    return texts
