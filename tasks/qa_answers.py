"""Choosing one answer from a request's start and end logits, as transformers' pipeline does.

Per window: a softmax over context tokens and CLS, the best spans of at most ``max_answer_len``
tokens (score ``start[s] * end[e]``), widened to whole words; over the windows, same-text
candidates (ignoring case) merged by adding scores, and an optional "no answer" scored by the
smallest null (CLS) score. The picks and the arithmetic are the pipeline's (transformers 4.57,
top_k=1) in every case: a window whose best spans tie takes the exact full search.

Written for a server where many threads share one GIL: every numpy call here works on one
window (at most ``max_seq_len`` values, or a few hundred cells) and no call sorts, because numpy
lets go of the GIL for sorts and for loops over more than 500 values, and each time it does,
this thread waits for it behind a whole tokenizer encode and comes back to cold caches.

The search for a window's best spans runs in C (tasks/_span_search.c) where that extension is
built, and answers the same; without it, or with ``QA_SPAN_SEARCH=numpy`` in the environment,
numpy searches. ``span_search()`` says which one a process uses.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from tasks.base import non_finite
from tasks.qa_features import QAFeatures, WindowSpans

TOP_K = 1  # answers per request
MASKED_LOGIT = np.float32(-10000.0)  # logit given to tokens that cannot be part of an answer
NO_NULL_SCORE = 1000000.0  # starting value of the running minimum of the null score
NO_ANSWER = {"answer": "", "score": 0.0, "start": 0, "end": 0}

Span = tuple[int, int, float]  # start token, end token, score
Spans = tuple[np.ndarray, np.ndarray, np.ndarray]  # start tokens, end tokens, scores


def _native_search() -> tuple[Any, int, str | None]:
    """The C span search: ``top_cells``, the most spans a window it keeps, and None; or
    ``(None, 0, why numpy searches)`` when it is turned off or not built."""
    if os.environ.get("QA_SPAN_SEARCH", "").lower() == "numpy":
        return None, 0, "turned off by QA_SPAN_SEARCH=numpy"
    try:
        from tasks import _span_search
    except ImportError:
        return None, 0, "not built (python setup.py build_ext --inplace)"
    return _span_search.top_cells, _span_search.MAX_TOP_K, None


_top_cells, _native_top_k, _numpy_reason = _native_search()


def span_search() -> str:
    """Which span search this process uses: ``"c"`` or ``"numpy"``."""
    return "numpy" if _top_cells is None else "c"


def numpy_search_reason() -> str | None:
    """Why this process searches in numpy (the C search is off or not built); None with C."""
    return _numpy_reason


def ranked_answers(features: QAFeatures, start_logits: np.ndarray, end_logits: np.ndarray, *,
                   max_answer_len: int, align_to_words: bool, impossible: bool,
                   top_k: int = TOP_K) -> list[dict[str, Any]]:
    """The ``top_k`` best answers over all windows of one request, best first, as the
    pipeline's ``top_k`` gives them (never empty: "no answer" where nothing is left)."""
    per_window = 2 * top_k + 10 if align_to_words else top_k  # room for merging
    candidates: dict[str, list[Any]] = {}  # lower-cased text -> [score, start, end, text]
    null_score = NO_NULL_SCORE
    for row, n in enumerate(features.lengths.tolist()):
        allowed = features.allowed[row, :n]
        start = window_probabilities(start_logits[row, :n], allowed)
        end = window_probabilities(end_logits[row, :n], allowed)
        null_score = min(null_score, float(start[0] * end[0]))
        start[0] = end[0] = 0.0
        words: dict[int, tuple[int, int] | None] | None = {} if align_to_words else None
        for s, e, score in top_spans(start, end, per_window, max_answer_len):
            if _usable(allowed, s) and _usable(allowed, e):  # dropped after the top_k are chosen
                char_start, char_end = _char_span(features.spans, row, s, e, words)
                text = features.context[char_start:char_end]
                known = candidates.setdefault(text.lower(), [0.0, char_start, char_end, text])
                known[0] += score  # a text seen before keeps its first position and adds up
    ranked = list(candidates.values())
    if impossible:
        ranked.append([null_score, 0, 0, ""])
    if not ranked:  # every candidate was dropped (the pipeline would return [])
        return [dict(NO_ANSWER)]
    if top_k == 1:  # the first of equals wins, as in the stable sort below
        ranked = [max(ranked, key=_score)]
    else:
        ranked = sorted(ranked, key=_score, reverse=True)[:top_k]
    return [{"answer": text, "score": float(score), "start": char_start, "end": char_end}
            for score, char_start, char_end, text in ranked]


