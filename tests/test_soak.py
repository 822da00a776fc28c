"""A soak: thousands of pipelined requests from many clients, none lost, none mismatched."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from client import Client
from protocol import encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, Reference

CLIENTS = 8
PER_CLIENT = 500
WINDOW = 100  # requests a client has in flight at most: 8 x 100 stays under the queue bound
PAIRS = [(q, c if k == 0 else f"{c} {CONTEXTS[(i + k) % 6]}")
         for i, c in enumerate(CONTEXTS) for q in QUESTIONS for k in range(2)]  # 72 pairs


def test_soak_thousands_of_pipelined_requests_from_many_clients_lose_and_mix_up_nothing(
        tiny_model_dir: Path) -> None:
    reference = Reference(tiny_model_dir)
    expected = [reference.answer(q, c) for q, c in PAIRS]
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=2,
                          threads_per_session=1, batching="fixed", max_batch_size=8)
    failures: list[str] = []
    with InferenceServer(config) as srv:
        threads = [threading.Thread(target=raw_client if n % 2 else library_client,
                                    args=(srv.address, n, expected, failures))
                   for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads)
        snapshot = srv.stats.snapshot()
    assert failures == []
    assert snapshot["requests"]["qa"] == {"ok": CLIENTS * PER_CLIENT}
    assert snapshot["in_flight"] == 0
    assert snapshot["mean_batch_size"] > 1  # the load really was batched


def plan(seed: int) -> list[int]:
    """Which pair each of a client's requests asks, shuffled per client."""
    rng = random.Random(seed)
    return [rng.randrange(len(PAIRS)) for _ in range(PER_CLIENT)]


def check(result: dict[str, Any], want: dict[str, Any], context: str, where: str,
          failures: list[str]) -> None:
    got = (result["answer"], result["start"], result["end"])
    if got != (want["answer"], want["start"], want["end"]) or context[got[1]:got[2]] != got[0]:
        failures.append(f"{where}: got {got}, want {want}")


def raw_client(address: tuple[str, int], n: int, expected: list[dict[str, Any]],
               failures: list[str]) -> None:
    """Windows of requests, each in one write; ids offset per client; replies matched by id."""
    asks = plan(n)
    base = n * 1_000_000
    conn = RawConnection(address, timeout=120)
    replies: dict[int, dict[str, Any]] = {}
    for start in range(0, PER_CLIENT, WINDOW):
        window = range(start, min(start + WINDOW, PER_CLIENT))
        conn.send_raw(b"".join(encode_frame(qa_request(base + k, *PAIRS[asks[k]])) for k in window))
        replies.update(conn.recv_replies(len(window)))
    conn.close()
    if set(replies) != {base + k for k in range(PER_CLIENT)}:
        failures.append(f"client {n}: wrong ids")
        return
    for k, p in enumerate(asks):
        reply = replies[base + k]
        if not reply["ok"]:
            failures.append(f"client {n} request {k}: {reply['error']}")
            continue
        check(reply["result"], expected[p], PAIRS[p][1], f"client {n} request {k}", failures)


def library_client(address: tuple[str, int], n: int, expected: list[dict[str, Any]],
                   failures: list[str]) -> None:
    """Pipelined futures through client.Client, a sliding window of them."""
    asks = plan(n)
    with Client(*address) as client:
        futures = [client.submit(*PAIRS[p]) for p in asks[:WINDOW]]
        for k, p in enumerate(asks):
            future = futures[k]
            if k + WINDOW < PER_CLIENT:
                futures.append(client.submit(*PAIRS[asks[k + WINDOW]]))
            try:
                result = future.result(timeout=120)
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                failures.append(f"client {n} request {k}: {exc!r}")
                continue
            check(result, expected[p], PAIRS[p][1], f"client {n} request {k}", failures)
