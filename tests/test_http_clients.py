"""The HTTP API through the real clients its users already have: the OpenAI Python SDK,
huggingface_hub's InferenceClient and tritonclient's HTTP client, against one server of a tiny
qa, embed and classify model. Every answer must equal the TCP protocol's for the same input."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.blocking import Client
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS
from tests.text_models import TINY_LABELS, build_tiny_repository

TEXTS = [CONTEXTS[0], QUESTIONS[1], CONTEXTS[3]]
ONE_TEXT = "one text"
TIMEOUT = 30


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[InferenceServer]:
    """One server of a repository of three tiny real models: qa, embed and classify."""
    repository = build_tiny_repository(tmp_path_factory.mktemp("http_clients_repository"),
                                       tiny_model_dir)
    config = ServerConfig(host="127.0.0.1", port=0, model_dir=str(repository),
                          num_inference_sessions=1, threads_per_session=1)
    with InferenceServer(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def tcp(server: InferenceServer) -> Iterator[Client]:
    with Client(*server.address) as client:
        yield client


@pytest.fixture(scope="module")
def base_url(server: InferenceServer) -> str:
    address = server.http_address
    assert address is not None
    host, port = address
    return f"http://{host}:{port}"


def tcp_vectors(tcp: Client, texts: list[str]) -> np.ndarray:
    return np.asarray(tcp.embed(texts, model="embed", timeout=TIMEOUT), dtype=np.float64)


def assert_same_answer(got: Any, want: dict[str, Any]) -> None:
    assert (got.answer, got.start, got.end) == (want["answer"], want["start"], want["end"])
    assert got.score == pytest.approx(want["score"], rel=1e-4)


# -- the OpenAI Python SDK ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def openai_client(base_url: str) -> Iterator[Any]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT)
    yield client
    client.close()


@pytest.mark.parametrize("encoding", ["float", "sdk_default_base64"])
@pytest.mark.parametrize("many", [False, True], ids=["one_text", "three_texts"])
def test_openai_sdk_embeddings_equal_the_tcp_embed_vectors(openai_client: Any, tcp: Client,
                                                           encoding: str, many: bool) -> None:
    texts = TEXTS if many else [ONE_TEXT]
    extra = {"encoding_format": "float"} if encoding == "float" else {}
    reply = openai_client.embeddings.create(model="embed", input=texts if many else ONE_TEXT,
                                            **extra)
    assert reply.model == "embed"
    assert [item.index for item in reply.data] == list(range(len(texts)))
    assert all(isinstance(item.embedding, list) for item in reply.data)  # decoded by the SDK
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens
    got = np.asarray([item.embedding for item in reply.data], dtype=np.float64)
    want = tcp_vectors(tcp, texts)
    assert got.shape == want.shape
    assert np.allclose(got, want, atol=1e-6)


def test_openai_sdk_default_asks_for_base64_which_the_server_sends_as_little_endian_f32(
        openai_client: Any, tcp: Client) -> None:
    raw = openai_client.embeddings.with_raw_response.create(model="embed", input=TEXTS)
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"
    wire = json.loads(raw.text)["data"]
    assert all(isinstance(item["embedding"], str) for item in wire)
    got = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
                    for item in wire])
    assert np.allclose(got, tcp_vectors(tcp, TEXTS), atol=1e-6)
    assert np.allclose([item.embedding for item in raw.parse().data], got, atol=0)


def test_openai_sdk_lists_every_served_model(openai_client: Any) -> None:
    models = list(openai_client.models.list())
    assert {m.id for m in models} == {"qa", "embed", "classify"}
    assert all(m.object == "model" for m in models)


# -- huggingface_hub's InferenceClient ---------------------------------------------------------
@pytest.fixture(scope="module")
def hub_offline_lifted() -> Iterator[None]:
    """huggingface_hub 1.x+ refuses every request, to this server's URL too, while
    HF_HUB_OFFLINE is set (as the test session sets it): lift it while these tests run. The
    clients are given this server's URL, so nothing reaches the Hub."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield


@pytest.fixture(scope="module")
def hf_client(base_url: str, hub_offline_lifted: None) -> Any:
    from huggingface_hub import InferenceClient

    return InferenceClient(model=base_url, timeout=TIMEOUT)


def test_hf_question_answering_at_the_root_gives_the_tcp_answer(hf_client: Any,
                                                               tcp: Client) -> None:
    for question, context in zip(QUESTIONS[:3], CONTEXTS[:3], strict=True):
        got = hf_client.question_answering(question=question, context=context)
        assert_same_answer(got, tcp.answer(question, context, model="qa", timeout=TIMEOUT))


