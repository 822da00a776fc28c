"""The client side of several tasks and models: Client.embed / classify / models and model
routing, the REPL of each task, and stress_test.py --task, against a real server serving a
repository of tiny real models (two qa, one embed, one classify)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.mix import load_mix, load_texts
from bench.plots import describe_server
from bench.runs import run_closed_loop
from client import Client
from protocol import BadRequest, InternalError
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS
from tests.text_models import TINY_LABELS, build_tiny_classify_dir, build_tiny_embed_dir

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["cls", "emb", "qa", "qa2"]


@pytest.fixture(scope="module")
def repository(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository: every subfolder holding serving.json is a model of that name."""
    root = tmp_path_factory.mktemp("repository")
    shutil.copytree(tiny_model_dir, root / "qa")
    shutil.copytree(tiny_model_dir, root / "qa2")
    build_tiny_embed_dir(root / "emb")
    build_tiny_classify_dir(root / "cls")
    (root / "notes").mkdir()  # a folder without serving.json is not a model
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(repository), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv:
        yield srv


@pytest.fixture()
def client(server: InferenceServer) -> Iterator[Client]:
    with Client(*server.address) as c:
        yield c


def run(server: InferenceServer, program: str, *args: str, stdin: str = ""
        ) -> subprocess.CompletedProcess[str]:
    host, port = server.address
    return subprocess.run([sys.executable, program, "--host", host, "--port", str(port), *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=180)


def ok_count(client: Client, model: str, op: str) -> int:
    return client.stats()["models"][model]["requests"].get(op, {}).get("ok", 0)


# -- the library -------------------------------------------------------------------------------
def test_models_lists_every_served_model_with_its_task_inputs_and_warning(client: Client) -> None:
    models = {m["name"]: m for m in client.models(timeout=30)}
    assert sorted(models) == NAMES
    assert [(models[n]["task"], models[n]["op"]) for n in NAMES] == [
        ("classify", "classify"), ("embed", "embed"), ("qa", "qa"), ("qa", "qa")]
    assert set(models["qa"]["inputs"]) == {"question", "context"}
    assert set(models["emb"]["inputs"]) == {"texts"} and set(models["cls"]["inputs"]) == {"text"}
    assert all(m["ready"] and not m["meaningful"] and m["warning"] for m in models.values())


def test_embed_gives_one_unit_vector_per_text_and_pipelines(client: Client) -> None:
    texts = [CONTEXTS[0], QUESTIONS[0], CONTEXTS[0]]
    vectors = client.embed(texts, timeout=30)  # the only embed model: no name needed
    assert len(vectors) == 3 and len({len(v) for v in vectors}) == 1
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)  # the same text, the same vector
    futures = [client.submit_embed([text], model="emb") for text in CONTEXTS]  # all in flight
    results = [f.result(timeout=30) for f in futures]
    assert all(r["dim"] == len(vectors[0]) and len(r["embeddings"]) == 1 for r in results)
    assert results[0]["embeddings"][0] == pytest.approx(vectors[0], abs=1e-5)
    with pytest.raises(TypeError):
        client.embed("one string, not a list of texts")


def test_classify_gives_a_label_its_score_and_every_probability(client: Client) -> None:
    result = client.classify(CONTEXTS[1], model="cls", timeout=30)
    assert result["label"] in TINY_LABELS and set(result["scores"]) == set(TINY_LABELS)
    assert result["score"] == pytest.approx(result["scores"][result["label"]])
    assert result["score"] == max(result["scores"].values())
    assert sum(result["scores"].values()) == pytest.approx(1.0, abs=1e-4)
    futures = [client.submit_classify(text) for text in CONTEXTS]
    assert all(f.result(timeout=30)["label"] in TINY_LABELS for f in futures)


def test_model_routes_each_request_and_refusals_are_bad_requests(client: Client) -> None:
    before = {name: ok_count(client, name, "qa") for name in ("qa", "qa2")}
    assert "answer" in client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30, model="qa2")
    futures = [client.submit(QUESTIONS[i], CONTEXTS[i], model="qa") for i in range(3)]
    assert all("answer" in f.result(timeout=30) for f in futures)
    assert ok_count(client, "qa2", "qa") - before["qa2"] == 1
    assert ok_count(client, "qa", "qa") - before["qa"] == 3
    refusals = {
        "several models serve 'qa'": lambda: client.answer("Who?", "Bob.", timeout=30),
        "unknown model 'nope'": lambda: client.classify("Hi.", model="nope", timeout=30),
        "serves 'qa' requests, not 'embed'": lambda: client.embed(["Hi."], model="qa",
                                                                  timeout=30),
        "unknown op": lambda: client.call("sing", {"song": "la"}, timeout=30),
    }
    for words, refused in refusals.items():
        with pytest.raises(BadRequest, match=words):
            refused()