def window_probabilities(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax of one window's logits ``[n]`` (float32) where tokens outside ``allowed`` get
    ~zero mass.

    Raises:
        EngineError: an allowed token's logit is NaN or infinite (its sum shows it: NaN
            spreads, and an infinity becomes NaN once the maximum is taken away).
    """
    masked = np.where(allowed, np.asarray(logits, dtype=np.float32), MASKED_LOGIT)
    exp = np.exp(masked - masked.max())
    total = exp.sum()
    if not math.isfinite(total):
        raise non_finite("logits")
    return exp / total


def top_spans(start: np.ndarray, end: np.ndarray, top_k: int, max_answer_len: int) -> list[Span]:
    """The ``top_k`` best spans of one window ``[n]`` (float32), best first; a span's score is
    ``start[s] * end[e]`` for ``s <= e < s + max_answer_len``, else 0. In C where built and the
    best spans are strictly ranked, else ``numpy_top_spans``: the same spans either way."""
    width = min(max_answer_len, start.shape[0])
    if 1 < top_k <= _native_top_k and width > 0 and _top_cells is not None:
        found: list[Span] | None = _top_cells(start, end, top_k, width)
        if found is not None:
            return found
    return numpy_top_spans(start, end, top_k, max_answer_len)


def numpy_top_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                    max_answer_len: int) -> list[Span]:
    """``top_spans`` in numpy.

    The best cell of start ``i`` is ``start[i] * max(end[i:i + width])`` (rounding is
    monotonic), so only the starts whose best cell reaches the ``top_k + 1``-th best start's
    can hold the ``top_k + 1`` best cells, and only their cells are built and ranked. When
    those are not strictly ranked, the exact search decides, as the pipeline's sort would.
    """
    n = start.shape[0]
    width = min(max_answer_len, n)
    if top_k > 1 and n * width <= top_k:
        return _as_list(top_window_spans(start, end, top_k, max_answer_len))
    padded = np.zeros(n + width - 1, dtype=end.dtype)  # a span's end past the window scores 0
    padded[:n] = end
    best_of_start = start * _sliding_max(padded, width)
    if top_k == 1:  # argmax takes the first of equals, in (start, length) order
        first = int(best_of_start.argmax())
        cells = padded[first:first + width] * start[first]
        length = int(cells.argmax())
        return [(first, first + length, float(cells[length]))]
    threshold = _kth_largest(best_of_start, top_k + 1)
    starts = np.flatnonzero(best_of_start >= threshold)
    cells = padded[starts[:, None] + np.arange(width)] * start[starts, None]  # [starts, length]
    found = np.flatnonzero(cells >= threshold)
    ranked = sorted(zip(cells.reshape(-1)[found].tolist(), found.tolist()), reverse=True)
    ranked = ranked[:top_k + 1]
    if len(ranked) <= top_k or any(a[0] <= b[0] for a, b in zip(ranked, ranked[1:])):
        return _as_list(top_window_spans(start, end, top_k, max_answer_len))
    chosen = starts.tolist()
    return [(chosen[i], chosen[i] + length, score)
            for score, (i, length) in ((score, divmod(cell, width)) for score, cell in ranked[:-1])]


def _sliding_max(values: np.ndarray, width: int) -> np.ndarray:
    """``out[i] = max(values[i:i + width])`` for the ``len(values) - width + 1`` full windows,
    by doubling (a handful of numpy calls, none over more than ``len(values)`` values)."""
    out, covered = values, 1
    while covered * 2 <= width:
        out = np.maximum(out[:-covered], out[covered:])
        covered *= 2
    if covered < width:
        out = np.maximum(out[:len(values) - width + 1], out[width - covered:])
    return out[:len(values) - width + 1]


def _kth_largest(values: np.ndarray, k: int) -> float:
    """The ``k``-th largest of non-negative ``values`` (0.0 when there are fewer), sorting in
    Python only the values near the top."""
    if values.size < k:
        return 0.0
    top = float(values.max())
    for fraction in (0.25, 0.01, 0.0):
        near_top = values[values >= top * fraction]
        if near_top.size >= k:
            break
    return sorted(near_top.tolist(), reverse=True)[k - 1]


def _usable(allowed: np.ndarray, token: int) -> bool:
    """May ``token`` start or end an answer: an allowed token, or token 0 (CLS) of a window
    with any allowed token (the pipeline's quirk)."""
    return bool(allowed[token]) or (token == 0 and bool(allowed.any()))


def _score(item: Any) -> float:
    return item[0]


def _as_list(spans: Spans) -> list[Span]:
    return list(zip(*(column.tolist() for column in spans)))


def top_window_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                     max_answer_len: int) -> Spans:
    """The ``top_k`` best spans of one window ``[n]``: from the band when strictly ranked,
    else from the full score matrix."""
    found = top_band_spans(start, end, top_k, max_answer_len)
    return found or top_matrix_spans(start[None], end[None], top_k, max_answer_len)


