"""``client.py --stats`` (and ``--json``) against real servers: the summary per model, the raw
JSON, and the exit codes of the other one-shot modes."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from console.stats import format_stats
from protocol import BadRequest
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS
from tests.text_models import build_tiny_embed_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[InferenceServer]:
    """A server of a tiny qa and embed model that has answered two qa requests, refused one
    and answered one embed request."""
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(tiny_model_dir, repository / "qa")
    build_tiny_embed_dir(repository / "emb")
    config = ServerConfig(port=0, model_dir=str(repository), num_inference_sessions=1,
                          threads_per_session=1)
    with InferenceServer(config) as srv:
        with Client(*srv.address) as client:
            for question, context in zip(QUESTIONS[:2], CONTEXTS[:2], strict=True):
                client.answer(question, context, timeout=30)
            with pytest.raises(BadRequest):
                client.answer("x" * 5000, CONTEXTS[0], timeout=30)  # over --max_question_chars
            client.embed(CONTEXTS[:3], timeout=30)
        yield srv


def client_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "client.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def at(srv: InferenceServer) -> list[str]:
    return ["--host", srv.address[0], "--port", str(srv.address[1])]


def section(out: str, title: str) -> str:
    """The lines of one section of the summary, from its title to the next empty line."""
    start = out.index(title)
    end = out.find("\n\n", start)
    return out[start:] if end < 0 else out[start:end]


def test_stats_prints_the_servers_figures_then_each_models(server: InferenceServer) -> None:
    done = client_cli(*at(server), "--stats")
    assert done.returncode == 0, done.stderr
    head = section(done.stdout, f"{server.address[0]}:{server.address[1]}: ready, up ")
    assert re.search(r"connections  [12] open, [23] since start", head)
    assert "events       none" in head
    assert re.search(r"requests     \d+ ok, 1 failed \(qa bad_request 1\); by op: ", head)
    qa = section(done.stdout, "model qa: qa (tiny-random-bert-qa-0); outputs NOT MEANINGFUL")
    assert "requests     2 ok, 1 failed (qa bad_request 1); " in qa and "/s since start" in qa
    assert "batches      2, mean size 1.00" in qa
    rows = {line.split()[0]: line.split()[1:] for line in qa.splitlines()[5:8]}
    assert set(rows) == {"queue", "engine", "request"} and rows["request"][0] == "2"
    assert float(rows["request"][-1]) >= float(rows["request"][2]) > 0  # max >= p50
    emb = section(done.stdout, "model emb: embed (tiny-random-embed-0)")
    assert "requests     1 ok, 0 failed" in emb and "engine       onnxruntime" in emb


def test_stats_json_prints_the_raw_stats_and_json_alone_is_refused(
        server: InferenceServer) -> None:
    done = client_cli(*at(server), "--stats", "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert set(stats["models"]) == {"emb", "qa"}
    assert stats["models"]["qa"]["requests"]["qa"] == {"ok": 2, "bad_request": 1}
    assert stats["models"]["emb"]["request_time"]["count"] == 1
    alone = client_cli(*at(server), "--json")
    assert alone.returncode == 2 and "--json needs --stats" in alone.stderr


def test_the_summary_takes_either_shape_of_the_top_level_model(server: InferenceServer) -> None:
    with Client(*server.address) as client:
        stats = client.stats(timeout=30)
    for lumped in ({"name": "emb, qa", "meaningful": False},  # every model in one
                   [{"name": "emb", "meaningful": True}, {"name": "qa", "meaningful": False}]):
        text = format_stats({**stats, "model": lumped})
        assert "model emb: embed" in text and "model qa: qa" in text
    older = {key: value for key, value in stats.items() if key != "models"}  # one model
    text = format_stats({**older, "model": {"name": "qa", "meaningful": False}})
    assert text.count("\nmodel ") == 1 and "\nmodel qa; outputs NOT MEANINGFUL\n" in text
    assert re.search(r"\n  requests     \d+ ok, 1 failed \(qa bad_request 1\)", text)


def test_stats_of_a_server_that_wants_a_token_exits_1_without_one(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("secret-token-1\n", encoding="utf-8")
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, auth_token_file=str(tokens))
    with InferenceServer(config) as srv:
        refused = client_cli(*at(srv), "--stats")
        wrong = client_cli(*at(srv), "--stats", "--token", "nope")
        allowed = client_cli(*at(srv), "--stats", "--json", "--token_file", str(tokens))
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    assert wrong.returncode == 1 and "unauthorized" in wrong.stderr
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["requests"]["auth"]["ok"] == 1


class Peer:
    """A TCP listener on 127.0.0.1 that accepts one connection and then either says nothing
    (``silent``) or closes it at once."""

    def __init__(self, silent: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silent, self.done = silent, threading.Event()
        self.thread = threading.Thread(target=self._serve, name="stats-peer", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            if self.silent:
                self.done.wait(60)

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.listener.close()


@pytest.mark.parametrize("silent,status,says", [(True, 1, "no reply"), (False, 2, "closed")])
def test_stats_exits_1_on_no_reply_and_2_when_the_connection_is_lost(
        silent: bool, status: int, says: str) -> None:
    peer = Peer(silent)
    try:
        done = client_cli("--port", str(peer.port), "--stats", "--timeout", "0.5")
    finally:
        peer.close()
    assert done.returncode == status and says in done.stderr and "Traceback" not in done.stderr


def test_stats_of_an_unreachable_server_exits_2() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    done = client_cli("--port", str(free_port), "--stats")
    assert done.returncode == 2 and "cannot connect" in done.stderr


def test_stats_read_by_a_reader_that_stops_early_end_quietly(server: InferenceServer) -> None:
    # `client.py --stats --json | head -1`: the pipe closes under the print
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"],
                              stdin=subprocess.PIPE)
    assert reader.stdin is not None
    try:
        done = subprocess.run([sys.executable, "client.py", *at(server), "--stats", "--json"],
                              cwd=ROOT, stdout=reader.stdin, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
