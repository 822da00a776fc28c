"""Windows cut by numpy from one encode of the context: the QA task's fast path for ASCII text.

The tokenizer's own windowing (truncation with overflow) costs about as much again as encoding
the context, and most of an encode goes to the normalizer. For ASCII text the normalizers of
WordPiece tokenizers (BERT's and the like) do nothing but lower-case and drop control
characters, so a request whose two texts are ASCII, free of control characters and of the
tokenizer's added tokens is encoded here by a copy of the tokenizer with no normalizer, on
text lower-cased by Python (which keeps every character where it was, so offsets are the
same). The context is encoded once, the question once, and each window is cut from the
context's tokens exactly as the tokenizer's truncation cuts them (``window_bounds``), inside the
pair template the tokenizer's post-processor writes. Features, errors and answers are the same
as through the tokenizer's own windowing; tests compare both on random text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from protocol.errors import BadRequest
from tasks.encoding import encode_texts
from tasks.qa_features import ContextSpans, QAFeatures, assemble
from tasks.qa_tokenizer import SPLIT_ONLY_PRE_TOKENIZERS, QATokenizer, made_of

# Normalizers that, on ASCII text without control characters, do at most lower-case it.
_ASCII_NOOP_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "StripAccents"})
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # dropped by BERT's clean_text


class ContextWindows:
    """The fast path of one tokenizer and windowing; ``build`` says whether it has one.

    Thread-safe: encodes with a private copy of the tokenizer, never changed after building.
    """

    def __init__(self, tokenizer: QATokenizer, backend: Tokenizer, lower: bool,
                 template: tuple[list[int], list[int], list[int]], type_ids: list[int],
                 max_seq_len: int, stride: int) -> None:
        self._backend, self._lower = backend, lower
        self._pad_id, self._cls_id = tokenizer.pad_id, tokenizer.cls_id
        self._head, self._middle, self._tail = template
        self._types = type_ids  # of head, question, middle, context, tail
        self._max_seq_len, self._stride = max_seq_len, stride
        self._specials = sum(map(len, template))
        added = [token.content for token in tokenizer.backend.get_added_tokens_decoder().values()]
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None

    @classmethod
    def build(cls, tokenizer: QATokenizer, max_seq_len: int, stride: int) -> ContextWindows | None:
        """The fast path for ``tokenizer``, or None when its pieces are not known to give the
        same tokens without the normalizer (or it truncates from the left)."""
        spec = json.loads(tokenizer.backend.to_str())
        lower = _normalizer_lowers(spec.get("normalizer"))
        if (lower is None or tokenizer.truncation_side != "right"
                or spec.get("model", {}).get("type") != "WordPiece"
                or spec.get("pre_tokenizer") is None
                # these split at a tab, newline or carriage return as at the space the normalizer
                # would make of it, or leave it inside a word WordPiece cannot match either way
                or not made_of(spec["pre_tokenizer"], "pretokenizers", SPLIT_ONLY_PRE_TOKENIZERS)):
            return None
        spec["normalizer"] = None
        backend = Tokenizer.from_str(json.dumps(spec))
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = False
        found = _pair_template(tokenizer.copy(), backend)
        if found is None:
            return None
        template, type_ids = found
        return cls(tokenizer, backend, lower, template, type_ids, max_seq_len, stride)

    def takes(self, question: str, context: str) -> bool:
        """True when both texts are ASCII without control characters or added tokens."""
        return all(text.isascii() and _CONTROL.search(text) is None
                   and (self._added is None or self._added.search(text) is None)
                   for text in (question, context))

    def features(self, question: str, context: str) -> QAFeatures:
        """The features of a request that ``takes`` accepts.

        Raises:
            BadRequest: As the tokenizer's own windowing would (see ``check_question_room``).
        """
        question_enc, context_enc = encode_texts(
            self._backend,
            [question.lower(), context.lower()] if self._lower else [question, context],
            add_special_tokens=False)
        question_ids, context_ids = question_enc.ids, context_enc.ids
        room = check_question_room(len(question_ids), lambda: len(context_ids),
                                   self._max_seq_len, self._specials, self._stride)
        if not context_ids:
            raise BadRequest("context has no tokens")
        bounds = window_bounds(len(context_ids), room, self._stride)
        head = self._head + question_ids + self._middle
        ids, types, lengths, mask = self._arrays(head, len(question_ids), context_ids, bounds)
        first = len(head)
        contexts = [slice(first, first + stop - start) for start, stop in bounds]
        spans = ContextSpans(question_enc, context_enc, bounds, len(self._head), first)
        return assemble(context, ids, types, lengths, contexts, mask, self._cls_id, spans)

    def _arrays(self, head: list[int], question_len: int, context_ids: list[int],
                bounds: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list[int],
                                                        np.ndarray | None]:
        """Token ids and type ids ``[rows, longest]`` of the windows, their lengths, and where
        they are not padding (None when no row is padded)."""
        tokens = np.array(context_ids, dtype=np.int64)
        first, tail = len(head), len(self._tail)
        lengths = [first + stop - start + tail for start, stop in bounds]
        longest = max(lengths)
        ids = np.full((len(bounds), longest), self._pad_id, dtype=np.int64)
        types = np.zeros((len(bounds), longest), dtype=np.int64)
        ids[:, :first] = head
        types[:, :first] = np.repeat(self._types[:3], [len(self._head), question_len,
                                                       len(self._middle)])
        for row, (start, stop) in enumerate(bounds):
            end = first + stop - start
            ids[row, first:end] = tokens[start:stop]
            ids[row, end:end + tail] = self._tail
            types[row, first:end] = self._types[3]
            types[row, end:end + tail] = self._types[4]
        mask = None
        if min(lengths) < longest:
            mask = np.arange(longest) < np.array(lengths)[:, None]
        return ids, types, lengths, mask


def window_bounds(tokens: int, room: int, stride: int) -> list[tuple[int, int]]:
    """The context tokens ``[start, stop)`` of each window, as the tokenizer's truncation cuts
    them: ``room`` tokens a window, each next one starting ``room - stride`` later, the last
    one ending at the context's end."""
    if tokens <= room:
        return [(0, tokens)]
    bounds = []
    for start in range(0, tokens, room - stride):
        bounds.append((start, min(start + room, tokens)))
        if bounds[-1][1] == tokens:
            break
    return bounds