# -- the command line and the REPL -------------------------------------------------------------
def test_repl_of_an_embed_model_prints_the_cosine_similarity_and_dim(
        server: InferenceServer) -> None:
    same = run(server, "client.py", "--model", "emb", stdin=f"{CONTEXTS[2]}\n{CONTEXTS[2]}\n")
    assert same.returncode == 0, same.stderr
    assert "cosine similarity: 1.0000  dim: 32  latency: " in same.stdout
    assert same.stdout.count("random weights") == 1  # this model's warning, once
    other = run(server, "client.py", "--model", "emb", "--context", CONTEXTS[0],
                stdin=f"{QUESTIONS[3]}\n")  # --context is the first text
    similarity = float(other.stdout.split("cosine similarity: ")[1].split()[0])
    assert other.returncode == 0 and -1.0 <= similarity < 0.9999


def test_repl_of_a_classify_model_prints_label_and_score(server: InferenceServer) -> None:
    done = run(server, "client.py", "--model", "cls", stdin=f"{CONTEXTS[1]}\n\n{CONTEXTS[4]}\n")
    assert done.returncode == 0, done.stderr
    labels = [line.split("label: ")[1].split()[0] for line in done.stdout.splitlines()
              if "label: " in line]
    assert len(labels) == 2 and set(labels) <= set(TINY_LABELS)
    assert "empty text" in done.stdout and done.stdout.count("scores: ") == 2


def test_repl_starts_in_the_qa_model_named_qa_and_switches_on_command(
        server: InferenceServer) -> None:
    session = (f"{CONTEXTS[0]}\n{QUESTIONS[0]}\n/models\n/model nope\n/model emb\n"
               f"{CONTEXTS[1]}\n{CONTEXTS[1]}\n/model cls\n{CONTEXTS[2]}\n")
    done = run(server, "client.py", stdin=session)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert "several models" not in out and "model qa (qa)" in out  # qa, not qa2: by its name
    assert "also served: cls (classify), emb (embed), qa2 (qa). /models" in out
    assert out.count("answer: ") == 1 and "no model 'nope'" in out
    assert " *3. qa: qa" in out  # /models marks the one in use
    assert "cosine similarity: 1.0000" in out and out.count("label: ") == 1
    assert out.count("NOT MEANINGFUL") == 1 and out.count("random weights") == 2


