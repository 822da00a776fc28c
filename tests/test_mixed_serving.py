"""Models of every task served side by side, in one process and in worker processes
(through Redis: tests/test_broker_repository.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import Client
from engines import load_engine
from engines.model_dir import load_model_info
from protocol.messages import EmbedRequest
from server import InferenceServer, ServerConfig
from tasks import load_task
from tests.helpers import CONTEXTS, QUESTIONS, Reference
from tests.text_models import TINY_LABELS, build_tiny_classify_dir, build_tiny_embed_dir

TEXTS = [*QUESTIONS, *CONTEXTS[:3]]


@pytest.fixture(scope="module")
def repository(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    shutil.copytree(tiny_model_dir, root / "qa")
    build_tiny_embed_dir(root / "embed")
    build_tiny_classify_dir(root / "classify")
    return root


def reference_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    """The vectors of the task and the ONNX engine called in-process, one text at a time."""
    task = load_task(model_dir, load_model_info(model_dir), ServerConfig())
    engine = load_engine("onnx", model_dir, threads=1)
    rows = []
    for text in texts:
        features = [task.features(EmbedRequest(id=0, texts=(text,)))]
        outputs = task.split_outputs(features, engine.run(task.collate(features)))[0]
        rows.append(task.postprocess(features[0], *outputs)["embeddings"][0])
    return np.array(rows)


@pytest.fixture(scope="module", params=[1, 2], ids=["in-process", "2-worker-processes"])
def server(request: pytest.FixtureRequest, repository: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(repository), workers=request.param,
                          num_inference_sessions=1, threads_per_session=1, max_batch_size=8)
    with InferenceServer(config) as srv:
        yield srv


def test_every_task_answers_pipelined_requests_on_one_connection(server: InferenceServer,
                                                                repository: Path) -> None:
    expected_vectors = reference_embeddings(repository / "embed", TEXTS)
    qa = Reference(repository / "qa")
    with Client(*server.address) as client:
        futures = []
        for i, text in enumerate(TEXTS):
            futures.append(("embed", i, client.submit_op("embed", {"texts": [text]})))
            futures.append(("classify", i, client.submit_op("classify", {"text": text})))
            q, c = QUESTIONS[i % 6], CONTEXTS[i % 6]
            futures.append(("qa", (q, c), client.submit(q, c)))
        for kind, key, future in futures:
            result = future.result(timeout=60)
            if kind == "embed":
                vector = np.array(result["embeddings"][0])
                assert vector == pytest.approx(expected_vectors[key], abs=1e-4)
            elif kind == "classify":
                assert result["label"] in TINY_LABELS
                assert sum(result["scores"].values()) == pytest.approx(1.0, abs=1e-5)
            else:
                assert result["answer"] == qa.answer(*key)["answer"]
        stats = client.stats(timeout=30)
    for name, op in (("qa", "qa"), ("embed", "embed"), ("classify", "classify")):
        assert stats["models"][name]["requests"][op]["ok"] == len(TEXTS)
    assert stats["in_flight"] == 0
