"""TLS over TCP (--tls_cert, --tls_key, --tls_client_ca), with certificates made in the test by
the openssl command: answers, clients that do not speak TLS or never finish the handshake,
client certificates, old protocol versions, a stop, a client that does not read, usage errors."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.local_server import make_certificates
from client import Client, ConnectionLost
from engines import load_engine
from protocol import FrameDecoder, ServerError, encode_frame, qa_request, stats_request
from server import InferenceServer, ServerConfig
from tests.helpers import (
    CONTEXTS,
    QUESTIONS,
    GatedEngine,
    RawConnection,
    Reference,
    assert_same_answer,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command makes the test certificates")


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt, server.crt/.key for 127.0.0.1 signed by it, client.crt/.key signed by it, and
    rogue.crt/.key, a client certificate nobody trusts."""
    folder = tmp_path_factory.mktemp("certs")
    make_certificates(folder)
    openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out",
            "client.csr", "-subj", "/CN=test-client")
    openssl(folder, "x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.crt", "-days", "2")
    openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key",
            "-out", "rogue.crt", "-days", "2", "-subj", "/CN=rogue")
    return folder


def tls_config(certs: Path, model_dir: Path, **options: object) -> ServerConfig:
    return ServerConfig(port=0, model_dir=str(model_dir), num_inference_sessions=1,
                        threads_per_session=1, tls_cert=str(certs / "server.crt"),
                        tls_key=str(certs / "server.key"), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(certs: Path, tiny_model_dir: Path) -> Iterator[InferenceServer]:
    with InferenceServer(tls_config(certs, tiny_model_dir, tls_handshake_timeout_s=0.5)) as srv:
        yield srv


def events(srv: InferenceServer) -> dict[str, int]:
    return srv.stats.snapshot()["events"]


def tls_client(srv: InferenceServer, certs: Path, **options: object) -> Client:
    return Client(*srv.address, tls=True, tls_ca=str(certs / "ca.crt"), **options)  # type: ignore[arg-type]


def test_a_tls_client_gets_the_in_process_answers(server: InferenceServer, certs: Path,
                                                  tiny_model_dir: Path) -> None:
    reference = Reference(tiny_model_dir)
    with tls_client(server, certs) as client:
        assert client.endpoint == f"127.0.0.1:{server.address[1]} (TLS)"
        futures = [(client.submit(QUESTIONS[i % 6], CONTEXTS[(i * 5) % 6]), i) for i in range(60)]
        for future, i in futures:
            context = CONTEXTS[(i * 5) % 6]
            assert_same_answer(future.result(timeout=60),
                               reference.answer(QUESTIONS[i % 6], context), context)


def test_a_plain_tcp_client_fails_cleanly_and_hurts_no_one(server: InferenceServer,
                                                           certs: Path) -> None:
    before = events(server)["tls_handshake_failed"]
    with tls_client(server, certs) as good:
        in_flight = [good.submit(QUESTIONS[0], CONTEXTS[0]) for _ in range(20)]
        with Client(*server.address) as plain, pytest.raises((ConnectionLost, ServerError)):
            plain.ping(timeout=10)
        assert all(f.result(timeout=60)["end"] > 0 for f in in_flight)
        assert good.ping(timeout=10)["pong"]
    wait_until(lambda: events(server)["tls_handshake_failed"] == before + 1)


def test_a_client_that_never_handshakes_is_closed_after_the_bound_while_others_are_served(
        server: InferenceServer, certs: Path) -> None:
    before = events(server)["tls_handshake_failed"]
    silent = RawConnection(server.address)  # connects, then says nothing
    opened = time.monotonic()
    with tls_client(server, certs) as other:  # served meanwhile
        assert other.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["end"] > 0
        assert silent.server_closed()  # blocks until the server gives up on it
        waited = time.monotonic() - opened
        assert other.ping(timeout=10)["pong"]
    assert 0.4 <= waited < 5, waited  # --tls_handshake_timeout 0.5
    silent.close()
    wait_until(lambda: events(server)["tls_handshake_failed"] == before + 1)
    wait_until(lambda: server.stats.snapshot()["connections_open"] == 0)


def test_client_certificates_are_required_with_tls_client_ca(certs: Path,
                                                             tiny_model_dir: Path) -> None:
    config = tls_config(certs, tiny_model_dir, tls_client_ca=str(certs / "ca.crt"))
    with InferenceServer(config) as srv:
        with tls_client(srv, certs, tls_cert=str(certs / "client.crt"),
                        tls_key=str(certs / "client.key")) as trusted:
            assert trusted.answer(QUESTIONS[2], CONTEXTS[2], timeout=30)["end"] > 0
        for cert in (None, "rogue"):  # none, or one no CA of --tls_client_ca signed
            options = {} if cert is None else {"tls_cert": str(certs / f"{cert}.crt"),
                                               "tls_key": str(certs / f"{cert}.key")}
            # TLS 1.3: the client's handshake ends before the server checks its certificate,
            # so the refusal may come with the first reply instead
            with pytest.raises((ssl.SSLError, ConnectionLost)):
                with tls_client(srv, certs, **options) as refused:
                    refused.ping(timeout=10)
        wait_until(lambda: events(srv)["tls_handshake_failed"] == 2)


def test_a_tls_connection_over_the_cap_is_closed_and_the_others_served(
        certs: Path, tiny_model_dir: Path) -> None:
    with InferenceServer(tls_config(certs, tiny_model_dir, max_connections=1)) as srv:
        with tls_client(srv, certs) as held:
            wait_until(lambda: srv.stats.snapshot()["connections_open"] == 1)
            with pytest.raises(OSError):  # no reply: it would need a handshake first
                with tls_client(srv, certs) as refused:
                    refused.ping(timeout=10)
            assert events(srv)["connection_refused"] == 1
            assert held.ping(timeout=10)["pong"]


def test_tls_1_1_is_refused(server: InferenceServer, certs: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        old.load_verify_locations(certs / "ca.crt")
        try:
            old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
            old.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 offers 1.1 only at level 0
        except (ValueError, ssl.SSLError) as exc:
            pytest.skip(f"this OpenSSL cannot offer TLS 1.1: {exc}")
    before = events(server)["tls_handshake_failed"]
    with socket.create_connection(server.address, timeout=10) as sock:
        with pytest.raises(ssl.SSLError) as refused:
            old.wrap_socket(sock, server_hostname="127.0.0.1")
    if refused.value.reason in ("NO_PROTOCOLS_AVAILABLE", "NO_CIPHERS_AVAILABLE",
                                "UNSUPPORTED_PROTOCOL"):
        pytest.skip(f"this OpenSSL did not offer TLS 1.1 ({refused.value.reason})")
    assert refused.value.reason == "TLSV1_ALERT_PROTOCOL_VERSION"  # the server said no
    wait_until(lambda: events(server)["tls_handshake_failed"] == before + 1)


def test_a_stop_delivers_every_reply_then_closes_with_close_notify(certs: Path,
                                                                    tiny_model_dir: Path) -> None:
    engine = GatedEngine(load_engine("onnx", tiny_model_dir, threads=1))
    srv = InferenceServer(tls_config(certs, tiny_model_dir), engine_factory=lambda: engine)
    srv.start()
    engine.gate.clear()
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    sock = context.wrap_socket(socket.create_connection(srv.address, timeout=30),
                               server_hostname="127.0.0.1")
    total = 20
    sock.sendall(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6]))
                          for i in range(total)))
    wait_until(lambda: srv.stats.snapshot()["admitted"] == total)
    stopping = threading.Thread(target=srv.shutdown, args=(30,))
    stopping.start()
    time.sleep(0.2)
    engine.gate.set()
    decoder, replies = FrameDecoder(), []
    while (data := sock.recv(65536)) != b"":  # b"": close_notify came (an error otherwise)
        decoder.receive_data(data)
        while (message := decoder.next_message()) is not None:
            replies.append(message)
    assert sorted(reply["id"] for reply in replies) == list(range(total))
    assert all(reply["ok"] for reply in replies)
    sock.close()
    stopping.join(30)


