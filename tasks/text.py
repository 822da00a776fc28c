"""Single-text features, shared by the tasks that read whole texts (embed, classify).

``TextEncoder`` tokenizes each text on its own into one row, ``[CLS] text [SEP]`` (the
tokenizer's own special tokens), cut to ``max_seq_len`` tokens with the special tokens included,
as sentence-transformers and transformers' ``truncation=True`` cut a single text. It holds a
private copy of the Rust tokenizer, configured once and never changed, so any number of threads
may encode at once. transformers is not imported.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from protocol.errors import BadRequest
from tasks.encoding import encode_texts
from tasks.qa_tokenizer import QATokenizer
from tasks.rows import RowShape, split_rows, stack_rows

#: Every engine input a text task can produce.
TEXT_INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True, slots=True, eq=False)
class TextFeatures(RowShape):
    """One request's texts as engine rows, one row per text.

    Attributes:
        input_ids: ``[texts, longest]`` token ids, right-padded with the pad id.
        token_type_ids: ``[texts, longest]`` segment ids (0), padded with 0.
        lengths: ``[texts]`` real tokens of each row, special tokens included.
    """

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray


class TextEncoder:
    """Tokenizes texts, one row each, truncated to ``max_seq_len`` tokens.

    Args:
        tokenizer: The model folder's tokenizer (``QATokenizer.from_dir``).
        max_seq_len: Most tokens in one row, special tokens included.

    Raises:
        ValueError: ``max_seq_len`` is not positive, leaves no room for a token besides the
            special ones, or is more than the tokenizer's ``model_max_length``.
    """

    def __init__(self, tokenizer: QATokenizer, max_seq_len: int) -> None:
        specials = tokenizer.backend.num_special_tokens_to_add(False)
        if not specials < max_seq_len <= tokenizer.model_max_length:
            raise ValueError(f"max_seq_len must be in {specials + 1}..{tokenizer.model_max_length}"
                             f" for this tokenizer, got {max_seq_len}")
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.pad_id = tokenizer.pad_id
        self._specials = specials
        self._backend = _truncating_copy(tokenizer, max_seq_len)

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_seq_len: int) -> TextEncoder:
        """The encoder of the tokenizer saved in a prepared model folder."""
        return cls(QATokenizer.from_dir(model_dir), max_seq_len)

    def encode(self, texts: Sequence[str]) -> TextFeatures:
        """One row per text, in order; a text over ``max_seq_len`` tokens is cut, not refused.

        Raises:
            BadRequest: No texts, or one that is not a string, is blank, or has no tokens
                (only characters the tokenizer drops: zero-width, control, lone accents).
        """
        if not texts:
            raise BadRequest("no texts given")
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise BadRequest(f"text {index} must be a string, not {type(text).__name__}")
            if not text.strip():
                raise BadRequest(f"text {index} is empty")
        encodings = encode_texts(self._backend, texts)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        if lengths.min() <= self._specials:  # nothing but the special tokens: as QA refuses
            raise BadRequest(f"text {int(np.argmin(lengths))} has no tokens")
        shape = (len(encodings), int(lengths.max()))
        ids = np.full(shape, self.pad_id, dtype=np.int64)
        types = np.zeros(shape, dtype=np.int64)
        for row, encoding in enumerate(encodings):
            ids[row, :lengths[row]] = encoding.ids
            types[row, :lengths[row]] = encoding.type_ids
        return TextFeatures(input_ids=ids, token_type_ids=types, lengths=lengths)


class TextRows:
    """What the text tasks share of the task contract (tasks/base.py): length buckets, collating
    and splitting a batch of ``TextFeatures``, one row per text.

    Args:
        encoder: The tokenizer settings.
        input_names: The engine inputs ``collate`` produces, in order.
        length_buckets: Pad every batch to the next of these lengths (``max_seq_len`` is always
            the last; lengths above it are left out); empty: to its longest row.

    Raises:
        ValueError: An unknown input name, or a bucket length that is not positive.
    """

    output_names: tuple[str, ...] = ()

    def __init__(self, encoder: TextEncoder, input_names: Sequence[str] = TEXT_INPUT_NAMES,
                 length_buckets: Sequence[int] = ()) -> None:
        if not input_names or any(name not in TEXT_INPUT_NAMES for name in input_names):
            raise ValueError(f"input_names must be a non-empty subset of {TEXT_INPUT_NAMES}, "
                             f"got {tuple(input_names)}")
        self.encoder = encoder
        self.input_names: tuple[str, ...] = tuple(input_names)
        self.buckets = fitting_buckets(length_buckets, encoder.max_seq_len)

    @property
    def max_seq_len(self) -> int:
        """The longest row."""
        return self.encoder.max_seq_len

    def padded_length(self, length: int) -> int:
        """The length a batch whose longest row has ``length`` tokens is padded to."""
        if not self.buckets:
            return length
        return self.buckets[min(bisect_left(self.buckets, length), len(self.buckets) - 1)]

    def collate(self, batch: Sequence[TextFeatures]) -> dict[str, np.ndarray]:
        """Every row of every request, right-padded to the batch's longest row (to its length
        bucket, with ``length_buckets``), as int64 arrays named by ``input_names``.

        Raises:
            ValueError: An empty batch.
        """
        if not batch:
            raise ValueError("cannot collate an empty batch")
        return stack_rows(batch, self.input_names, self.encoder.pad_id,
                          self.padded_length(max(f.max_len for f in batch)))

    def split_outputs(self, batch: Sequence[TextFeatures],
                      outputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, ...]]:
        """One tuple of arrays (one per name in ``output_names``) per request, in batch order.

        Raises:
            ValueError: An output is missing or does not have one row per text.
        """
        return split_rows([features.rows for features in batch], outputs, self.output_names)

    def check_outputs(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """Whether an engine's outputs for ``rows`` rows are what this task reads (warm-up).

        Raises:
            ValueError: An output is missing or is not ``[rows, N]``.
        """
        split_rows([rows], outputs, self.output_names)


def fitting_buckets(lengths: Sequence[int], max_seq_len: int) -> tuple[int, ...]:
    """Bucket lengths up to ``max_seq_len``, ascending, ending with it; empty when none are
    asked for. Longer ones are left out: one --length_buckets serves models of different
    lengths.

    Raises:
        ValueError: A length that is not positive.
    """
    if not lengths:
        return ()
    if any(length < 1 for length in lengths):
        raise ValueError(f"length buckets must be positive, got {tuple(lengths)}")
    return tuple(sorted({*(n for n in lengths if n <= max_seq_len), max_seq_len}))


def rows_of(outputs: Any, features: TextFeatures, name: str) -> np.ndarray:
    """``outputs`` as a 2-D array with one row per text of ``features``.

    Raises:
        ValueError: Any other shape.
    """
    array = np.asarray(outputs)
    if array.ndim != 2 or array.shape[0] != features.rows:
        raise ValueError(f"{name} of shape {array.shape} does not fit {features.rows} texts")
    return array


def _truncating_copy(tokenizer: QATokenizer, max_seq_len: int) -> Tokenizer:
    """A private copy of the tokenizer: no padding, one text cut to ``max_seq_len`` tokens with
    its special tokens, special tokens written in a text kept special."""
    backend = tokenizer.copy()
    backend.enable_truncation(max_seq_len, strategy="longest_first",
                              direction=tokenizer.truncation_side)
    return backend
