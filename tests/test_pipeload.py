"""bench/pipeload.py: the front-end benchmark's lean pipelined load, against a real server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.pipeload import run_pipelined
from client import Client
from server import InferenceServer, ServerConfig

PAIRS = [("Who went home?", "Bob went home after the match."),
         ("Where is the tower?", "The old tower stands in Paris, on the left bank of the river.")]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServer]:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), inference_engine_type="zero",
                          num_inference_sessions=1)
    with InferenceServer(config) as srv:
        yield srv


def _answered(srv: InferenceServer) -> dict[str, int]:
    with Client(*srv.address) as client:
        return dict(client.stats()["requests"].get("qa", {}))


def test_it_keeps_every_connection_pipelined_and_counts_what_the_server_answered(
        server: InferenceServer) -> None:
    before = _answered(server)
    # 3 connections over 2 processes (2 + 1), 4 in flight on each
    run = run_pipelined(*server.address, PAIRS, connections=3, pipeline=4, processes=2,
                        seconds=1.0)
    after = _answered(server)
    assert run["ok"] == after.get("ok", 0) - before.get("ok", 0) > 12
    assert run["errors"] == {} and run["requests"] == run["ok"]
    assert run["throughput_rps"] == run["ok"] / run["wall_s"] and run["load_cpu_s"] > 0


def test_error_replies_are_counted_by_code(server: InferenceServer) -> None:
    run = run_pipelined(*server.address, [PAIRS[0], ("   ", "an empty question")],
                        connections=1, pipeline=2, processes=1, seconds=0.5)
    # the mix alternates, so half the requests fail alone, each with its own reply
    assert run["errors"].keys() == {"bad_request"}
    assert abs(run["errors"]["bad_request"] - run["ok"]) <= 1 and run["ok"] > 0


def test_a_server_that_cannot_be_reached_fails_the_run_with_the_reason() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RuntimeError, match="could not connect"):
        run_pipelined("127.0.0.1", port, PAIRS, connections=2, pipeline=1, processes=2,
                      seconds=0.2)


def test_replies_still_owed_after_the_drain_are_counted_as_timeouts() -> None:
    with socket.socket() as listener:  # takes every request, answers none
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held: list[socket.socket] = []

        def accept() -> None:
            for _ in range(2):
                held.append(listener.accept()[0])

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        run = run_pipelined(*listener.getsockname(), PAIRS, connections=2, pipeline=3,
                            processes=1, seconds=0.2, drain_s=0.5)
        acceptor.join(5)
        for sock in held:
            sock.close()
    assert run["ok"] == 0 and run["errors"] == {"timeout": 6}
