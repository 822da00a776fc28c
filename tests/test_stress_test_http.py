"""stress_test.py --url: the load over the HTTP API (clients/http.py), against a real in-process
server that requires a token, with the same report and JSON as over TCP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.local_server import make_certificates
from clients.common import ConnectionLost
from clients.http import HttpClient
from protocol import BadRequest, Unauthorized
from server import InferenceServer, ServerConfig
from stress_test import parse_args

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "http-load-test-token-0123456789"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("http_auth") / "tokens.txt"
    path.write_text(f"{TOKEN}\n", encoding="utf-8")
    return path


def _config(model_dir: Path, token_file: Path, **options: Any) -> ServerConfig:
    return ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                        threads_per_session=1, auth_token_file=str(token_file), **options)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, token_file: Path) -> Iterator[InferenceServer]:
    with InferenceServer(_config(tiny_model_dir, token_file)) as srv:
        assert srv.http_address is not None
        yield srv


def url_of(srv: InferenceServer, scheme: str = "http") -> str:
    assert srv.http_address is not None
    host, port = srv.http_address
    return f"{scheme}://{host}:{port}"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "stress_test.py", "--no_progress", "--processes", "1",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _runs(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"]


@pytest.fixture(scope="module")
def tcp_run(server: InferenceServer, token_file: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A closed-loop run over TCP: the shape an HTTP run's JSON must have."""
    out = tmp_path_factory.mktemp("tcp_run") / "tcp.json"
    host, port = server.address
    done = run_cli("--host", host, "--port", str(port), "--token_file", str(token_file),
                   "--num_simultaneous_clients", "2", "--num_total_clients", "4",
                   "--num_request_per_client", "3", "--warmup", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    (run,) = _runs(out)
    assert run["server"], "a TCP run has the server's breakdown"
    return run


# -- the client ----------------------------------------------------------------------------
def test_http_client_answers_queued_requests_in_order_and_raises_typed_errors(
        server: InferenceServer) -> None:
    with HttpClient(url_of(server), token=TOKEN) as client:
        futures = [client.submit("Who went home?", "Bob went home after the match.")
                   for _ in range(5)]  # one on the wire, four queued
        futures.append(client.submit_op("qa", {"question": "", "context": "Some context."}))
        futures.append(client.submit_op("qa", {"question": "Where?", "context": "In Paris."},
                                        model="no-such-model"))
        assert all(set(f.result(30)) >= {"answer", "score", "start", "end"}
                   for f in futures[:5])
        with pytest.raises(BadRequest, match="question"):
            futures[5].result(30)
        assert futures[6].exception(30).code == "bad_request"  # type: ignore[union-attr]
        assert client.models(timeout=30)[0]["op"] == "qa"
    with HttpClient(url_of(server)) as anonymous:  # no bearer token
        with pytest.raises(Unauthorized):
            anonymous.submit("Who?", "Bob.").result(30)


def test_http_client_requests_fail_with_connection_lost_once_the_server_is_gone(
        tiny_model_dir: Path, token_file: Path) -> None:
    srv = InferenceServer(_config(tiny_model_dir, token_file))
    with srv:
        client = HttpClient(url_of(srv), token=TOKEN)
        assert client.submit("Who went home?", "Bob went home.").result(30)["answer"]
    try:
        with pytest.raises(ConnectionLost):  # refused at once, or failed by the reader
            client.submit("Who went home?", "Bob went home.").result(30)
    finally:
        client.close()
    with pytest.raises(ConnectionLost):  # and a closed client refuses at once
        client.submit("Who?", "Bob.")


@pytest.mark.skipif(shutil.which("openssl") is None,
                    reason="the openssl command makes the test certificates")
def test_https_with_tls_ca_for_the_client_and_the_command(
        tiny_model_dir: Path, token_file: Path, tmp_path: Path) -> None:
    make_certificates(tmp_path)
    ca = str(tmp_path / "ca.crt")
    config = _config(tiny_model_dir, token_file, tls_cert=str(tmp_path / "server.crt"),
                     tls_key=str(tmp_path / "server.key"))
    with InferenceServer(config) as srv:
        url = url_of(srv, "https")
        with HttpClient(url, token=TOKEN, tls_ca=ca) as client:
            assert client.submit("Who went home?", "Bob went home.").result(30)["answer"]
        with pytest.raises(OSError):  # the system's CAs do not know this one
            HttpClient(url, token=TOKEN)
        done = run_cli("--url", url, "--tls_ca", ca, "--port", str(srv.address[1]),
                       "--token", TOKEN, "--num_simultaneous_clients", "1",
                       "--num_total_clients", "2", "--num_request_per_client", "3",
                       "--warmup", "0")
    assert done.returncode == 0, done.stderr
    assert "requests: 6   ok: 6   errors: none" in done.stdout
    assert "server: 1 sessions" in done.stdout  # the stats over TCP, with TLS too


# -- the command ---------------------------------------------------------------------------
def test_cli_closed_loop_over_http_answers_every_request_with_a_tcp_runs_report(
        server: InferenceServer, token_file: Path, tcp_run: dict[str, Any],
        tmp_path: Path) -> None:
    out = tmp_path / "http.json"
    host, port = server.address  # the TCP listener: the server's stats come from it
    done = run_cli("--url", url_of(server), "--port", str(port), "--token_file",
                   str(token_file), "--num_simultaneous_clients", "2", "--num_total_clients",
                   "4", "--num_request_per_client", "3", "--warmup", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert f"over HTTP: {url_of(server)}" in done.stdout
    assert f"server stats over TCP from {host}:{port}" in done.stdout
    assert "requests: 12   ok: 12   errors: none" in done.stdout
    assert "p99" in done.stdout and "server: 1 sessions" in done.stdout
    (run,) = _runs(out)
    assert run["requests"] == run["ok"] == 12 and not run["errors"]
    assert run["settings"]["url"] == url_of(server) and tcp_run["settings"]["url"] is None
    assert set(run) == set(tcp_run) and set(run["settings"]) == set(tcp_run["settings"])
    assert set(run["server"]) == set(tcp_run["server"])
    assert run["server"]["admitted"] == 12  # the server counted the HTTP requests


def test_cli_sweep_over_http_without_a_tcp_port_reports_without_the_server_breakdown(
        server: InferenceServer, token_file: Path, tcp_run: dict[str, Any],
        tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    done = run_cli("--url", url_of(server), "--token_file", str(token_file), "--sweep", "1,2",
                   "--num_total_clients", "2", "--num_request_per_client", "3", "--warmup", "2",
                   "--json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert "no server stats (they come over TCP" in done.stdout
    assert "latency p99 (ms)" in done.stdout and "throughput (requests/s)" in done.stdout
    runs = _runs(out)
    assert [r["settings"]["clients"] for r in runs] == [1, 2]
    assert all(r["requests"] == r["ok"] == 6 and not r["errors"] for r in runs)
    assert all(set(r) == set(tcp_run) and r["server"] == {} for r in runs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_url_refuses_pipelining_and_urls_that_are_not_http(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://127.0.0.1:8000", "--pipeline", "4"])
    assert "one request in flight per connection" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--url", "ftp://127.0.0.1:8000"])
    assert "http://HOST:PORT" in capsys.readouterr().err
    args = parse_args(["--url", "https://example.org:8443"])
    assert args.tls and args.host == "example.org" and args.port is None
    assert parse_args(["--url", "http://h:1", "--port", "7"]).host == "h"
    plain = parse_args([])
    assert (plain.host, plain.port, plain.url) == ("127.0.0.1", 9999, None)