def test_hf_question_answering_top_k_gives_that_many_answers_best_first(hf_client: Any,
                                                                        tcp: Client) -> None:
    question, context = QUESTIONS[4], CONTEXTS[4]
    best = hf_client.question_answering(question=question, context=context)
    answers = hf_client.question_answering(question=question, context=context, top_k=2)
    assert isinstance(answers, list) and len(answers) == 2
    assert answers[0].score >= answers[1].score
    assert (answers[0].answer, answers[0].start, answers[0].end) == \
        (best.answer, best.start, best.end)
    assert answers[0].score == pytest.approx(best.score, rel=1e-4)
    want = tcp.call("qa", {"question": question, "context": context, "top_k": 2},
                    model="qa", timeout=TIMEOUT)["answers"]
    for got, expected in zip(answers, want, strict=True):
        assert_same_answer(got, expected)


def test_hf_feature_extraction_at_the_root_gives_the_tcp_vector(hf_client: Any,
                                                                tcp: Client) -> None:
    got = hf_client.feature_extraction(ONE_TEXT)
    assert got.dtype == np.float32
    want = tcp_vectors(tcp, [ONE_TEXT])
    assert got.shape == want.shape == (1, 32)  # one vector per text, for one text too
    assert np.allclose(got, want, atol=1e-6)


def test_hf_text_classification_at_the_root_gives_the_tcp_label_first(hf_client: Any,
                                                                     tcp: Client) -> None:
    for text in TEXTS:
        got = hf_client.text_classification(text)
        want = tcp.classify(text, model="classify", timeout=TIMEOUT)
        assert [e.label for e in got] == sorted(want["scores"], key=want["scores"].get,
                                                reverse=True)
        assert set(e.label for e in got) == set(TINY_LABELS)
        assert got[0].label == want["label"]
        assert got[0].score == pytest.approx(want["score"], rel=1e-4)
        assert [e.score for e in got] == sorted((e.score for e in got), reverse=True)


def test_hf_text_classification_top_k_keeps_the_best_labels(hf_client: Any,
                                                            tcp: Client) -> None:
    got = hf_client.text_classification(TEXTS[0], top_k=1)
    want = tcp.classify(TEXTS[0], model="classify", timeout=TIMEOUT)
    assert [e.label for e in got] == [want["label"]]
    assert got[0].score == pytest.approx(want["score"], rel=1e-4)


def test_hf_question_answering_refuses_a_per_request_window_setting_by_name(
        hf_client: Any) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as caught:
        hf_client.question_answering(question=QUESTIONS[0], context=CONTEXTS[0], doc_stride=16)
    assert caught.value.response.status_code == 422
    body = caught.value.response.json()
    assert body["error_type"] == "bad_request" and "doc_stride" in body["error"]


def test_hf_clients_of_a_named_models_url_reach_that_model(base_url: str, tcp: Client,
                                                           hub_offline_lifted: None) -> None:
    from huggingface_hub import InferenceClient

    qa = InferenceClient(model=f"{base_url}/models/qa", timeout=TIMEOUT)
    assert_same_answer(qa.question_answering(question=QUESTIONS[0], context=CONTEXTS[0]),
                       tcp.answer(QUESTIONS[0], CONTEXTS[0], model="qa", timeout=TIMEOUT))
    embed = InferenceClient(model=f"{base_url}/models/embed", timeout=TIMEOUT)
    assert np.allclose(embed.feature_extraction(TEXTS[1]), tcp_vectors(tcp, [TEXTS[1]]),
                       atol=1e-6)
    classify = InferenceClient(model=f"{base_url}/models/classify", timeout=TIMEOUT)
    got = classify.text_classification(TEXTS[2])
    want = tcp.classify(TEXTS[2], model="classify", timeout=TIMEOUT)
    assert got[0].label == want["label"]
    assert got[0].score == pytest.approx(want["score"], rel=1e-4)


# -- tritonclient's HTTP client (KServe v2) ----------------------------------------------------
@pytest.fixture(scope="module")
def triton(server: InferenceServer) -> Iterator[Any]:
    import tritonclient.http as httpclient

    address = server.http_address
    assert address is not None
    client = httpclient.InferenceServerClient(url=f"{address[0]}:{address[1]}",
                                              network_timeout=TIMEOUT)
    yield client
    client.close()


def text_input(name: str, texts: list[str]) -> Any:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object), binary_data=False)
    return tensor


def requested(*names: str) -> list[Any]:
    import tritonclient.http as httpclient

    return [httpclient.InferRequestedOutput(name, binary_data=False) for name in names]


def strings(array: np.ndarray) -> list[str]:
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.tolist()]


def test_triton_client_sees_a_live_ready_server_and_ready_models(triton: Any) -> None:
    assert triton.is_server_live() is True
    assert triton.is_server_ready() is True
    assert all(triton.is_model_ready(name) is True for name in ("qa", "embed", "classify"))


