"""The Redis layout serves a whole repository: every task and model through real Redis and
real worker processes, routed and answered as in one process, workers holding some models,
and the failures that belong to it (a model no live worker holds, a worker of another model,
a worker killed holding entries of two models)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from broker.connect import GROUP
from broker.local_server import RedisServer
from broker.wire import decode_reply, encode_work
from client import Client
from console.stats import format_stats
from protocol import BadRequest, Unavailable, encode_frame, qa_request
from protocol.messages import model_request
from server import InferenceServer, ServerConfig
from tests.broker_fixtures import (
    ROOT,
    assert_answered_once_each,
    running_redis,
    start_worker,
    stop_worker,
)
from tests.conftest import build_tiny_model_dir
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, freeze, wait_until
from tests.text_models import build_tiny_classify_dir, build_tiny_embed_dir

TEXTS = [*QUESTIONS, *CONTEXTS[:3]]
MODELS = ("classify", "embed", "many", "qa", "qa2")


@pytest.fixture(scope="module")
def repository(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A model of each task, the plug-in of docs/tasks.md (importable here, in the front end's
    process, and not in the workers': they run no task code), and a second QA model (so that a
    qa request must name one)."""
    root = tmp_path_factory.mktemp("brokered")
    shutil.copytree(tiny_model_dir, root / "qa")
    build_tiny_model_dir(root / "qa2", seed=7)
    build_tiny_embed_dir(root / "embed")
    build_tiny_classify_dir(root / "classify")
    plug_ins = tmp_path_factory.mktemp("plug_ins")
    (plug_ins / "mytasks").mkdir()
    (plug_ins / "mytasks" / "__init__.py").write_text("")
    doc = (ROOT / "docs" / "tasks.md").read_text()
    (plug_ins / "mytasks" / "classify_many.py").write_text(
        doc.split("# mytasks/classify_many.py\n", 1)[1].split("```", 1)[0])
    shutil.copytree(root / "classify", root / "many")
    meta = json.loads((root / "many" / "serving.json").read_text())
    meta["task"] = "mytasks.classify_many:ClassifyManyTask"
    (root / "many" / "serving.json").write_text(json.dumps(meta))
    sys.path.insert(0, str(plug_ins))
    yield root
    sys.path.remove(str(plug_ins))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path_factory.mktemp("redis"))


def serving(front: InferenceServer, model: str, workers: int) -> bool:
    """Whether ``model``'s backend at the front end counts ``workers`` serving workers."""
    backend: Any = front.models.models[model].backend
    return backend.monitor.serving_workers == workers


def front_end(url: str, repository: Path, **overrides: Any) -> InferenceServer:
    config = ServerConfig(port=0, model_dir=str(repository), broker=url, metrics_port=0,
                          **overrides)
    server = InferenceServer(config)
    server.start()
    return server


@pytest.fixture(scope="module")
def deployment(redis_server: RedisServer, repository: Path) -> Iterator[InferenceServer]:
    """A front end of the whole repository and one worker holding every model."""
    worker = start_worker(redis_server.url, repository)
    try:
        front = front_end(redis_server.url, repository)
        try:
            wait_until(lambda: all(serving(front, name, 1) for name in MODELS) and front.ready,
                       90)
            yield front
        finally:
            front.shutdown(10)
    finally:
        assert stop_worker(worker) == 0


def every_answer(address: Any) -> list[tuple[str, Any]]:
    """Each task's answers to the texts, from the server at ``address``."""
    with Client(*address) as client:
        futures = []
        for i, text in enumerate(TEXTS):
            futures.append(client.submit_op("embed", {"texts": [text, text[:20]]}))
            futures.append(client.submit_op("classify", {"text": text}))
            futures.append(client.submit_op("classify_many", {"texts": [text, "dull"]}))
            for model in ("qa", "qa2"):
                futures.append(client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6] * (1 + i % 3),
                                             model=model))
        return [future.result(timeout=60) for future in futures]


def assert_same(ours: Any, theirs: Any) -> None:
    """Equal maps and lists; floats to within float32's rounding."""
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert_same(ours[key], theirs[key])
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs, strict=True):
            assert_same(mine, other)
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    else:
        assert ours == theirs