def windows_due(windows: Any, plain: Any, max_seq_len: int, stride: int,
                specials: int) -> tuple[int, int]:
    """How many windows a tokenizer's own windowing (``windows``: truncation with overflow)
    makes of a long non-ASCII probe, and how many its tokens need (``window_bounds``, counted
    with ``plain``, the same tokenizer without truncation); equal where it windows right."""
    question = "Où est le café ?"
    context = " ".join(f"le café numéro {n} est là" for n in range(max_seq_len // 2))
    got = 1 + len(windows.encode(question, context).overflowing)
    room = max_seq_len - specials - len(plain.encode(question, add_special_tokens=False))
    want = len(window_bounds(len(plain.encode(context, add_special_tokens=False)), room,
                             stride))
    return got, want


def check_question_room(question_len: int, context_len: Callable[[], int], max_seq_len: int,
                        specials: int, stride: int) -> int:
    """The context tokens a window has room for, after checking that the tokenizer can window
    the request (it would raise, or panic in Rust); ``context_len()`` counts the context's
    tokens, only when needed.

    Raises:
        BadRequest: The question has no tokens, or leaves no room for the context.
    """
    if question_len == 0:
        raise BadRequest("question has no tokens")
    room = max_seq_len - specials - question_len
    if room <= 0:
        raise BadRequest(f"question is too long: {question_len} tokens, but max_seq_len="
                         f"{max_seq_len} allows at most {max_seq_len - specials - 1}")
    if room <= stride and context_len() > room:
        raise BadRequest(f"question is too long for this context: {question_len} tokens, but "
                         f"a context that needs several windows of max_seq_len={max_seq_len} "
                         f"allows at most {max_seq_len - specials - stride - 1} "
                         f"(doc_stride={stride})")
    return room


def _normalizer_lowers(normalizer: dict[str, Any] | None) -> bool | None:
    """Whether ``normalizer`` lower-cases ASCII text; None when it may do more to it."""
    if normalizer is None:
        return False
    kind = normalizer.get("type")
    if kind == "BertNormalizer":
        return bool(normalizer.get("lowercase", True))
    if kind == "Lowercase":
        return True
    if kind in _ASCII_NOOP_NORMALIZERS:
        return False
    if kind == "Sequence":
        parts = [_normalizer_lowers(part) for part in normalizer.get("normalizers", [])]
        return None if None in parts else any(parts)
    return None


def _pair_template(full: Tokenizer, plain: Tokenizer) -> tuple[tuple[list[int], list[int],
                                                                      list[int]], list[int]] | None:
    """The special tokens the tokenizer writes around a (question, context) pair, as (head,
    middle, tail), and the type ids of head, question, middle, context and tail; None when the
    pair is not ``head question middle context tail`` with one type id for each part."""
    question, context = "who was there", "the cat sat there"
    pair = full.encode(question, context)
    q_ids, c_ids = (plain.encode(text, add_special_tokens=False).ids
                    for text in (question, context))
    ids, types, sequences = pair.ids, pair.type_ids, pair.sequence_ids
    try:
        q_at, c_at = sequences.index(0), sequences.index(1)
    except ValueError:
        return None
    q_end, c_end = q_at + len(q_ids), c_at + len(c_ids)
    if ids[q_at:q_end] != q_ids or ids[c_at:c_end] != c_ids or not q_end <= c_at:
        return None
    parts = [(0, q_at), (q_at, q_end), (q_end, c_at), (c_at, c_end), (c_end, len(ids))]
    type_ids = []
    for start, stop in parts:
        kinds = set(types[start:stop]) or {0}
        if len(kinds) != 1:
            return None
        type_ids.append(kinds.pop())
    if any(sequence is not None for sequence in sequences[:q_at] + sequences[q_end:c_at]
           + sequences[c_end:]):
        return None
    return (ids[:q_at], ids[q_end:c_at], ids[c_end:]), type_ids
