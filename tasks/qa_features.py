"""One QA request as windows of tokens: the arrays the engine needs, built cheaply.

Only what every request needs is turned into numpy arrays: token ids, type ids, lengths and
which tokens may be part of an answer. Character offsets and word spans stay in the Rust
encodings and are read there, token by token, for the few spans an answer could come from
(``QAFeatures.offsets`` and ``word_spans`` build the full arrays on demand, for tests). Two
kinds of ``WindowSpans`` read them: ``EncodingSpans`` from one encoding per window (the
tokenizer's own windowing), ``ContextSpans`` from one encoding of the whole context, for windows
cut from it by tasks/qa_windows.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
from tokenizers import Encoding

from protocol.errors import BadRequest
from protocol.qa_options import QAOptions
from tasks.rows import RowShape


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare by identity
class QAFeatures(RowShape):
    """One request as windows of tokens, right-padded to its longest window (read-only arrays).

    Attributes:
        context: The original context string; answers are cut from it.
        input_ids: ``[rows, max_len]`` token ids, padded with the tokenizer's pad id.
        token_type_ids: ``[rows, max_len]`` segment ids (0 question, 1 context), padded with 0.
        lengths: ``[rows]`` tokens in each window.
        allowed: ``[rows, max_len]`` bool: tokens that may start or end an answer (context, CLS).
        spans: Characters of each window's tokens and words, read from the Rust encodings.
        options: The request's own answering options (None: the task's settings).
    """

    context: str
    input_ids: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray
    allowed: np.ndarray
    spans: WindowSpans
    options: QAOptions | None = None

    @property
    def offsets(self) -> np.ndarray:
        """``[rows, max_len, 2]`` each token's character span in its own text (built on demand)."""
        out = np.zeros((self.rows, self.max_len, 2), dtype=np.int64)
        for row, n in enumerate(self.lengths.tolist()):
            for token in range(n):
                out[row, token] = self.spans.token_chars(row, token)
        return out

    @property
    def word_spans(self) -> np.ndarray:
        """``[rows, max_len, 2]`` per token, ``word_to_chars(token_to_word(t), sequence_index=1)``
        in its window, or -1 (built on demand)."""
        out = np.full((self.rows, self.max_len, 2), -1, dtype=np.int64)
        for row, n in enumerate(self.lengths.tolist()):
            for token in range(n):
                span = self.spans.word_chars(row, token)
                if span is not None:
                    out[row, token] = span
        return out


class WindowSpans(Protocol):
    """Characters of the tokens and words of a request's windows."""

    def token_chars(self, row: int, token: int) -> tuple[int, int]:
        """Characters of one token in its own text ((0, 0) for a special token)."""

    def word_chars(self, row: int, token: int) -> tuple[int, int] | None:
        """Characters of the context word with ``token``'s word index, or None, as the pipeline
        finds them: a word cut by the window's edge is cut too, and a question token finds the
        context word with its index."""


class EncodingSpans:
    """``WindowSpans`` of windows the tokenizer cut itself: one Rust encoding per window."""

    __slots__ = ("windows",)

    def __init__(self, windows: Sequence[Encoding]) -> None:
        self.windows = tuple(windows)

    def token_chars(self, row: int, token: int) -> tuple[int, int]:
        """See ``WindowSpans``."""
        window = self.windows[row]
        span = window.token_to_chars(token)
        return span if span is not None else window.offsets[token]

    def word_chars(self, row: int, token: int) -> tuple[int, int] | None:
        """See ``WindowSpans``."""
        window = self.windows[row]
        word = window.token_to_word(token)
        return None if word is None else window.word_to_chars(word, 1)


