"""Choosing one answer from a request's start and end logits, as transformers' pipeline does.

Per window: a softmax over context tokens and CLS, the best spans of at most ``max_answer_len``
tokens (score ``start[s] * end[e]``), widened to whole words; over the windows, same-text
candidates (ignoring case) merged by adding scores, and an optional "no answer" scored by the
smallest null (CLS) score. Every window of a request is scored at once; a window whose best
spans tie, or that is too short for the band search, takes the exact per-window search, so the
arithmetic and the picks are the pipeline's (transformers 4.57, top_k=1) in every case.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Encoding

from engines.qa_features import QAFeatures, token_chars, word_chars

TOP_K = 1  # answers per request
MASKED_LOGIT = -10000.0  # logit given to tokens that cannot be part of an answer
NO_NULL_SCORE = 1000000.0  # starting value of the running minimum of the null score
NO_ANSWER = {"answer": "", "score": 0.0, "start": 0, "end": 0}

Span = tuple[int, int, float]  # start token, end token, score


def best_answer(features: QAFeatures, logits: np.ndarray, *, max_answer_len: int,
                align_to_words: bool, impossible: bool) -> dict[str, Any]:
    """The best answer over all windows of one request (start and end logits, float32
    ``[2, rows, max_len]``)."""
    lengths = features.lengths.tolist()
    start, end = window_probabilities(logits, features.allowed, lengths)
    null_score = min(NO_NULL_SCORE, *(start[:, 0] * end[:, 0]).tolist())
    start[:, 0] = end[:, 0] = 0.0
    top_k = 2 * TOP_K + 10 if align_to_words else TOP_K  # room for merging
    usable = features.allowed.copy()
    usable[:, 0] = usable.any(axis=1)  # token 0 (CLS) always counts as allowed here
    candidates: dict[str, list[Any]] = {}  # lower-cased text -> [score, start, end, text]
    rows = _top_spans(start, end, lengths, top_k, max_answer_len)
    for window, allowed, spans in zip(features.windows, usable, rows):
        words: dict[int, tuple[int, int] | None] = {}  # token -> its word's characters
        for s, e, score in spans:
            if allowed[s] and allowed[e]:  # dropped only after the top_k are chosen
                char_start, char_end = _char_span(window, s, e, words if align_to_words else None)
                text = features.context[char_start:char_end]
                known = candidates.setdefault(text.lower(), [0.0, char_start, char_end, text])
                known[0] += score  # a text seen before keeps its first position and adds up
    ranked = list(candidates.values())
    if impossible:
        ranked.append([null_score, 0, 0, ""])
    if not ranked:  # every candidate was dropped (the pipeline would return [])
        return dict(NO_ANSWER)
    score, char_start, char_end, text = max(ranked, key=_score)  # the first of equals wins
    return {"answer": text, "score": float(score), "start": char_start, "end": char_end}


def window_probabilities(logits: np.ndarray, allowed: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Softmax of each window (last axis) of ``logits [..., rows, max_len]`` over its own
    tokens, where tokens outside ``allowed`` get ~zero mass and padding exactly zero. A shorter
    window's sum is taken over its own tokens alone: each window's figures are those of a
    softmax of it alone, to the last bit."""
    masked = np.where(allowed, logits, np.float32(MASKED_LOGIT))
    short = [row for row, n in enumerate(lengths) if n < masked.shape[-1]]
    for row in short:
        masked[..., row, lengths[row]:] = -np.inf
    exp = np.exp(masked - masked.max(axis=-1, keepdims=True))
    sums = exp.sum(axis=-1, keepdims=True)
    for row in short:
        sums[..., row, 0] = exp[..., row, :lengths[row]].sum(axis=-1)
    return exp / sums


def _top_spans(start: np.ndarray, end: np.ndarray, lengths: list[int], top_k: int,
               max_answer_len: int) -> list[list[Span]]:
    """Each window's ``top_k`` best spans, best first (see ``top_band_spans``)."""
    rows, width = start.shape[0], min(max_answer_len, start.shape[1])
    regular = [n >= width and (top_k == 1 or n * width > top_k) for n in lengths]
    found: list[list[Span] | None] = [None] * rows
    if any(regular):
        found = _top_band_spans_of_rows(start, end, width, top_k)
    return [spans if spans is not None and regular[row]
            else _as_list(top_window_spans(start[row, :n], end[row, :n], top_k, max_answer_len))
            for row, (spans, n) in enumerate(zip(found, lengths))]


def _top_band_spans_of_rows(start: np.ndarray, end: np.ndarray, width: int,
                            top_k: int) -> list[list[Span] | None]:
    """``top_band_spans`` of every window at once, for windows of at least ``width`` tokens
    (their padding has zero probability, so it only adds zero cells after their own).

    Only cells at least as good as the ``top_k + 1``-th best start's best cell are ranked: the
    ``top_k + 1`` best cells are among them, and every other cell is strictly worse. A window
    whose ``top_k + 1`` best cells are not strictly ranked gets None.
    """
    rows, n = start.shape
    cells = start[:, None, :] * _band_of_ends(end, width)  # [rows, width, n]: length, start
    if top_k == 1:  # argmax takes the first of equals, in (start, length) order
        best = cells.transpose(0, 2, 1).reshape(rows, -1).argmax(axis=1).tolist()
        return [[(s, s + k, float(cells[row, k, s]))]
                for row, (s, k) in enumerate(divmod(cell, width) for cell in best)]
    threshold = [0.0] * rows
    if n > top_k:
        threshold = np.partition(cells.max(axis=1), n - top_k - 1, axis=1)[:, n - top_k - 1]
    found: list[list[Span] | None] = []
    for row, flat in enumerate(cells.reshape(rows, -1)):
        index = np.flatnonzero(flat >= threshold[row])
        ranked = sorted(zip(flat[index].tolist(), index.tolist()), reverse=True)[:top_k + 1]
        strict = len(ranked) > top_k and all(a[0] > b[0] for a, b in zip(ranked, ranked[1:]))
        found.append([(s, s + k, score) for score, (k, s) in
                      ((score, divmod(cell, n)) for score, cell in ranked[:top_k])]
                     if strict else None)
    return found


def _score(item: Any) -> float:
    return item[0]


def _as_list(spans: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[Span]:
    return list(zip(*(column.tolist() for column in spans)))


def _band_of_ends(end: np.ndarray, width: int) -> np.ndarray:
    """A read-only view ``[rows, width, n]`` of ``end`` padded with zeros: ``[r, k, i]`` is the
    end probability of token ``i + k`` (zero past the window)."""
    rows, n = end.shape
    padded = np.zeros((rows, n + width - 1), dtype=end.dtype)
    padded[:, :n] = end
    row_stride, token_stride = padded.strides
    band = np.ndarray((rows, width, n), padded.dtype, padded, 0,
                      (row_stride, token_stride, token_stride))
    band.flags.writeable = False
    return band


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


def _char_span(window: Encoding, start: int, end: int,
               words: dict[int, tuple[int, int] | None] | None) -> tuple[int, int]:
    """Characters of tokens ``start..end``: their whole words when aligning (``words``, a cache
    of each token's word, is given) and both have one, else their own offsets."""
    if words is not None:
        first = words[start] if start in words else words.setdefault(start, word_chars(window, start))
        last = words[end] if end in words else words.setdefault(end, word_chars(window, end))
        if first is not None and last is not None:
            return first[0], last[1]
    return token_chars(window, start)[0], token_chars(window, end)[1]
