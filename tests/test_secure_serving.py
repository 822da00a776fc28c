"""Every way in at once: TLS over TCP and a Unix socket, behind token authentication, for the
blocking and the asyncio client alike (docs/operations.md, Security)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import AsyncClient, Client
from protocol import Unauthorized
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, Reference
from tests.test_tls import certs  # noqa: F401 - the fixture: a CA, server and client certificates

TOKEN = "secure-serving-4b1d"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command makes the test certificates")


@pytest.fixture(scope="module")
def server(certs: Path, tiny_model_dir: Path,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServer]:
    folder = tmp_path_factory.mktemp("secure")
    (folder / "tokens.txt").write_text(f"{TOKEN}\n", encoding="utf-8")
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          threads_per_session=1, tls_cert=str(certs / "server.crt"),
                          tls_key=str(certs / "server.key"), unix_socket=str(folder / "qa.sock"),
                          auth_token_file=str(folder / "tokens.txt"))
    with InferenceServer(config) as srv:
        yield srv


def test_the_blocking_client_over_tls_with_a_token(server: InferenceServer, certs: Path,  # noqa: F811
                                                   tiny_model_dir: Path) -> None:
    expected = Reference(tiny_model_dir).answer(QUESTIONS[0], CONTEXTS[0])
    with Client(*server.address, tls=True, tls_ca=str(certs / "ca.crt"), token=TOKEN) as client:
        assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["answer"] == \
            expected["answer"]
    with pytest.raises(Unauthorized):
        Client(*server.address, tls=True, tls_ca=str(certs / "ca.crt"), token="wrong")


def test_the_async_client_over_tls_and_the_unix_socket_with_a_token(
        server: InferenceServer, certs: Path, tiny_model_dir: Path) -> None:  # noqa: F811
    reference = Reference(tiny_model_dir)
    unix = server.unix_address
    assert unix is not None

    async def ask(client: AsyncClient) -> list[str]:
        futures = [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(24)]
        return [(await future)["answer"] for future in futures]

    async def run() -> None:
        async with AsyncClient(*server.address, tls=True, tls_ca=str(certs / "ca.crt"),
                               token=TOKEN) as over_tls, \
                AsyncClient(unix, token=TOKEN) as over_unix:
            answers = await asyncio.gather(ask(over_tls), ask(over_unix))
        expected = [reference.answer(QUESTIONS[i % 6], CONTEXTS[i % 6])["answer"]
                    for i in range(24)]
        assert answers == [expected, expected]
        with pytest.raises(Unauthorized):
            await AsyncClient.connect(unix, token="wrong")

    asyncio.run(run())


def test_the_async_client_refuses_tls_options_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="need tls=True"):
        AsyncClient("127.0.0.1", 1, tls_ca="ca.crt")
    with pytest.raises(ValueError, match="Unix socket"):
        AsyncClient("unix:///tmp/x.sock", tls=True)


def test_the_stress_test_loads_a_tls_server_with_a_token(server: InferenceServer,
                                                         certs: Path) -> None:  # noqa: F811
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    run = [sys.executable, "stress_test.py", "--host", server.address[0], "--port",
           str(server.address[1]), "--num_simultaneous_clients", "2", "--num_total_clients", "4",
           "--num_request_per_client", "2", "--warmup", "1", "--processes", "1", "--no_progress",
           "--token", TOKEN]
    done = subprocess.run([*run, "--tls", "--tls_ca", str(certs / "ca.crt")], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "requests: 8   ok: 8   errors: none" in done.stdout
    plain = subprocess.run(run, cwd=root, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2, plain.stdout