def test_triton_client_reads_the_qa_models_tensors(triton: Any) -> None:
    meta = triton.get_model_metadata("qa")
    assert meta["name"] == "qa"
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == \
        [("question", "BYTES"), ("context", "BYTES")]
    assert {t["name"]: t["datatype"] for t in meta["outputs"]} == \
        {"answer": "BYTES", "score": "FP32", "start": "INT64", "end": "INT64"}


QA_PAIRS = [(QUESTIONS[1], CONTEXTS[1]), (QUESTIONS[2], CONTEXTS[2])]  # the second not ASCII


def qa_inputs() -> list[Any]:
    return [text_input("question", [q for q, _ in QA_PAIRS]),
            text_input("context", [c for _, c in QA_PAIRS])]


@pytest.mark.parametrize("outputs", ["json_requested", "none_requested"])
def test_triton_qa_infer_gives_the_tcp_answers(triton: Any, tcp: Client, outputs: str) -> None:
    wanted = requested("answer", "score", "start", "end") if outputs == "json_requested" \
        else None  # the client then asks for binary_data_output, answered with JSON data
    result = triton.infer("qa", qa_inputs(), outputs=wanted)
    want = [tcp.answer(q, c, model="qa", timeout=TIMEOUT) for q, c in QA_PAIRS]
    assert strings(result.as_numpy("answer")) == [w["answer"] for w in want]
    assert result.as_numpy("start").tolist() == [w["start"] for w in want]
    assert result.as_numpy("end").tolist() == [w["end"] for w in want]
    assert np.allclose(result.as_numpy("score"), [w["score"] for w in want], rtol=1e-4)
    assert result.as_numpy("start").shape == (2,)


def test_triton_qa_infer_returns_only_the_requested_outputs(triton: Any) -> None:
    result = triton.infer("qa", qa_inputs(), outputs=requested("answer"))
    assert [o["name"] for o in result.get_response()["outputs"]] == ["answer"]
    assert result.as_numpy("score") is None


def test_triton_infer_echoes_the_request_id(triton: Any) -> None:
    result = triton.infer("qa", qa_inputs(), outputs=requested("answer"), request_id="req-7")
    assert result.get_response()["id"] == "req-7"
    assert result.get_response()["model_name"] == "qa"


def test_triton_binary_tensor_input_is_refused_with_a_readable_422(triton: Any) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    tensor = httpclient.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([ONE_TEXT], dtype=object))  # binary_data=True
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("embed", [tensor])
    assert caught.value.status() == "422"
    assert "binary tensor data is not supported" in caught.value.message()


def test_triton_embed_infer_gives_the_tcp_vectors(triton: Any, tcp: Client) -> None:
    for wanted in (requested("embedding"), None):
        result = triton.infer("embed", [text_input("text", TEXTS)], outputs=wanted)
        got = result.as_numpy("embedding")
        want = tcp_vectors(tcp, TEXTS)
        assert got.shape == want.shape == (3, 32)
        assert np.allclose(got, want, atol=1e-6)


def test_triton_classify_infer_gives_the_tcp_labels(triton: Any, tcp: Client) -> None:
    for wanted in (requested("label", "score", "scores"), None):
        result = triton.infer("classify", [text_input("text", TEXTS)], outputs=wanted)
        want = [tcp.classify(text, model="classify", timeout=TIMEOUT) for text in TEXTS]
        assert strings(result.as_numpy("label")) == [w["label"] for w in want]
        assert np.allclose(result.as_numpy("score"), [w["score"] for w in want], rtol=1e-4)
        scores = result.as_numpy("scores")
        assert scores.shape == (3, len(TINY_LABELS))
        assert np.allclose(scores, [[w["scores"][label] for label in TINY_LABELS]
                                    for w in want], rtol=1e-4)


def test_an_unknown_model_is_not_ready_and_answered_404_in_json(triton: Any,
                                                                base_url: str) -> None:
    assert triton.is_model_ready("nope") is False
    for path in ("/v2/models/nope/ready", "/v2/models/nope"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base_url + path, timeout=TIMEOUT)
        assert caught.value.code == 404
        assert caught.value.headers.get_content_type() == "application/json"
        body = json.loads(caught.value.read())
        assert set(body) == {"error", "error_type"}
        assert body["error_type"] == "not_found" and "nope" in body["error"]


def test_triton_infer_on_an_unknown_model_raises_the_servers_message(triton: Any) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        triton.infer("nope", [text_input("text", TEXTS)], outputs=requested("label"))
    assert caught.value.status() == "404"
    assert "nope" in caught.value.message()
