"""The extractive question-answering task: request -> features -> batch -> answers.

``preprocess`` turns one (question, context) into overlapping windows of ``[CLS] question [SEP]
context [SEP]`` tokens (on a connection's thread, before queueing, so a bad request fails alone);
``collate`` right-pads a batch of them into int64 engine inputs; ``postprocess`` turns one
request's rows of start/end logits into one answer, cut from the original context by character
offsets. Answers equal those of transformers' ``pipeline("question-answering")`` (4.57, top_k=1):
per-window softmax over context tokens and CLS, best spans of at most ``max_answer_len`` tokens
widened to whole words, same-text candidates (ignoring case) merged by adding scores, and an
optional "no answer" scored by the smallest null (CLS) score over the windows.

The pieces live beside it: tasks/qa_tokenizer.py loads the tokenizer (no transformers),
tasks/qa_features.py turns encodings into arrays, tasks/qa_answers.py chooses answers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from protocol.errors import BadRequest
from protocol.qa_options import QAOptions
from tasks.qa_answers import ranked_answers
from tasks.qa_features import QAFeatures, build_features
from tasks.qa_tokenizer import QATokenizer
from tasks.qa_windows import ContextWindows, check_question_room, windows_due
from tasks.rows import QA_OUTPUTS, split_rows, stack_rows
from tasks.text import fitting_buckets

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from engines.model_dir import ModelInfo
    from protocol.messages import QARequest
    from settings.server_config import ServerConfig

__all__ = ["DEFAULT_INPUT_NAMES", "QAConfig", "QAFeatures", "QATask", "QATokenizer"]

#: A request's answering options where it gives none: every one the task's setting.
NO_OPTIONS = QAOptions()
#: Every engine input the task can produce (and, by default, does).
DEFAULT_INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")


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


class QATask:
    """Turns requests into engine inputs and engine outputs into answers (tasks/base.py's
    ``Task`` for ``qa`` requests).

    ``preprocess`` may run on several threads at once: it encodes with private copies of the
    Rust tokenizer, configured here once and never changed afterwards.

    Args:
        tokenizer: The tokenizer (``QATokenizer.from_dir``), or a fast transformers tokenizer.
        config: Windowing and answer settings.
        input_names: The engine inputs ``collate`` produces, in this order.
        fast_windows: Cut the windows of ASCII requests from one encode of the context
            (tasks/qa_windows.py: the same features for less CPU); False always lets the
            tokenizer window them.
        length_buckets: Pad every batch to the next of these lengths (``max_seq_len`` is
            always the last), so that an engine sees few shapes; empty: to its longest window.

    Raises:
        ValueError: Slow or left-padding tokenizer, unknown input name, or unusable config.
    """

    name: ClassVar[str] = "qa"
    op: ClassVar[str] = "qa"
    fields: ClassVar[Mapping[str, str]] = {"question": "string", "context": "string"}
    output_names: tuple[str, ...] = QA_OUTPUTS

    def __init__(self, tokenizer: QATokenizer | PreTrainedTokenizerFast,
                 config: QAConfig = QAConfig(),
                 input_names: Sequence[str] = DEFAULT_INPUT_NAMES, *,
                 fast_windows: bool = True, length_buckets: Sequence[int] = ()) -> None:
        if not isinstance(tokenizer, QATokenizer):
            tokenizer = QATokenizer.from_transformers(tokenizer)
        if tokenizer.padding_side != "right":
            raise ValueError("QATask puts the question first and needs padding_side='right'")
        if not input_names or any(name not in DEFAULT_INPUT_NAMES for name in input_names):
            raise ValueError(f"input_names must be a non-empty subset of {DEFAULT_INPUT_NAMES}, "
                             f"got {tuple(input_names)}")
        self.tokenizer = tokenizer
        self.config = config
        self.input_names: tuple[str, ...] = tuple(input_names)
        self._specials = tokenizer.pair_specials
        self._check_config()
        self.buckets = padded_lengths(length_buckets, config.max_seq_len)
        self._plain = tokenizer.copy()
        self._windows = tokenizer.copy(config.max_seq_len, config.doc_stride)
        self._check_windowing()
        self._fast = (ContextWindows.build(tokenizer, config.max_seq_len, config.doc_stride)
                      if fast_windows else None)
        # An ASCII question this long or shorter provably leaves room for more than doc_stride
        # context tokens, so it needs no encode of its own to be checked.
        self._short_ascii_question = (config.max_seq_len - self._specials - config.doc_stride - 1
                                      if tokenizer.ascii_tokens_at_most_chars() else -1)

    def _check_windowing(self) -> None:
        """Refuse a tokenizers library whose own windowing loses context (``windows_due``):
        tokenizers 0.23.2 gives a long context's pair only its first two windows (0.23.3 all
        of them), so answers past them would silently never be found.

        Raises:
            RuntimeError: the library's windows fall short, naming its version.
        """
        got, want = windows_due(self._windows, self._plain, self.max_seq_len,
                                self.config.doc_stride, self._specials)
        if got != want:
            import tokenizers

            raise RuntimeError(f"tokenizers {tokenizers.__version__} windows a long context "
                               f"into {got} windows where {want} are due, losing the rest; "
                               "install tokenizers 0.23.3 or later")

    @classmethod
    def from_model(cls, model_dir: str | Path, info: ModelInfo, config: ServerConfig) -> QATask:
        """The task for a prepared model folder, as the server's settings say."""
        no_answer = info.squad2 if config.no_answer == "auto" else config.no_answer == "on"
        qa = QAConfig(max_seq_len=min(config.max_seq_len, info.max_seq_len),
                      doc_stride=config.doc_stride, max_answer_len=config.max_answer_len,
                      handle_impossible_answer=no_answer)
        return cls.from_dir(model_dir, qa, input_names=info.input_names,
                            length_buckets=config.bucket_lengths())

    @property
    def max_seq_len(self) -> int:
        """The longest window."""
        return self.config.max_seq_len

    def features(self, request: QARequest) -> QAFeatures:
        """``preprocess`` of a ``qa`` request's question and context, with its own answering
        options where it gives any."""
        features = self.preprocess(request.question, request.context)
        return features if request.options is None else replace(features,
                                                                 options=request.options)

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: QAConfig | None = None,
                 input_names: Sequence[str] = DEFAULT_INPUT_NAMES,
                 length_buckets: Sequence[int] = ()) -> QATask:
        """Load the tokenizer saved in ``model_dir`` (it must have a fast one) and build a task;
        transformers is not imported."""
        return cls(QATokenizer.from_dir(model_dir), config if config is not None else QAConfig(),
                   input_names, length_buckets=length_buckets)

    def padded_length(self, length: int) -> int:
        """The length a batch whose longest window has ``length`` tokens is padded to."""
        if not self.buckets:
            return length
        return self.buckets[min(bisect_left(self.buckets, length), len(self.buckets) - 1)]

    def _check_config(self) -> None:
        max_seq_len, stride = self.config.max_seq_len, self.config.doc_stride
        if max_seq_len > self.tokenizer.model_max_length:
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
        if self._fast is not None and self._fast.takes(question, context):
            return self._fast.features(question, context)
        counted = not (len(question) <= self._short_ascii_question and question.isascii())
        if counted:
            self._check_question_fits(question, context)
        encoding = self._windows.encode(question, context)
        return build_features(context, [encoding, *encoding.overflowing], self.tokenizer.pad_id,
                              self.tokenizer.cls_id, check_question=not counted)

    def _check_question_fits(self, question: str, context: str) -> None:
        """Refuse what the tokenizer cannot window (it would raise, or panic in Rust)."""
        check_question_room(len(self._plain.encode(question, add_special_tokens=False)),
                            lambda: len(self._plain.encode(context, add_special_tokens=False)),
                            self.config.max_seq_len, self._specials, self.config.doc_stride)

    def collate(self, batch: Sequence[QAFeatures]) -> dict[str, np.ndarray]:
        """Stack every window of every request, right-padded to the longest one in the batch
        (to its length bucket, with ``length_buckets``).

        Returns:
            One int64 array ``[sum of rows, padded length of the longest window]`` per name in
            ``input_names``; requests' rows follow the batch order.
        """
        if not batch:
            raise ValueError("cannot collate an empty batch")
        return stack_rows(batch, self.input_names, self.tokenizer.pad_id,
                          self.padded_length(max(f.max_len for f in batch)))

    def split_outputs(self, batch: Sequence[QAFeatures],
                      outputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, ...]]:
        """Cut a batch's ``start_logits`` and ``end_logits`` back into one pair per request.

        Raises:
            ValueError: An output is missing or does not have one row per window.
        """
        return split_rows([features.rows for features in batch], outputs)

    def check_outputs(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """Whether an engine's outputs for ``rows`` rows are what this task reads (warm-up).

        Raises:
            ValueError: They are not: ``start_logits`` and ``end_logits``, ``[rows, L]``.
        """
        split_rows([rows], outputs)

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
            With the request's ``top_k`` above 1, also ``answers``: that many, best first.

        Raises:
            ValueError: the logits do not fit the features.
            EngineError: a logit of a token that may be part of an answer is NaN or infinite.
        """
        start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
        _check_logits(features, start_logits, end_logits)
        config, options = self.config, features.options or NO_OPTIONS
        answers = ranked_answers(
            features, start_logits, end_logits, top_k=options.top_k,
            max_answer_len=_given(options.max_answer_len, config.max_answer_len),
            align_to_words=_given(options.align_to_words, config.align_to_words),
            impossible=_given(options.handle_impossible_answer, config.handle_impossible_answer))
        return answers[0] if options.top_k == 1 else {**answers[0], "answers": answers}


def _given(value: Any, default: Any) -> Any:
    """A request's option where it gives one, else the task's setting."""
    return default if value is None else value


def padded_lengths(lengths: Sequence[int], max_seq_len: int) -> tuple[int, ...]:
    """Bucket lengths up to ``max_seq_len``, ascending, ending with it; empty when none are
    asked for. Longer ones are left out, as for the text tasks: one --length_buckets serves a
    repository of models of different lengths.

    Raises:
        ValueError: A length that is not positive.
    """
    return fitting_buckets(lengths, max_seq_len)


def _check_logits(features: QAFeatures, start: np.ndarray, end: np.ndarray) -> None:
    """Raise ValueError unless both have one row per window and at least ``max_len`` columns."""
    shape, end_shape = np.shape(start), np.shape(end)
    if shape != end_shape or len(shape) != 2 or shape[0] != features.rows \
            or shape[1] < features.max_len:
        raise ValueError(f"logits of shapes {shape} and {end_shape} do not fit features of "
                         f"{features.rows} windows of up to {features.max_len} tokens")
