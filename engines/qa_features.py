"""One QA request as windows of tokens: the arrays the engine needs, built cheaply.

Only what every request needs is turned into numpy arrays: token ids, type ids, lengths and
which tokens may be part of an answer. Character offsets and word spans stay in the Rust
encodings and are read there, token by token, for the few spans an answer could come from
(``QAFeatures.offsets`` and ``word_spans`` build the full arrays on demand, for tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
from tokenizers import Encoding

from protocol.errors import BadRequest


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare by identity
class QAFeatures:
    """One request as windows of tokens, right-padded to its longest window (read-only arrays).

    Attributes:
        context: The original context string; answers are cut from it.
        input_ids: ``[rows, max_len]`` token ids, padded with the tokenizer's pad id.
        token_type_ids: ``[rows, max_len]`` segment ids (0 question, 1 context), padded with 0.
        lengths: ``[rows]`` tokens in each window.
        allowed: ``[rows, max_len]`` bool: tokens that may start or end an answer (context, CLS).
        windows: The Rust encoding of each window, for offsets and words.
    """

    context: str
    input_ids: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray
    allowed: np.ndarray
    windows: tuple[Encoding, ...]

    @property
    def rows(self) -> int:
        """Number of windows, i.e. rows this request takes in a batch."""
        return int(self.input_ids.shape[0])

    @property
    def max_len(self) -> int:
        """Tokens in the longest window."""
        return int(self.input_ids.shape[1])

    @property
    def offsets(self) -> np.ndarray:
        """``[rows, max_len, 2]`` each token's character span in its own text (built on demand)."""
        out = np.zeros((self.rows, self.max_len, 2), dtype=np.int64)
        for row, window in enumerate(self.windows):
            out[row, :len(window)] = np.array(window.offsets, dtype=np.int64).reshape(-1, 2)
        return out

    @property
    def word_spans(self) -> np.ndarray:
        """``[rows, max_len, 2]`` per token, ``word_to_chars(token_to_word(t), sequence_index=1)``
        in its window, or -1 (built on demand)."""
        out = np.full((self.rows, self.max_len, 2), -1, dtype=np.int64)
        for row, window in enumerate(self.windows):
            for token in range(len(window)):
                span = word_chars(window, token)
                if span is not None:
                    out[row, token] = span
        return out


def word_chars(window: Encoding, token: int) -> tuple[int, int] | None:
    """Characters of the context word with ``token``'s word index, or None, as the pipeline
    finds them: a word cut by the window's edge is cut too, and a question token finds the
    context word with its index."""
    word = window.token_to_word(token)
    return None if word is None else window.word_to_chars(word, 1)


def token_chars(window: Encoding, token: int) -> tuple[int, int]:
    """Characters of one token in its own text ((0, 0) for a special token)."""
    span = window.token_to_chars(token)
    return span if span is not None else window.offsets[token]


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
    allowed = ids == cls_id if cls_id is not None else np.zeros(ids.shape, dtype=bool)
    for row, tokens in enumerate(contexts):
        allowed[row, tokens] = True
    if mask is not None:
        allowed &= mask
    lengths_array = np.array(lengths, dtype=np.int64)
    for array in (ids, types, allowed, lengths_array):
        array.flags.writeable = False
    return QAFeatures(context, ids, types, lengths_array, allowed, tuple(windows))


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
