"""Token authentication (--auth_token_file) against a real server on 127.0.0.1, real sockets."""

from __future__ import annotations

import hmac
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client, ConnectionLost
from dispatch.auth import TokenSet
from protocol import Unauthorized, auth_request, encode_frame, ping_request, qa_request
from server import InferenceServer, ServerConfig
from settings.tokens import TokenFileError, parse_tokens, read_tokens
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, header, wait_until

ROOT = Path(__file__).resolve().parent.parent
TOKENS = ["alpha-7f3c9e1d2b", "bravo-0a8d6c4e22"]
TOKEN_FILE_TEXT = f"# the clients of this server\n\n{TOKENS[0]}\n  {TOKENS[1]}  \n# revoked: old\n"
AUTH_TIMEOUT_S = 0.5


class Records(logging.Handler):
    """Every log record of the server, formatted, for tests that look for secrets in them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def records() -> Iterator[Records]:
    handler, root = Records(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.txt"
    path.write_text(TOKEN_FILE_TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, token_file: Path,
           records: Records) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, auth_token_file=str(token_file),
                          auth_timeout_s=AUTH_TIMEOUT_S, metrics_port=0)
    with InferenceServer(config) as srv:
        yield srv


def events(srv: InferenceServer) -> dict[str, int]:
    return srv.stats.snapshot()["events"]


def admitted(srv: InferenceServer) -> int:
    return sum(model.stats.snapshot()["admitted"] for model in srv.models)


def assert_refused_and_closed(conn: RawConnection, *in_message: str) -> None:
    """One ``unauthorized`` reply (id nil), then the server closes the connection."""
    reply = conn.recv_message()
    assert reply is not None and reply["id"] is None and reply["ok"] is False
    assert reply["error"]["code"] == "unauthorized"
    assert all(text in reply["error"]["message"] for text in in_message), reply
    assert conn.recv_message() is None


# -- the token set and the token file ------------------------------------------------------------
def test_the_token_set_matches_only_whole_tokens_comparing_with_every_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = TokenSet(["first-token", "second-token", "third-token"])
    compared: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for token in ("first-token", "second-token", "third-token"):
        assert tokens.matches(token)
    for near_miss in ("", "first-toke", "first-tokenx", "First-token", " first-token",
                      "second-token\n", "x" * 10_000, "th\u0131rd-token"):
        assert not tokens.matches(near_miss)
    # every check compares with all three tokens, a match on the first one too (no early
    # exit), and always digests of one length (no token's length leaks)
    assert len(compared) == 3 * 11 and set(compared) == {32}
    assert "first" not in repr(tokens) and len(tokens) == 3


def test_a_token_file_holds_one_token_a_line_without_blanks_or_comments(tmp_path: Path) -> None:
    assert parse_tokens(TOKEN_FILE_TEXT) == TOKENS
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody yet\n\n   \n", encoding="utf-8")
    with pytest.raises(TokenFileError, match="holds no token"):
        read_tokens(empty)
    with pytest.raises(TokenFileError, match="cannot read token file"):
        read_tokens(tmp_path / "missing.txt")
    with pytest.raises(ValueError):
        TokenSet([])


@pytest.mark.parametrize("content,expected", [
    ("# only a comment\n", "holds no token"),
    (None, "cannot read token file"),
])
def test_the_server_refuses_to_start_with_an_empty_or_unreadable_token_file(
        tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "tokens.txt"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    done = subprocess.run([sys.executable, "server.py", "--port", "0", "--auth_token_file",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--auth_token_file" in done.stderr and expected in done.stderr
    assert ServerConfig(auth_token_file=str(path)).problems()  # the same check, as a usage error


# -- the protocol -------------------------------------------------------------------------------
def test_each_token_of_the_file_authenticates_then_the_connection_serves(
        server: InferenceServer) -> None:
    for token in TOKENS:
        conn = RawConnection(server.address)
        conn.send(auth_request(1, token))
        assert conn.recv_message() == {"id": 1, "ok": True,
                                       "result": {"authenticated": True, "required": True}}
        conn.send(qa_request(2, QUESTIONS[0], CONTEXTS[0]))
        reply = conn.recv_message()
        assert reply is not None and reply["id"] == 2 and reply["ok"], reply
        conn.close()
        with Client(*server.address, token=token) as client:
            assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["end"] > 0
            assert client.ping(timeout=10)["ready"] is True


def test_a_wrong_token_is_refused_and_the_connection_closed(server: InferenceServer) -> None:
    before = events(server)["auth_failed"]
    conn = RawConnection(server.address)
    conn.send(auth_request(1, TOKENS[0] + "x"))
    assert_refused_and_closed(conn, "unknown token")
    conn.close()
    with pytest.raises(Unauthorized):
        Client(*server.address, token="not-a-token")
    wait_until(lambda: events(server)["auth_failed"] == before + 2)


@pytest.mark.parametrize("first", [
    qa_request(1, QUESTIONS[0], CONTEXTS[0]),
    ping_request(1),  # everything but auth is refused: ping and stats too
    {"id": 1, "op": "stats"},
    {"id": 1, "op": "auth"},  # no token
    {"id": 1, "op": "auth", "token": 12345},
    {"op": "nonsense"},
])
def test_a_first_request_other_than_auth_is_refused_and_never_reaches_a_model(
        server: InferenceServer, first: dict) -> None:
    before = admitted(server)
    conn = RawConnection(server.address)
    conn.send(first)
    assert_refused_and_closed(conn)
    conn.close()
    assert admitted(server) == before


def test_a_client_without_a_token_fails_with_unauthorized(server: InferenceServer) -> None:
    with Client(*server.address) as client:
        with pytest.raises(Unauthorized, match="must be 'auth', not 'qa'"):
            client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)
        with pytest.raises(ConnectionLost):
            client.ping(timeout=10)  # the connection was closed


def test_a_token_sent_after_another_request_is_never_read(server: InferenceServer) -> None:
    ok_before = server.stats.snapshot()["requests"].get("auth", {}).get("ok", 0)
    conn = RawConnection(server.address)  # both frames in one write: one read on the server
    conn.send_raw(encode_frame(qa_request(1, QUESTIONS[0], CONTEXTS[0]))
                  + encode_frame(auth_request(2, TOKENS[0]))
                  + encode_frame(qa_request(3, QUESTIONS[1], CONTEXTS[1])))
    assert_refused_and_closed(conn, "not 'qa'")
    conn.close()
    late = RawConnection(server.address)  # the token in a later write: the connection is gone
    late.send(ping_request(1))
    reply = late.recv_message()
    assert reply is not None and reply["error"]["code"] == "unauthorized"
    try:
        late.send(auth_request(2, TOKENS[0]))
    except OSError:
        pass  # reset: the server had closed
    assert late.recv_message() is None
    late.close()
    assert server.stats.snapshot()["requests"].get("auth", {}).get("ok", 0) == ok_before


def test_a_silent_or_trickling_connection_is_closed_at_the_auth_timeout(
        server: InferenceServer) -> None:
    before = events(server)["auth_timeout"]
    silent, trickling = RawConnection(server.address), RawConnection(server.address)
    trickling.send_raw(header(40)[:3])  # a frame begun (the frame timeout is 30 s)
    started = time.monotonic()
    assert_refused_and_closed(silent, "auth_timeout")
    assert_refused_and_closed(trickling, "auth_timeout")
    assert time.monotonic() - started < 5  # not the idle (300 s) or frame (30 s) timeout
    silent.close()
    trickling.close()
    assert events(server)["auth_timeout"] == before + 2


def test_an_authenticated_connection_outlives_the_auth_timeout(server: InferenceServer) -> None:
    with Client(*server.address, token=TOKENS[1]) as client:
        time.sleep(3 * AUTH_TIMEOUT_S)
        assert client.answer(QUESTIONS[2], CONTEXTS[2], timeout=30)["end"] > 0
        assert client.request(lambda rid: auth_request(rid, TOKENS[0])).result(10) == {
            "authenticated": True, "required": True}  # auth again: checked again, fine


def test_a_reopened_client_authenticates_with_the_same_token(server: InferenceServer) -> None:
    with Client(*server.address, token=TOKENS[0]) as first:  # the REPL reconnects this way
        second = first.reopen()
    with second:
        assert second.ping(timeout=10)["pong"] is True


def scrape(srv: InferenceServer) -> str:
    assert srv.metrics_address is not None
    host, port = srv.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_failures_are_counted_in_stats_and_metrics_and_no_token_is_ever_shown(
        server: InferenceServer, records: Records) -> None:
    wrong = "wrong-S3CRET-token-4242"
    before = events(server)["auth_failed"]
    with pytest.raises(Unauthorized):
        Client(*server.address, token=wrong)
    wait_until(lambda: events(server)["auth_failed"] == before + 1)
    with Client(*server.address, token=TOKENS[0]) as client:
        stats = client.stats(timeout=10)
    assert stats["events"]["auth_failed"] == before + 1
    assert stats["requests"]["auth"]["unauthorized"] >= 1 and stats["requests"]["auth"]["ok"] >= 1
    metrics = scrape(server)
    assert f'qa_server_events_total{{event="auth_failed"}} {before + 1}.0' in metrics
    assert 'qa_server_events_total{event="auth_timeout"}' in metrics
    assert any("refused, unknown token" in line and "127.0.0.1:" in line
               for line in records.lines)
    for secret in (wrong, *TOKENS):
        assert secret not in repr(stats) and secret not in metrics
        assert not [line for line in records.lines if secret in line]


# -- restarts, servers without tokens, the tools ------------------------------------------------
def test_a_token_removed_from_the_file_fails_after_a_restart(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("\n".join(TOKENS) + "\n", encoding="utf-8")
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, auth_token_file=str(path))
    with InferenceServer(config) as srv:
        for token in TOKENS:
            Client(*srv.address, token=token).close()
    path.write_text(f"# {TOKENS[0]} revoked\n{TOKENS[1]}\n", encoding="utf-8")
    with InferenceServer(config) as srv:
        with pytest.raises(Unauthorized):
            Client(*srv.address, token=TOKENS[0])
        with Client(*srv.address, token=TOKENS[1]) as client:
            assert client.ping(timeout=10)["pong"] is True


def test_without_a_token_file_nothing_is_required_and_auth_is_answered_ok(
        tiny_model_dir: Path) -> None:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, auth_timeout_s=0.2)
    with InferenceServer(config) as srv:
        conn = RawConnection(srv.address)
        time.sleep(0.5)  # past the auth timeout, which applies only with tokens
        conn.send(ping_request(1))
        assert conn.recv_message()["ok"] is True
        conn.send(auth_request(2, "anything"))
        assert conn.recv_message()["result"] == {"authenticated": True, "required": False}
        conn.send({"id": 3, "op": "auth"})  # a token field is needed even here (protocol.md)
        reply = conn.recv_message()
        assert reply["id"] == 3 and reply["error"]["code"] == "bad_request", reply
        conn.send({"id": 4, "op": "ping", "timeout_ms": -5})  # control ops ignore timeout_ms
        assert conn.recv_message() == {"id": 4, "ok": True,
                                       "result": {"pong": True, "ready": True}}
        conn.send({"id": "five", "op": "ping"})  # bad_request with id nil: nothing else ends
        assert conn.recv_message()["id"] is None
        conn.send(ping_request(6))
        assert conn.recv_message()["id"] == 6
        conn.close()
        with Client(*srv.address, token="anything") as client:
            assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["end"] > 0


def client_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "client.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_the_ready_probe_and_one_shot_take_a_token(server: InferenceServer,
                                                    token_file: Path) -> None:
    where = ["--host", server.address[0], "--port", str(server.address[1])]
    assert client_cli(*where, "--ready").returncode == 1  # no token: refused, not ready
    wrong = client_cli(*where, "--ready", "--token", "nope")
    assert wrong.returncode == 1 and "unauthorized" in wrong.stderr and "nope" not in wrong.stderr
    for way, env in ((["--token_file", str(token_file)], None),
                     (["--token", TOKENS[1]], None),
                     ([], {"QA_SERVER_TOKEN": TOKENS[1]}),
                     ([], {"QA_SERVER_TOKEN_FILE": str(token_file)})):
        ready = client_cli(*where, "--ready", *way, env=env)
        assert ready.returncode == 0 and "'ready': True" in ready.stdout, (way, ready.stderr)
    once = client_cli(*where, "--token_file", str(token_file), "--question", QUESTIONS[0],
                      "--context", CONTEXTS[0])
    assert once.returncode == 0 and "answer: " in once.stdout, once.stderr


def test_the_stress_test_authenticates_every_connection_with_its_token(
        server: InferenceServer, token_file: Path) -> None:
    run = [sys.executable, "stress_test.py", "--host", server.address[0], "--port",
           str(server.address[1]), "--num_simultaneous_clients", "2", "--num_total_clients", "4",
           "--num_request_per_client", "2", "--warmup", "1", "--processes", "1", "--no_progress"]
    done = subprocess.run([*run, "--token_file", str(token_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "requests: 8   ok: 8   errors: none" in done.stdout
    refused = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "refused the connection" in refused.stderr


def test_the_docker_health_check_can_carry_a_token() -> None:
    dockerfile = (ROOT / "docker" / "server.Dockerfile").read_text()
    assert "QA_SERVER_TOKEN_FILE" in dockerfile and "--auth_token_file" in dockerfile
    client_image = (ROOT / "docker" / "client.Dockerfile").read_text()
    assert "settings/tokens.py" in client_image  # console/cli.py imports it


def test_a_client_that_leaves_without_a_word_is_no_auth_failure(server: InferenceServer) -> None:
    before = events(server)
    sock = socket.create_connection(server.address)
    sock.close()
    wait_until(lambda: server.stats.snapshot()["connections_open"] == 0)
    assert events(server)["auth_failed"] == before["auth_failed"]


def test_the_async_client_authenticates_with_its_token(server: InferenceServer) -> None:
    import asyncio

    from clients.aio import AsyncClient

    async def run() -> None:
        async with AsyncClient(*server.address, token=TOKENS[0]) as client:
            assert (await client.ping(timeout=10))["pong"] is True
        with pytest.raises(Unauthorized):
            await AsyncClient.connect(*server.address, token="not-" + TOKENS[0])

    asyncio.run(run())