def test_replies_to_a_tls_client_that_does_not_read_wait_in_order(server: InferenceServer,
                                                                   certs: Path) -> None:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    raw.settimeout(30)
    raw.connect(server.address)
    sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
    total = 3000  # stats replies are 3 KB or so: 9 MB, far more than the socket buffers hold
    sock.sendall(b"".join(encode_frame(stats_request(i)) for i in range(total)))
    wait_until(lambda: any(conn._writer is not None for conn in server.connections))
    time.sleep(0.3)  # the writer thread waits on the full socket meanwhile
    decoder, ids = FrameDecoder(), []
    while len(ids) < total:
        decoder.receive_data(sock.recv(65536))
        while (message := decoder.next_message()) is not None:
            assert message["ok"], message
            ids.append(message["id"])
    assert ids == list(range(total))  # every one, in the order asked
    sock.close()


def test_the_client_cli_speaks_tls(server: InferenceServer, certs: Path) -> None:
    host, port = server.address
    done = subprocess.run([sys.executable, "client.py", "--host", host, "--port", str(port),
                           "--tls", "--tls_ca", str(certs / "ca.crt"), "--question", QUESTIONS[4],
                           "--context", CONTEXTS[4]],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "answer: " in done.stdout, done.stderr
    untrusted = subprocess.run([sys.executable, "client.py", "--host", host, "--port", str(port),
                                "--tls", "--ready"], cwd=ROOT, capture_output=True, text=True,
                               timeout=60)  # the system's CAs never signed the test's
    assert untrusted.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    loose = subprocess.run([sys.executable, "client.py", "--tls_ca", "ca.crt"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert loose.returncode == 2 and "need --tls" in loose.stderr


def test_tls_usage_errors_exit_2(certs: Path, tmp_path: Path) -> None:
    cert, key = str(certs / "server.crt"), str(certs / "server.key")
    for args, message in (
            (["--tls_cert", cert], "--tls_cert and --tls_key go together"),
            (["--tls_cert", cert, "--tls_key", str(tmp_path / "none.key")],
             f"--tls_key: cannot read {tmp_path / 'none.key'}"),
            (["--tls_cert", cert, "--tls_key", str(certs / "client.key")], "cannot use them"),
            (["--tls_client_ca", str(certs / "ca.crt")], "--tls_client_ca needs --tls_cert"),
            (["--tls_cert", cert, "--tls_key", key, "--port", "-1", "--http_port", "-1",
              "--unix_socket", "/tmp/x.sock"], "never uses TLS")):
        done = subprocess.run([sys.executable, "server.py", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


class _BioClient:
    """A TLS client over memory buffers: what it writes, close_notify included, leaves in one
    TCP send, so the server reads the requests and the end of the stream in one read."""

    def __init__(self, address: tuple[str, int], certs: Path) -> None:
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        self.sock = socket.create_connection(address, timeout=30)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                self.incoming.write(self.sock.recv(65536))
        self.sock.sendall(self.outgoing.read())

    def send_then_close_notify(self, data: bytes) -> None:
        self.tls.write(data)
        try:
            self.tls.unwrap()  # queues close_notify; the server's own is read later
        except ssl.SSLWantReadError:
            pass
        self.sock.sendall(self.outgoing.read())

    def read_until_closed(self, timeout_s: float) -> tuple[list[dict], float]:
        """Every reply until the server ends the connection, and how long that took."""
        started, decoder, replies = time.monotonic(), FrameDecoder(), []
        self.sock.settimeout(timeout_s)
        while (data := self.sock.recv(65536)) != b"":
            self.incoming.write(data)
            try:
                while plain := self.tls.read(65536):
                    decoder.receive_data(plain)
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                pass
            while (message := decoder.next_message()) is not None:
                replies.append(message)
        return replies, time.monotonic() - started


def test_close_notify_sent_with_the_requests_is_a_half_close(certs: Path,
                                                             tiny_model_dir: Path) -> None:
    """protocol.md 6.4: every reply, then the server closes at once, not at idle_timeout."""
    config = tls_config(certs, tiny_model_dir, idle_timeout_s=20)
    with InferenceServer(config) as srv:
        client = _BioClient(srv.address, certs)
        total = 5
        client.send_then_close_notify(b"".join(
            encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6])) for i in range(total)))
        replies, took = client.read_until_closed(timeout_s=60)
        client.sock.close()
    assert sorted(reply["id"] for reply in replies) == list(range(total))
    assert all(reply["ok"] for reply in replies), replies
    assert took < 15, f"closed after {took:.1f} s: at the idle timeout, not at the half-close"