class ContextSpans:
    """``WindowSpans`` of windows cut from one encoding of the whole context (engines/
    qa_windows.py): window ``row`` holds the context's tokens ``bounds[row]`` from position
    ``first`` on, and the question's tokens from position ``question_at`` on."""

    __slots__ = ("question", "context", "bounds", "question_at", "first", "_edges")

    def __init__(self, question: Encoding, context: Encoding, bounds: Sequence[tuple[int, int]],
                 question_at: int, first: int) -> None:
        self.question, self.context, self.bounds = question, context, tuple(bounds)
        self.question_at, self.first = question_at, first
        self._edges: dict[int, tuple[int | None, int | None]] = {}  # row -> words at its edges

    def token_chars(self, row: int, token: int) -> tuple[int, int]:
        """See ``WindowSpans``."""
        start, stop = self.bounds[row]
        if 0 <= token - self.first < stop - start:
            return self.context.token_to_chars(start + token - self.first)
        if 0 <= token - self.question_at < len(self.question):
            return self.question.token_to_chars(token - self.question_at)
        return 0, 0

    def word_chars(self, row: int, token: int) -> tuple[int, int] | None:
        """See ``WindowSpans``."""
        start, stop = self.bounds[row]
        if 0 <= token - self.first < stop - start:
            word = self.context.token_to_word(start + token - self.first)
            if word is None:
                return None
            if row not in self._edges:
                self._edges[row] = (self.context.token_to_word(start),
                                    self.context.token_to_word(stop - 1))
            if word not in self._edges[row]:  # not cut by the window's edge: all of it
                return self.context.word_to_chars(word)
        elif 0 <= token - self.question_at < len(self.question):
            word = self.question.token_to_word(token - self.question_at)
            if word is None:
                return None
        else:
            return None
        return self._cut_word(word, start, stop)

    def _cut_word(self, word: int, start: int, stop: int) -> tuple[int, int] | None:
        """Characters of the part of ``word`` inside tokens ``[start, stop)``, or None."""
        tokens = self.context.word_to_tokens(word)
        if tokens is None:
            return None
        first, last = max(tokens[0], start), min(tokens[1], stop) - 1
        if first > last:  # the word lies outside this window
            return None
        return self.context.token_to_chars(first)[0], self.context.token_to_chars(last)[1]


def build_features(context: str, windows: Sequence[Encoding], pad_id: int, cls_id: int | None,
                   check_question: bool) -> QAFeatures:
    """Arrays of ``windows``, the encodings of one (question, context) pair.

    Args:
        check_question: Refuse a question without tokens (when it was not counted before).

    Raises:
        BadRequest: The question (if checked) or the context has no tokens.
    """
    contexts = [_context_tokens(window, check_question and row == 0)
                for row, window in enumerate(windows)]
    lengths = [len(window) for window in windows]
    ids, types, mask = _token_arrays(windows, lengths, pad_id)
    return assemble(context, ids, types, lengths, contexts, mask, cls_id, EncodingSpans(windows))


def assemble(context: str, ids: np.ndarray, types: np.ndarray, lengths: list[int],
             contexts: Sequence[slice | np.ndarray], mask: np.ndarray | None,
             cls_id: int | None, spans: WindowSpans) -> QAFeatures:
    """Features from padded ``[rows, longest]`` token and type ids: the tokens allowed in an
    answer are each row's ``contexts`` and any CLS, never padding (``mask``: True where not
    padding; None when no row is padded)."""
    allowed = ids == cls_id if cls_id is not None else np.zeros(ids.shape, dtype=bool)
    for row, tokens in enumerate(contexts):
        allowed[row, tokens] = True
    if mask is not None:
        allowed &= mask
    lengths_array = np.array(lengths, dtype=np.int64)
    for array in (ids, types, allowed, lengths_array):
        array.flags.writeable = False
    return QAFeatures(context, ids, types, lengths_array, allowed, spans)


def _context_tokens(window: Encoding, check_question: bool) -> slice | np.ndarray:
    """The context tokens of a window: a slice when they are contiguous, as a pair template
    that holds the context once makes them, else their indices."""
    sequence_ids = window.sequence_ids
    if check_question and 0 not in sequence_ids:
        raise BadRequest("question has no tokens")
    try:
        start = sequence_ids.index(1)
    except ValueError:
        raise BadRequest("context has no tokens") from None
    end = len(sequence_ids) - sequence_ids[::-1].index(1)
    if sequence_ids.count(1) == end - start:
        return slice(start, end)
    return np.flatnonzero([sequence == 1 for sequence in sequence_ids])


def _token_arrays(windows: Sequence[Encoding], lengths: list[int],
                  pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Token ids and type ids ``[rows, longest]``, and where they are not padding (None when
    no window is shorter than the longest)."""
    longest, total = max(lengths), sum(lengths)
    ids = np.fromiter(chain.from_iterable(w.ids for w in windows), np.int64, total)
    if total == longest * len(windows):
        return ids.reshape(-1, longest), _type_ids(windows, lengths, longest), None
    mask = np.arange(longest) < np.array(lengths)[:, None]
    padded_ids = np.full(mask.shape, pad_id, dtype=np.int64)
    padded_ids[mask] = ids
    return padded_ids, _type_ids(windows, lengths, longest), mask


def _type_ids(windows: Sequence[Encoding], lengths: list[int], longest: int) -> np.ndarray:
    """Type ids ``[rows, longest]``, padded with 0. A window's usual type ids, zeros then ones,
    are written as such (cheaper than converting every one); others are converted."""
    out = np.zeros((len(windows), longest), dtype=np.int64)
    for row, (window, n) in enumerate(zip(windows, lengths)):
        types = window.type_ids
        ones = types.count(1)
        if types[n - ones:].count(1) == ones and types.count(0) == n - ones:
            out[row, n - ones:n] = 1
        else:
            out[row, :n] = types
    return out
