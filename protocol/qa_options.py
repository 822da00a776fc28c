"""A ``qa`` request's optional answering parameters: those of transformers'
``pipeline("question-answering")`` that change how answers are chosen, not how the text is cut
into windows (``max_seq_len`` and ``doc_stride`` are the server's settings).

Each is optional; absent or nil, the server's setting holds (``--max_answer_len``,
``--no_answer``; one answer; spans widened to whole words).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import BadRequest
from protocol.fields import is_bool, is_int, take

#: Most answers one request may ask for (``top_k``).
MAX_TOP_K = 20
#: Longest answer, in tokens, a request may ask for (``max_answer_len``).
MAX_ANSWER_LEN = 512
#: The request fields read here, in the pipeline's names.
QA_OPTION_FIELDS = ("top_k", "max_answer_len", "handle_impossible_answer", "align_to_words")


@dataclass(frozen=True, kw_only=True, slots=True)
class QAOptions:
    """How one request's answers are chosen; None: the server's setting.

    Attributes:
        top_k: Answers to return, best first (1: one answer, as without it).
        max_answer_len: Most tokens in an answer.
        handle_impossible_answer: Whether "no answer" (``""``, start = end = 0) may win.
        align_to_words: Widen spans to whole words.
    """

    top_k: int = 1
    max_answer_len: int | None = None
    handle_impossible_answer: bool | None = None
    align_to_words: bool | None = None


def _is_top_k(value: object) -> bool:
    return is_int(value) and 1 <= value <= MAX_TOP_K  # type: ignore[operator]


def _is_answer_len(value: object) -> bool:
    return is_int(value) and 1 <= value <= MAX_ANSWER_LEN  # type: ignore[operator]


def parse_qa_options(obj: Mapping[Any, Any], request_id: int) -> QAOptions | None:
    """The options a ``qa`` request map carries; None when it carries none (the usual case).

    Raises:
        BadRequest: an option of the wrong type or out of range, naming it.
    """
    given = {name: obj[name] for name in QA_OPTION_FIELDS if obj.get(name) is not None}
    if not given:
        return None
    checks = {"top_k": (_is_top_k, f"an int from 1 to {MAX_TOP_K}"),
              "max_answer_len": (_is_answer_len, f"an int from 1 to {MAX_ANSWER_LEN}"),
              "handle_impossible_answer": (is_bool, "a bool"),
              "align_to_words": (is_bool, "a bool")}
    values = {name: take(given, name, *checks[name], BadRequest, request_id) for name in given}
    return QAOptions(**values)