def test_repl_asks_which_of_several_models_when_none_is_a_qa_model(
        repository: Path, tmp_path: Path) -> None:
    for name in ("cls", "emb"):
        shutil.copytree(repository / name, tmp_path / "models" / name)
    config = ServerConfig(port=0, model_dir=str(tmp_path / "models"), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv:
        done = run(srv, "client.py", stdin=f"7\nemb\n{CONTEXTS[1]}\n{CONTEXTS[1]}\n")
    assert done.returncode == 0, done.stderr
    assert "several models" in done.stdout and "pick a number from 1 to 2" in done.stdout
    assert "cosine similarity: 1.0000" in done.stdout


def test_cli_model_flag_routes_the_one_shot_and_an_unknown_model_exits_2(
        server: InferenceServer) -> None:
    named = run(server, "client.py", "--model", "qa2", "--question", QUESTIONS[4], "--context",
                CONTEXTS[4])
    assert named.returncode == 0 and "answer: " in named.stdout
    assert named.stderr.count("NOT MEANINGFUL") == 1
    unnamed = run(server, "client.py", "--question", QUESTIONS[4], "--context", CONTEXTS[4])
    assert unnamed.returncode == 1 and "several models serve 'qa'" in unnamed.stderr
    unknown = run(server, "client.py", "--model", "nope")
    assert unknown.returncode == 2 and "no model 'nope'" in unknown.stderr
    assert "emb (embed)" in unknown.stderr  # and says what is served


# -- stress_test.py --task ---------------------------------------------------------------------
def test_the_mix_gives_texts_and_requests_of_each_task(tmp_path: Path) -> None:
    texts = load_texts()
    assert len(texts) == 2 * len(load_mix("qa"))  # each pair's question and context
    embeds = load_mix("embed", texts_per_request=3)
    assert len(embeds) == len(texts) and embeds[0] == {"texts": texts[:3]}
    sent = [text for request in embeds for text in request["texts"]]
    assert sent == [texts[i % len(texts)] for i in range(3 * len(texts))]  # round, 3 times
    assert load_mix("classify")[1] == {"text": texts[1]}
    own = tmp_path / "texts.jsonl"
    own.write_text('{"text": "One."}\n{"question": "Q?", "context": "C."}\n')
    assert load_texts(own) == ["One.", "Q?", "C."]
    own.write_text('{"label": 1}\n')
    with pytest.raises(ValueError, match="line 1.*'text'"):
        load_texts(own)


def test_stress_test_task_embed_end_to_end(server: InferenceServer, client: Client,
                                          tmp_path: Path) -> None:
    before = ok_count(client, "emb", "embed")
    report, plot = tmp_path / "embed.json", tmp_path / "embed.png"
    done = run(server, "stress_test.py", "--no_progress", "--task", "embed",
               "--texts_per_request", "4", "--num_simultaneous_clients", "2",
               "--num_total_clients", "3", "--num_request_per_client", "4", "--warmup", "2",
               "--json", str(report), "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    assert "task: embed, the model serving it, 4 texts per request" in done.stdout
    assert "requests: 12   ok: 12   errors: none" in done.stdout and "p99" in done.stdout
    assert ok_count(client, "emb", "embed") - before == 12 + 2  # and the warm-up's
    assert f"wrote every figure of 1 run(s) to {report.resolve()}" in done.stdout
    assert f"wrote the plot to {plot.resolve()}" in done.stdout and plot.stat().st_size > 0
    saved = json.loads(report.read_text())["runs"][0]
    assert (saved["settings"]["op"], saved["settings"]["model"],
            saved["settings"]["texts_per_request"]) == ("embed", None, 4)
    assert saved["server"]["batch_rows"] == 4 * 12  # one row per text
    # the server's figures are the model's the requests went to, and it is named, alone
    [server_line] = [line for line in done.stdout.splitlines() if line.startswith("server: ")]
    assert "model emb (" in server_line and "cls" not in server_line, server_line
    assert saved["server"]["served_model"] == "emb" and list(saved["server"]["requests"]) == \
        ["embed"]
    assert "model emb (" in describe_server([saved])  # the plot's title


def test_stress_test_names_the_model_and_refuses_a_run_the_server_would_refuse(
        server: InferenceServer) -> None:
    host, port = server.address
    result = run_closed_loop(host, port, clients=2, requests_per_client=3, processes=1,
                             pairs=load_mix("classify"), op="classify", model="cls",
                             progress=False)
    assert result["ok"] == result["requests"] == 6
    assert result["settings"]["op"] == "classify" and result["settings"]["model"] == "cls"
    for args, why in [(["--task", "qa"], "several models serve qa requests"),
                      (["--task", "classify", "--model", "emb"], "'emb' serves embed"),
                      (["--model", "nope"], "no model 'nope'")]:
        done = run(server, "stress_test.py", "--no_progress", *args)
        assert done.returncode == 2 and why in done.stderr and "emb (embed)" in done.stderr
    qa2 = run(server, "stress_test.py", "--no_progress", "--model", "qa2",
              "--num_simultaneous_clients", "1", "--num_total_clients", "1",
              "--num_request_per_client", "3", "--warmup", "0")
    assert qa2.returncode == 0 and "task: qa, model qa2" in qa2.stdout
    bad = run(server, "stress_test.py", "--texts_per_request", "2")  # qa has no texts
    assert bad.returncode == 2 and "--texts_per_request needs --task embed" in bad.stderr


# -- a plug-in task ----------------------------------------------------------------------------
def _docs_plug_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mytasks/classify_many.py: the example of docs/tasks.md, as written, importable."""
    doc = (ROOT / "docs" / "tasks.md").read_text()
    (tmp_path / "mytasks").mkdir(exist_ok=True)
    (tmp_path / "mytasks" / "__init__.py").write_text("")
    (tmp_path / "mytasks" / "classify_many.py").write_text(
        doc.split("# mytasks/classify_many.py\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "mytasks" or n.startswith("mytasks.")]:
        monkeypatch.delitem(sys.modules, name)  # another test's folder


def _plug_in_folder(repository: Path, tmp_path: Path, name: str, task: str) -> Path:
    """A copy of the repository's classifier whose serving.json names the plug-in ``task``."""
    folder = Path(shutil.copytree(repository / "cls", tmp_path / "models" / name))
    meta = json.loads((folder / "serving.json").read_text())
    (folder / "serving.json").write_text(json.dumps({**meta, "task": task}))
    return folder


def test_a_plug_in_result_msgpack_cannot_carry_fails_alone_as_internal(
        repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to get no reply at all (the encoding failed after the request was counted ok)."""
    _docs_plug_in(tmp_path, monkeypatch)
    (tmp_path / "mytasks" / "raw.py").write_text(
        "import numpy as np\n"
        "from mytasks.classify_many import ClassifyManyTask\n"
        "from protocol.errors import BadRequest\n\n"
        "class RawTask(ClassifyManyTask):\n"
        "    op = 'classify_raw'\n\n"
        "    def postprocess(self, features, logits):\n"
        "        out = super().postprocess(features, logits)\n"
        "        if features.rows == 2:\n"
        "            out['raw'] = np.float32(1.0)  # msgpack cannot pack a numpy scalar\n"
        "        if features.rows == 3:\n"
        "            raise BadRequest({'not', 'a', 'string'})  # nor a set, in its message\n"
        "        return out\n")
    folder = _plug_in_folder(repository, tmp_path, "raw", "mytasks.raw:RawTask")
    config = ServerConfig(port=0, model_dir=str(folder), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        bad = client.submit_op("classify_raw", {"texts": ["a", "b"]})
        odd = client.submit_op("classify_raw", {"texts": ["a", "b", "c"]})
        good = client.submit_op("classify_raw", {"texts": ["a"]})
        with pytest.raises(InternalError, match="the result could not be encoded"):
            bad.result(timeout=30)
        with pytest.raises(InternalError, match="the bad_request error could not be encoded"):
            odd.result(timeout=30)
        assert len(good.result(timeout=30)["labels"]) == 1
        assert client.stats(timeout=30)["requests"]["classify_raw"] == {"internal": 2, "ok": 1}


def test_a_plug_in_taking_an_op_the_server_answers_itself_fails_the_start(
        repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _docs_plug_in(tmp_path, monkeypatch)
    (tmp_path / "mytasks" / "pinging.py").write_text(
        "from mytasks.classify_many import ClassifyManyTask\n\n"
        "class PingTask(ClassifyManyTask):\n"
        "    op = 'ping'\n")
    folder = _plug_in_folder(repository, tmp_path, "pinging", "mytasks.pinging:PingTask")
    config = ServerConfig(port=0, model_dir=str(folder), num_inference_sessions=1)
    with pytest.raises(ValueError, match="op 'ping', which the server answers itself"):
        InferenceServer(config).start()


def test_a_plug_in_task_through_the_client_and_the_repl(
        repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _docs_plug_in(tmp_path, monkeypatch)
    folder = _plug_in_folder(repository, tmp_path, "many",
                             "mytasks.classify_many:ClassifyManyTask")
    config = ServerConfig(port=0, model_dir=str(folder), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv, Client(*srv.address) as client:
        (model,) = client.models(timeout=30)
        assert (model["name"], model["op"]) == ("many", "classify_many")
        result = client.call("classify_many", {"texts": ["great film", "dull"]}, timeout=30)
        assert len(result["labels"]) == 2 and set(result["labels"]) <= set(TINY_LABELS)
        future = client.submit_op("classify_many", {"texts": ["ok"]}, model="many")
        assert len(future.result(timeout=30)["scores"]) == 1
        with pytest.raises(BadRequest, match="1 to 64"):  # the task's own check
            client.call("classify_many", {"texts": "one"}, timeout=30)
        done = run(srv, "client.py", stdin="great film\n")
    assert done.returncode == 0, done.stderr
    assert "texts (array of 1 to 64 strings)> " in done.stdout and "labels: ['" in done.stdout