def test_every_task_and_model_answers_as_the_in_process_server(
        deployment: InferenceServer, repository: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(repository), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as local:
        expected = every_answer(local.address)
        with Client(*local.address) as client:
            listed = client.models(timeout=30)
    answers = every_answer(deployment.address)
    for ours, theirs in zip(answers, expected, strict=True):
        assert_same(ours, theirs)
    with Client(*deployment.address) as client:
        assert client.models(timeout=30) == listed


def test_routing_refuses_as_in_one_process(deployment: InferenceServer) -> None:
    with Client(*deployment.address) as client:
        for fields, op, model, words in (
                ({"text": "x"}, "classify", "nope", "unknown model 'nope'"),
                ({"texts": ["x"]}, "embed", "qa", "model 'qa' serves 'qa' requests, not 'embed'"),
                ({"question": "q", "context": "c"}, "qa", None,
                 "several models serve 'qa' requests (qa, qa2)")):
            with pytest.raises(BadRequest, match=re.escape(words)):
                client.call(op, fields, model=model, timeout=30)


def test_each_model_has_its_own_broker_figures_in_stats_and_metrics(
        deployment: InferenceServer) -> None:
    with Client(*deployment.address) as client:
        client.call("embed", {"texts": ["figures"]}, timeout=30)
        # a worker's figures come with its heartbeat, once a second
        wait_until(lambda: client.stats(timeout=30)["models"]["embed"]["batches"] >= 1, 10)
        stats = client.stats(timeout=30)
    for name in MODELS:
        broker = stats["models"][name]["broker"]
        assert broker["stream"] == f"qa:work:{name}" and broker["serving_workers"] == 1
        assert {"stream_length", "pending", "in_flight"} <= broker.keys()
    embed = stats["models"]["embed"]
    assert embed["batches"] >= 1 and embed["requests"]["embed"]["ok"] >= 1
    assert stats["workers"] and {w["model"] for w in stats["workers"]} == set(MODELS)
    summary = format_stats(stats)  # client.py --stats: a broker line under each model
    assert summary.count("  broker       redis://127.0.0.1") == len(MODELS), summary
    port = deployment.metrics_address[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    for name in MODELS:
        for family in ("broker_stream_length", "broker_pending_entries",
                       "broker_serving_workers"):
            assert f'qa_server_{family}{{model="{name}"}}' in text, family


def test_an_entry_a_worker_cannot_run_is_answered_internal_and_the_worker_serves_on(
        deployment: InferenceServer, redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.xadd("qa:replies:probe", {"m": b""})  # workers never create a reply stream
    too_long = {"input_ids": np.ones((1, 100_000), np.int64),  # longer than the model takes
                "attention_mask": np.ones((1, 100_000), np.int64),
                "token_type_ids": np.zeros((1, 100_000), np.int64)}
    one_dim = msgpack.packb({"r": "qa:replies:probe", "i": 2, "t": time.time(),
                             "f": {"input_ids": ["<i8", "|u1", [3], b"\x01\x02\x03"]}})
    client.xadd("qa:work:embed", {"m": encode_work("qa:replies:probe", 1, too_long,
                                                   time.monotonic(), None)})
    client.xadd("qa:work:embed", {"m": one_dim})
    wait_until(lambda: client.xlen("qa:replies:probe") == 3, 30)
    replies = {r.number: r for r in (decode_reply(fields[b"m"]) for _, fields
                                     in client.xrange("qa:replies:probe")[1:])}
    assert replies[1].code == replies[2].code == "internal"
    assert "the model takes 128" in replies[1].message and "[rows, width]" in replies[2].message
    with Client(*deployment.address) as conn:
        assert conn.call("embed", {"texts": ["still serving"]}, timeout=30)["embeddings"]


def test_a_model_no_live_worker_holds_is_unavailable_at_once(
        redis_server: RedisServer, repository: Path) -> None:
    worker = start_worker(redis_server.url, repository, "--models", "qa,embed",
                          "--broker_prefix", "some")
    front = None
    try:
        front = front_end(redis_server.url, repository, broker_prefix="some")
        wait_until(lambda: serving(front, "qa", 1) and serving(front, "embed", 1), 90)
        with Client(*front.address) as client:
            assert client.call("embed", {"texts": ["held"]}, timeout=30)["embeddings"]
            assert client.answer(QUESTIONS[0], CONTEXTS[0], model="qa", timeout=30)
            with pytest.raises(Unavailable, match="no live worker holds model 'classify'"):
                client.call("classify", {"text": "nobody holds me"})  # no deadline: at once
            ping = client.ping(timeout=10)
            models = {m["name"]: m["ready"] for m in client.models(timeout=10)}
        assert ping["ready"] is False  # not every model is served
        assert models == {"classify": False, "embed": True, "many": False, "qa": True,
                          "qa2": False}
    finally:
        if front is not None:
            front.shutdown(10)
        assert stop_worker(worker) == 0


def test_a_worker_of_another_model_under_a_served_name_does_not_start(
        redis_server: RedisServer, repository: Path, tmp_path: Path) -> None:
    other = build_tiny_model_dir(tmp_path / "qa", seed=3)  # named qa; not the front ends' qa
    front = front_end(redis_server.url, repository, broker_prefix="mismatch")
    try:
        done = subprocess.run(
            [sys.executable, "server.py", "--role", "worker", "--broker", redis_server.url,
             "--broker_prefix", "mismatch", "--model_dir", str(other)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        front.shutdown(10)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and "model 'qa' of" in lines[0], done.stderr
    assert "is not the one the front ends under prefix 'mismatch' serve" in lines[0]
    assert "Traceback" not in done.stderr


def test_a_worker_given_a_model_its_folder_lacks_does_not_start(
        redis_server: RedisServer, repository: Path) -> None:
    done = subprocess.run([sys.executable, "server.py", "--role", "worker", "--broker",
                           redis_server.url, "--model_dir", str(repository), "--models",
                           "qa,summarize"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--models 'qa,summarize'" in done.stderr and "no summarize" in done.stderr


def pending(client: redis.Redis, pid: int) -> dict[str, int]:
    """Entries each model's stream has handed the worker process ``pid`` and not settled."""
    held = {}
    for name in client.smembers("kill:workers"):
        beat = client.get(f"kill:worker:{name.decode()}")
        if beat is None or json.loads(beat)["pid"] != pid:
            continue
        model = json.loads(beat)["model_name"]
        held[model] = len(client.xpending_range(f"kill:work:{model}", GROUP, min="-", max="+",
                                                count=1000, consumername=name.decode()))
    return held


def freeze_holding_two_models(client: redis.Redis, pid: int, timeout_s: float = 30) -> None:
    """Stop the worker (every thread) while it holds entries of both qa and embed."""
    deadline = time.monotonic() + timeout_s
    while True:
        freeze(pid)
        held = pending(client, pid)
        if held.get("qa", 0) > 0 and held.get("embed", 0) > 0:
            return
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"never held entries of both models: {held}"
        time.sleep(0.005)


def test_a_worker_killed_holding_entries_of_two_models_loses_none_and_answers_none_twice(
        redis_server: RedisServer, repository: Path) -> None:
    flags = ("--models", "qa,embed", "--broker_prefix", "kill")
    workers = [start_worker(redis_server.url, repository, *flags) for _ in range(2)]
    front = None
    try:
        front = front_end(redis_server.url, repository, broker_prefix="kill")
        wait_until(lambda: serving(front, "qa", 2) and serving(front, "embed", 2), 90)
        total, victim = 400, workers[0]
        frames = [encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 8, model="qa"))
                  if i % 2 else encode_frame(model_request(i, "embed", {"texts": TEXTS}))
                  for i in range(total)]
        conn = RawConnection(front.address, timeout=60)
        conn.send_raw(b"".join(frames))
        freeze_holding_two_models(redis_server.client(), victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        assert_answered_once_each(conn, total)
        conn.close()
    finally:
        if front is not None:
            front.shutdown(10)
        for worker in workers:
            if worker.poll() is None:
                stop_worker(worker)