def top_band_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                   max_answer_len: int) -> Spans | None:
    """Top spans from the ``[n, max_answer_len]`` band of possible spans, in O(n) work.

    None when ties would make the pipeline's pick depend on how it sorts all n * n cells; when
    the best ``top_k`` are strictly ranked the band gives exactly the pipeline's spans.
    """
    n = start.shape[0]
    width = min(max_answer_len, n)
    span_ends = np.arange(n)[:, None] + np.arange(width)
    scores = np.where(span_ends < n, start[:, None] * end[np.minimum(span_ends, n - 1)],
                      np.float32(0.0))
    flat = scores.reshape(-1)
    if top_k == 1:  # argmax takes the first of equals, in the same (start, end) order
        best = np.array([np.argmax(flat)])
    elif flat.size <= top_k:
        return None
    else:
        best = np.argpartition(-flat, top_k)[:top_k + 1]
        best = best[np.argsort(-flat[best], kind="stable")]
        if not np.all(flat[best[:-1]] > flat[best[1:]]):
            return None
        best = best[:top_k]
    starts, lengths = np.divmod(best, width)
    return starts, starts + lengths, flat[best]


def top_matrix_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                     max_answer_len: int) -> Spans:
    """Top spans from the full ``[n, n]`` score matrix, ties ordered exactly as the pipeline."""
    scores = np.tril(np.triu(np.matmul(start[:, :, None], end[:, None, :])), max_answer_len - 1)
    flat = scores.reshape(-1)
    if top_k == 1:
        order = np.array([np.argmax(flat)])
    elif flat.size < top_k:
        order = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, top_k)[:top_k]
        order = best[np.argsort(-flat[best])]
    starts, ends = np.unravel_index(order, scores.shape[1:])
    return starts, ends, scores[0, starts, ends]


def _char_span(spans: WindowSpans, row: int, start: int, end: int,
               words: dict[int, tuple[int, int] | None] | None) -> tuple[int, int]:
    """Characters of tokens ``start..end``: their whole words when aligning (``words``, a cache
    of each token's word, is given) and both have one, else their own offsets."""
    if words is not None:
        for token in (start, end):
            if token not in words:
                words[token] = spans.word_chars(row, token)
        first, last = words[start], words[end]
        if first is not None and last is not None:
            return first[0], last[1]
    return spans.token_chars(row, start)[0], spans.token_chars(row, end)[1]
