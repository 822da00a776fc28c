"""Test helpers for the HTTP API: one request over a raw socket, read back whole."""

from __future__ import annotations

import json
import socket
import ssl
from typing import Any

from tests.helpers import CONTEXTS, QUESTIONS

QA_BODY = {"inputs": {"question": QUESTIONS[0], "context": CONTEXTS[0]}}


def request(address: tuple[str, int], method: str, path: str, body: Any = None, *,
            headers: dict[str, str] | None = None, raw: bytes | None = None,
            tls: ssl.SSLContext | None = None,
            timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body or text) of one request on a new connection."""
    payload = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    head = {"host": "test", "connection": "close", **(headers or {})}
    if payload or method == "POST":
        head.setdefault("content-type", "application/json")
        head.setdefault("content-length", str(len(payload)))
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    with connect(address, tls, timeout) as sock:
        sock.sendall(data)
        responses = read_responses(sock, 1)
    return responses[0]


def connect(address: tuple[str, int], tls: ssl.SSLContext | None = None,
            timeout: float = 30) -> socket.socket:
    """A connection to the HTTP API, TLS where ``tls`` is given."""
    sock = socket.create_connection(address, timeout=timeout)
    return tls.wrap_socket(sock, server_hostname=address[0]) if tls is not None else sock


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], Any]]:
    """``count`` responses read off ``sock`` (Content-Length framed), in order."""
    buffer, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} responses: {buffer!r}"
            buffer += chunk
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in
                   (line.split(":", 1) for line in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(buffer) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed inside a body"
            buffer += chunk
        body, buffer = buffer[:length], buffer[length:]
        out.append((int(status_line.split()[1]), headers, decoded(body, headers)))
    return out


def decoded(body: bytes, headers: dict[str, str]) -> Any:
    if headers.get("content-type", "").startswith("application/json") and body:
        return json.loads(body)
    return body.decode("utf-8", "replace")


def closed(sock: socket.socket) -> bool:
    """True once the server has closed its side."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return True
