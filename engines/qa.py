"""The extractive question-answering task: request -> features -> batch -> answers.

``preprocess`` turns one (question, context) into overlapping windows of ``[CLS] question [SEP]
context [SEP]`` tokens (on a connection's thread, before queueing, so a bad request fails alone);
``collate`` right-pads a batch of them into int64 engine inputs; ``postprocess`` turns one
request's rows of start/end logits into one answer, cut from the original context by character
offsets. Answers equal those of transformers' ``pipeline("question-answering")`` (4.57, top_k=1):
per-window softmax over context tokens and CLS, best spans of at most ``max_answer_len`` tokens
widened to whole words, same-text candidates (ignoring case) merged by adding scores, and an
optional "no answer" scored by the smallest null (CLS) score over the windows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.errors import BadRequest

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer
    from transformers import PreTrainedTokenizerFast

#: Every engine input the task can produce (and, by default, does).
DEFAULT_INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")

_TOP_K = 1  # answers per request
_MASKED_LOGIT = -10000.0  # logit given to tokens that cannot be part of an answer
_NO_NULL_SCORE = 1000000.0  # starting value of the running minimum of the null score


@dataclass(frozen=True, kw_only=True)
class QAConfig:
    """How requests are cut into windows and answers chosen (the pipeline's defaults).

    Attributes:
        max_seq_len: Most tokens in one window, special tokens included.
        doc_stride: Context tokens shared by two consecutive windows of a long context.
        max_answer_len: Most tokens in an answer span.
        handle_impossible_answer: Allow the SQuAD2 "no answer" (``""``, start = end = 0).
        align_to_words: Widen answer spans to whole words.
    """

    max_seq_len: int = 384
    doc_stride: int = 128
    max_answer_len: int = 15
    handle_impossible_answer: bool = False
    align_to_words: bool = True

    def __post_init__(self) -> None:
        if self.max_seq_len < 1 or self.max_answer_len < 1:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) and max_answer_len "
                             f"({self.max_answer_len}) must be positive")
        if not 0 <= self.doc_stride < self.max_seq_len:
            raise ValueError(f"doc_stride must be in [0, max_seq_len={self.max_seq_len}), "
                             f"got {self.doc_stride}")


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare by identity
class QAFeatures:
    """One request as windows of tokens, right-padded to its longest window (read-only arrays).

    Attributes:
        context: The original context string; answers are cut from it.
        input_ids: ``[rows, max_len]`` token ids, padded with the tokenizer's pad id.
        token_type_ids: ``[rows, max_len]`` segment ids (0 question, 1 context), padded with 0.
        lengths: ``[rows]`` tokens in each window.
        allowed: ``[rows, max_len]`` bool: tokens that may start or end an answer (context, CLS).
        offsets: ``[rows, max_len, 2]`` each token's character span in its own text.
        word_spans: ``[rows, max_len, 2]`` character span of the token's context word, or -1.
    """

    context: str
    input_ids: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray
    allowed: np.ndarray
    offsets: np.ndarray
    word_spans: np.ndarray

    @property
    def rows(self) -> int:
        """Number of windows, i.e. rows this request takes in a batch."""
        return int(self.input_ids.shape[0])

    @property
    def max_len(self) -> int:
        """Tokens in the longest window."""
        return int(self.input_ids.shape[1])


class QATask:
    """Turns requests into engine inputs and engine outputs into answers.

    ``preprocess`` may run on several threads at once: it encodes with private copies of the
    Rust tokenizer, configured here once and never changed afterwards.

    Args:
        tokenizer: A fast (Rust-backed) tokenizer that pads on the right.
        config: Windowing and answer settings.
        input_names: The engine inputs ``collate`` produces, in this order.

    Raises:
        ValueError: Slow or left-padding tokenizer, unknown input name, or unusable config.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, config: QAConfig = QAConfig(),
                 input_names: Sequence[str] = DEFAULT_INPUT_NAMES) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("QATask needs a fast tokenizer (tokenizer.json); got a slow one")
        if tokenizer.padding_side != "right":
            raise ValueError("QATask puts the question first and needs padding_side='right'")
        if not input_names or any(name not in DEFAULT_INPUT_NAMES for name in input_names):
            raise ValueError(f"input_names must be a non-empty subset of {DEFAULT_INPUT_NAMES}, "
                             f"got {tuple(input_names)}")
        self.tokenizer = tokenizer
        self.config = config
        self.input_names: tuple[str, ...] = tuple(input_names)
        self._specials = tokenizer.num_special_tokens_to_add(pair=True)
        self._check_config()
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._cls_id = tokenizer.cls_token_id
        self._plain = _private_backend(tokenizer)
        self._windows = _private_backend(tokenizer)
        self._windows.enable_truncation(config.max_seq_len, stride=config.doc_stride,
                                        strategy="only_second",
                                        direction=tokenizer.truncation_side)

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: QAConfig | None = None,
                 input_names: Sequence[str] = DEFAULT_INPUT_NAMES) -> QATask:
        """Load the tokenizer saved in ``model_dir`` (it must have a fast one) and build a task."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tokenizer, config if config is not None else QAConfig(), input_names)

    def _check_config(self) -> None:
        max_seq_len, stride = self.config.max_seq_len, self.config.doc_stride
        if max_seq_len > (getattr(self.tokenizer, "model_max_length", None) or max_seq_len):
            raise ValueError(f"max_seq_len={max_seq_len} is more than the model accepts "
                             f"({self.tokenizer.model_max_length})")
        if max_seq_len - self._specials - 1 <= stride:
            raise ValueError(f"doc_stride={stride} leaves no room for new context tokens in "
                             f"windows of max_seq_len={max_seq_len}")

    def preprocess(self, question: str, context: str) -> QAFeatures:
        """Tokenize one request into windows.

        Raises:
            BadRequest: Empty question or context, or a question too long to leave room for the
                context within ``max_seq_len``.
        """
        for field, text in (("question", question), ("context", context)):
            if not isinstance(text, str):
                raise BadRequest(f"{field} must be a string, not {type(text).__name__}")
            if not text.strip():
                raise BadRequest(f"{field} is empty")
        self._check_question_fits(question, context)
        encoding = self._windows.encode(question, context)
        if 1 not in encoding.sequence_ids:
            raise BadRequest("context has no tokens")
        return self._features(context, [encoding, *encoding.overflowing])

    def _check_question_fits(self, question: str, context: str) -> None:
        """Refuse what the tokenizer cannot window (it would raise, or panic in Rust)."""
        max_seq_len, stride = self.config.max_seq_len, self.config.doc_stride
        question_len = len(self._plain.encode(question, add_special_tokens=False))
        if question_len == 0:
            raise BadRequest("question has no tokens")
        room = max_seq_len - self._specials - question_len
        if room <= 0:
            raise BadRequest(f"question is too long: {question_len} tokens, but max_seq_len="
                             f"{max_seq_len} allows at most {max_seq_len - self._specials - 1}")
        if room <= stride and len(self._plain.encode(context, add_special_tokens=False)) > room:
            raise BadRequest(f"question is too long for this context: {question_len} tokens, but "
                             f"a context that needs several windows of max_seq_len={max_seq_len} "
                             f"allows at most {max_seq_len - self._specials - stride - 1} "
                             f"(doc_stride={stride})")

    def _features(self, context: str, windows: Sequence[Encoding]) -> QAFeatures:
        parts = [_window_arrays(window, self._cls_id) for window in windows]
        fills = (self._pad_id, 0, False, 0, -1)
        ids, types, allowed, offsets, spans = (
            _pad_rows([part[i] for part in parts], fill) for i, fill in enumerate(fills))
        lengths = np.array([len(part[0]) for part in parts], dtype=np.int64)
        lengths.flags.writeable = False
        return QAFeatures(context, ids, types, lengths, allowed, offsets, spans)

    def collate(self, batch: Sequence[QAFeatures]) -> dict[str, np.ndarray]:
        """Stack every window of every request, right-padded to the longest one in the batch.

        Returns:
            One int64 array ``[sum of rows, longest window]`` per name in ``input_names``;
            requests' rows follow the batch order.
        """
        if not batch:
            raise ValueError("cannot collate an empty batch")
        shape = (sum(f.rows for f in batch), max(f.max_len for f in batch))
        ids = np.full(shape, self._pad_id, dtype=np.int64)
        mask, types = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        row = 0
        for features in batch:
            end, n = row + features.rows, features.max_len
            ids[row:end, :n] = features.input_ids
            types[row:end, :n] = features.token_type_ids
            mask[row:end, :n] = np.arange(n) < features.lengths[:, None]
            row = end
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {name: arrays[name] for name in self.input_names}

    def split_outputs(self, batch: Sequence[QAFeatures],
                      outputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Cut a batch's ``start_logits`` and ``end_logits`` back into one pair per request.

        Raises:
            ValueError: An output is missing or does not have one row per window.
        """
        total = sum(features.rows for features in batch)
        start, end = (np.asarray(outputs.get(name)) for name in ("start_logits", "end_logits"))
        for name, value in (("start_logits", start), ("end_logits", end)):
            if value.ndim != 2 or value.shape[0] != total:
                raise ValueError(f"{name} must have shape [{total}, L], got {value.shape}")
        bounds = np.cumsum([0, *(features.rows for features in batch)]).tolist()
        return [(start[a:b], end[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def answer_batch(self, batch: Sequence[QAFeatures],
                     outputs: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """One answer per request of the batch, in order (``split_outputs`` + ``postprocess``)."""
        pairs = self.split_outputs(batch, outputs)
        return [self.postprocess(features, start, end)
                for features, (start, end) in zip(batch, pairs)]

    def postprocess(self, features: QAFeatures, start_logits: np.ndarray,
                    end_logits: np.ndarray) -> dict[str, Any]:
        """The best answer over all windows of one request.

        Args:
            features: The request's features.
            start_logits, end_logits: ``[features.rows, >= features.max_len]`` each; columns
                past a window's length are ignored.

        Returns:
            ``{"answer": str, "score": float, "start": int, "end": int}`` with
            ``features.context[start:end] == answer``; "no answer" is ``""`` with start = end = 0.
        """
        start_logits, end_logits = _check_logits(features, start_logits, end_logits)
        candidates: dict[str, list[Any]] = {}  # lower-cased text -> [score, start, end, text]
        null_score = _NO_NULL_SCORE
        for row in range(features.rows):
            null = self._add_window(features, row, start_logits[row], end_logits[row], candidates)
            null_score = min(null_score, null)
        ranked = list(candidates.values())
        if self.config.handle_impossible_answer:
            ranked.append([null_score, 0, 0, ""])
        if not ranked:  # every candidate was dropped (the pipeline would return [])
            return {"answer": "", "score": 0.0, "start": 0, "end": 0}
        score, start, end, text = max(ranked, key=lambda item: item[0])  # first of equals wins
        return {"answer": text, "score": float(score), "start": start, "end": end}

    def _add_window(self, features: QAFeatures, row: int, start_logits: np.ndarray,
                    end_logits: np.ndarray, candidates: dict[str, list[Any]]) -> float:
        """Add one window's best spans to ``candidates``; return the window's null score."""
        n = int(features.lengths[row])
        allowed = features.allowed[row:row + 1, :n]
        start = _masked_softmax(start_logits[None, :n], allowed)
        end = _masked_softmax(end_logits[None, :n], allowed)
        null_score = float(start[0, 0] * end[0, 0])
        start[0, 0] = end[0, 0] = 0.0
        top_k = 2 * _TOP_K + 10 if self.config.align_to_words else _TOP_K  # room for merging
        for s, e, score in _best_spans(start, end, allowed[0], top_k, self.config.max_answer_len):
            char_start, char_end = self._char_span(features, row, s, e)
            text = features.context[char_start:char_end]
            known = candidates.setdefault(text.lower(), [0.0, char_start, char_end, text])
            known[0] += score  # a text seen before keeps its first position and adds up
        return null_score

    def _char_span(self, features: QAFeatures, row: int, start: int, end: int) -> tuple[int, int]:
        """Characters of tokens ``start..end``: their whole words when aligning and both have
        one, else their own offsets."""
        if self.config.align_to_words:
            spans = features.word_spans[row]
            if spans[start, 0] >= 0 and spans[end, 0] >= 0:
                return int(spans[start, 0]), int(spans[end, 1])
        offsets = features.offsets[row]
        return int(offsets[start, 0]), int(offsets[end, 1])


def _private_backend(tokenizer: PreTrainedTokenizerFast) -> Tokenizer:
    """A copy of the Rust tokenizer with neither padding nor truncation, for this task alone."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = False  # special tokens written in the text stay special
    return backend


def _window_arrays(window: Encoding, cls_id: int | None) -> tuple[np.ndarray, ...]:
    """Token ids, type ids, allowed mask, offsets and word spans of one window."""
    ids = np.array(window.ids, dtype=np.int64)
    sequence_ids = _none_as_minus_one(window.sequence_ids)
    allowed = (sequence_ids == 1) | (ids == (-1 if cls_id is None else cls_id))
    offsets = np.array(window.offsets, dtype=np.int64).reshape(-1, 2)
    spans = _word_char_spans(sequence_ids, _none_as_minus_one(window.word_ids), offsets)
    return ids, np.array(window.type_ids, dtype=np.int64), allowed, offsets, spans


def _pad_rows(rows: Sequence[np.ndarray], fill: int | bool) -> np.ndarray:
    """Stack arrays of different lengths, padded on the right with ``fill``; read-only."""
    out = np.full((len(rows), max(len(row) for row in rows), *rows[0].shape[1:]), fill,
                  dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    out.flags.writeable = False
    return out


def _none_as_minus_one(values: Sequence[int | None]) -> np.ndarray:
    return np.nan_to_num(np.array(values, dtype=np.float64), nan=-1.0).astype(np.int64)


def _word_char_spans(sequence_ids: np.ndarray, word_ids: np.ndarray,
                     offsets: np.ndarray) -> np.ndarray:
    """Per token, ``word_to_chars(token_to_word(t), sequence_index=1)`` in its window, or -1.

    The word index is looked up among the window's context tokens: a word cut by the window's
    edge is cut too, and a question token finds the context word with its index, as in the
    pipeline. Word indices grow along a sequence, which the lookup relies on.
    """
    spans = np.full((len(word_ids), 2), -1, dtype=np.int64)
    context_tokens = np.flatnonzero((sequence_ids == 1) & (word_ids >= 0))
    context_words = word_ids[context_tokens]
    if context_tokens.size == 0 or np.any(np.diff(context_words) < 0):
        return spans  # no context words (or out of order): token offsets are used instead
    first = np.searchsorted(context_words, word_ids, side="left")
    last = np.searchsorted(context_words, word_ids, side="right") - 1
    found = (sequence_ids >= 0) & (word_ids >= 0) & (last >= first)
    spans[found, 0] = offsets[context_tokens[first[found]], 0]
    spans[found, 1] = offsets[context_tokens[last[found]], 1]
    return spans


def _check_logits(features: QAFeatures, start: np.ndarray,
                  end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    start, end = np.asarray(start, dtype=np.float32), np.asarray(end, dtype=np.float32)
    if start.shape != end.shape or start.ndim != 2 or start.shape[0] != features.rows \
            or start.shape[1] < features.max_len:
        raise ValueError(f"logits of shapes {start.shape} and {end.shape} do not fit features of "
                         f"{features.rows} windows of up to {features.max_len} tokens")
    return start, end


def _masked_softmax(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over one window ``[1, n]`` where tokens outside ``allowed`` get ~zero mass."""
    masked = np.where(allowed, logits, np.float32(_MASKED_LOGIT))
    exp = np.exp(masked - masked.max(axis=-1, keepdims=True))
    return exp / exp.sum()


def _best_spans(start: np.ndarray, end: np.ndarray, allowed: np.ndarray, top_k: int,
                max_answer_len: int) -> list[tuple[int, int, float]]:
    """The ``top_k`` best (start token, end token, score) of one window ``[1, n]``, best first.

    A span's score is ``start[s] * end[e]`` for ``s <= e < s + max_answer_len``, else 0. As in
    the pipeline, spans with an end outside ``allowed`` are dropped only after the top ``top_k``
    are chosen, and token 0 (CLS) always counts as allowed here.
    """
    found = _top_band_spans(start[0], end[0], top_k, max_answer_len)
    starts, ends, values = found or _top_matrix_spans(start, end, top_k, max_answer_len)
    usable = allowed.copy()
    usable[0] = usable.any()
    keep = usable[starts] & usable[ends]
    return list(zip(starts[keep].tolist(), ends[keep].tolist(), values[keep].tolist()))


def _top_band_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                    max_answer_len: int) -> tuple[np.ndarray, ...] | None:
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


def _top_matrix_spans(start: np.ndarray, end: np.ndarray, top_k: int,
                      max_answer_len: int) -> tuple[np.ndarray, ...]:
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
