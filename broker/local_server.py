"""A throwaway redis-server on a free port, in a folder of its own, persisting nothing: for the
tests, the benchmarks, and trying a brokered layout on one machine. Deployments run Redis as a
service of its own (docker/compose.yaml, docs/scaling.md)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process; ``stop`` and ``start`` again keep its port (a restart).

    Args:
        folder: Its working folder.
        password: Require this password (``requirepass``), if given.
        tls: Serve TLS only, with a certificate for 127.0.0.1 signed by a throwaway authority
            (made with the ``openssl`` command in ``folder``); ``url`` then trusts it.
    """

    def __init__(self, folder: Path, password: str | None = None, tls: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install "
                                    "redis-server; .ci/run does it)")
        self.binary, self.folder, self.password = binary, folder, password
        self.port = free_port()
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        if tls:
            make_certificates(folder)

    @property
    def url(self) -> str:
        """Its redis:// URL, password included."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.folder / 'ca.crt'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and return once it answers PING."""
        port = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                "--tls-cert-file", str(self.folder / "server.crt"),
                "--tls-key-file", str(self.folder / "server.key")] if self.tls \
            else ["--port", str(self.port)]
        args = [self.binary, *port, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no",
                "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (SIGKILL: nothing is saved anyway)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def client(self) -> redis.Redis:
        """A client for it."""
        return redis.Redis.from_url(self.url)


def make_certificates(folder: Path) -> None:
    """A certificate authority and a server certificate for 127.0.0.1 it signed, in ``folder``
    (ca.crt, server.crt, server.key), made with the ``openssl`` command.

    Raises:
        FileNotFoundError: no ``openssl`` command.
    """
    if shutil.which("openssl") is None:
        raise FileNotFoundError("the openssl command is not installed (.ci/run installs it)")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for command in (
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=throwaway-ca"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
             "server.csr", "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf"]):
        subprocess.run(["openssl", *command], cwd=folder, check=True, capture_output=True)
