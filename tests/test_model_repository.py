"""A model repository: several prepared models served at once by one server, each with its own
sessions, queue and statistics, and requests routed by their ``model`` field."""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import models_request, qa_request
from server import InferenceServer, ServerConfig
from tests.conftest import build_tiny_model_dir
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, Reference


@pytest.fixture(scope="module")
def repository(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two QA models that answer differently (other random weights), and a folder that is not
    a model (ignored)."""
    root = tmp_path_factory.mktemp("repository")
    shutil.copytree(tiny_model_dir, root / "alpha")
    build_tiny_model_dir(root / "beta", seed=7)
    (root / "notes").mkdir()
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(repository), num_inference_sessions=1,
                          threads_per_session=1, max_batch_size=4, metrics_port=0)
    with InferenceServer(config) as srv:
        yield srv


def ask(conn: RawConnection, messages: list[dict]) -> dict[int, dict]:
    for message in messages:
        conn.send(message)
    return conn.recv_replies(len(messages))


def test_each_request_is_answered_by_the_model_it_names(server: InferenceServer,
                                                        repository: Path) -> None:
    references = {name: Reference(repository / name) for name in ("alpha", "beta")}
    differ = [references["alpha"].answer(q, c) != references["beta"].answer(q, c)
              for q, c in zip(QUESTIONS, CONTEXTS, strict=True)]
    assert any(differ), "the two models must answer differently for this test to mean anything"
    conn = RawConnection(server.address)
    messages = [qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6], model=("alpha", "beta")[i % 2])
                for i in range(24)]
    replies = ask(conn, messages)
    for message in messages:
        reply = replies[message["id"]]
        assert reply["ok"], reply
        expected = references[message["model"]].answer(message["question"], message["context"])
        assert reply["result"]["answer"] == expected["answer"]
        assert reply["result"]["score"] == pytest.approx(expected["score"], rel=1e-4, abs=1e-6)
    conn.close()


def test_a_request_naming_no_model_is_refused_when_several_serve_its_op(
        server: InferenceServer) -> None:
    conn = RawConnection(server.address)
    replies = ask(conn, [qa_request(1, "Who?", "Ada."),
                         qa_request(2, "Who?", "Ada.", model="gamma"),
                         {"id": 3, "op": "embed", "texts": ["a"]},
                         {"id": 4, "op": "embed", "texts": ["a"], "model": "alpha"}])
    assert all(reply["error"]["code"] == "bad_request" for reply in replies.values())
    assert "several models serve 'qa'" in replies[1]["error"]["message"]
    assert "unknown model 'gamma'" in replies[2]["error"]["message"]
    assert "no model here serves 'embed'" in replies[3]["error"]["message"]
    assert "model 'alpha' serves 'qa' requests, not 'embed'" in replies[4]["error"]["message"]
    conn.close()


def test_the_models_op_lists_every_model_with_its_task_inputs_and_meaning(
        server: InferenceServer) -> None:
    conn = RawConnection(server.address)
    result = ask(conn, [models_request(9)])[9]["result"]
    conn.close()
    assert [m["name"] for m in result["models"]] == ["alpha", "beta"]
    for model in result["models"]:
        assert model["task"] == "qa" and model["op"] == "qa" and model["ready"] is True
        assert set(model["inputs"]) == {"question", "context"}
        assert model["meaningful"] is False and "NOT MEANINGFUL" in model["warning"]


def test_stats_and_metrics_are_kept_per_model(server: InferenceServer) -> None:
    conn = RawConnection(server.address)
    ask(conn, [qa_request(100 + i, QUESTIONS[0], CONTEXTS[0], model="beta") for i in range(5)])
    conn.close()
    result, _, _ = server.collect_stats()
    beta, alpha = result["models"]["beta"], result["models"]["alpha"]
    assert beta["requests"]["qa"]["ok"] - alpha["requests"]["qa"]["ok"] == 5
    assert result["requests"]["qa"]["ok"] == beta["requests"]["qa"]["ok"] + \
        alpha["requests"]["qa"]["ok"]
    assert result["admitted"] == alpha["admitted"] + beta["admitted"]
    assert beta["batches"] >= 1 and beta["task"] == "qa" and beta["queue_depth"] == 0
    host, port = server.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    key = ("qa_server_model_requests_total",
           (("model", "beta"), ("op", "qa"), ("outcome", "ok")))
    assert samples[key] == beta["requests"]["qa"]["ok"]
    assert samples[("qa_server_model_ready", (("model", "alpha"),))] == 1
    assert samples[("qa_server_model_batches_total", (("model", "beta"),))] == beta["batches"]
    assert samples[("qa_server_model_request_duration_seconds_count", (("model", "beta"),))] \
        == beta["request_time"]["count"]


def test_a_repositorys_stats_describe_each_model_apart_never_lumped(
        server: InferenceServer) -> None:
    result, _, _ = server.collect_stats()
    assert "model" not in result and "engine" not in result and "batching" not in result
    for name in ("alpha", "beta"):
        entry = result["models"][name]
        assert entry["meaningful"] is False and "NOT MEANINGFUL" in entry["warning"]
        assert entry["source"] and entry["engine"]["type"] == "onnx"
        assert entry["batching"]["mode"] == "auto"
    host, port = server.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    [info] = [s for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == "qa_server_info"]
    assert info.labels["model"] == "alpha, beta" and info.labels["engine"] == "onnx"


def test_models_left_out_of_a_repository_are_named_in_the_log(
        repository: Path, tiny_model_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    from engines.model_dir import find_models

    with caplog.at_level("WARNING", logger="dispatch.models"):
        assert [name for name, _ in find_models(repository)] == ["alpha", "beta"]
    assert "not served, no serving.json in them: notes" in caplog.text
    root = Path(shutil.copytree(tiny_model_dir, tmp_path / "root"))  # a model folder itself...
    shutil.copytree(tiny_model_dir, root / "embed")  # ...holding another model
    caplog.clear()
    with caplog.at_level("WARNING", logger="dispatch.models"):
        assert [name for name, _ in find_models(root)] == ["root"]
    assert "models in its subfolders (embed) are not served" in caplog.text


def test_a_folder_without_models_fails_the_start_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    config = ServerConfig(port=0, model_dir=str(tmp_path))
    with pytest.raises(Exception, match="no prepared model .*prepare_model.py"):
        InferenceServer(config).start()


@pytest.mark.parametrize("edit, why", [
    ({"labels": ["only", "two"]}, "3 logits, serving.json names 2 labels"),
    ({"task": "embed"}, "embeddings must have shape"),  # a classifier's folder, told embed
])
def test_a_model_its_task_cannot_read_fails_the_start(tmp_path: Path, edit: dict,
                                                      why: str) -> None:
    """Checked on the warm-up's outputs: it used to serve, failing every request."""
    import json

    from tests.text_models import build_tiny_classify_dir

    folder = build_tiny_classify_dir(tmp_path / "cls")
    meta = json.loads((folder / "serving.json").read_text())
    (folder / "serving.json").write_text(json.dumps({**meta, **edit}))
    config = ServerConfig(port=0, model_dir=str(folder), num_inference_sessions=1)
    with pytest.raises(Exception, match=why):
        InferenceServer(config).start()
