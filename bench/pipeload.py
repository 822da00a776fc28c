"""A lean pipelined load for bench/frontend.py: as many requests as the server can take, for
as little of the machine's CPU as a client can spend.

    run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=10)

On a 2-core machine the load generator shares the cores with the server it measures, so
whatever CPU it spends per request is taken from the server: stress_test.py's clients
(``client.Client``: a Future, a reader thread and callbacks per request) spend about 150 µs per
request, where this spends a few tens. Each process holds its connections in one thread and
one selector. Each connection keeps ``pipeline`` ``qa`` requests in flight: every reply read
sends one more, all of a read's in one write, until ``seconds`` have passed; then it waits for
the replies still owed. Replies are decoded only to count successes and errors by code, not
matched to requests or timed. That is what the front-end benchmark needs: requests/s at
saturation, and the server's own CPU, which it reads from the server's processes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import selectors
import socket
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from protocol.codec import FrameDecoder, encode_frame
from protocol.messages import qa_request

#: Seconds to wait for the replies still owed once sending has stopped.
DRAIN_S = 30.0


def add_load_options(parser: argparse.ArgumentParser, *, connections: int,
                     processes: int, pipeline: int = 16) -> None:
    """The pipelined load's options (``--connections``, ``--pipeline``, ``--processes``), with
    a benchmark's own defaults."""
    parser.add_argument("--connections", type=int, default=connections,
                        help="load connections")
    parser.add_argument("--pipeline", type=int, default=pipeline,
                        help="requests in flight per connection")
    parser.add_argument("--processes", type=int, default=processes,
                        help="load-generator processes")


def run_pipelined(host: str, port: int, pairs: Sequence[tuple[str, str]], *, connections: int,
                  pipeline: int, processes: int, seconds: float,
                  drain_s: float = DRAIN_S) -> dict[str, Any]:
    """Drive the server for ``seconds`` from ``processes`` processes sharing ``connections``;
    replies still owed ``drain_s`` after that are counted as ``timeout`` errors.

    Returns:
        ``{"requests": answered, "ok": successes, "errors": {code: n}, "wall_s",
        "throughput_rps", "p50_ms": None, "load_cpu_s"}``: successes per second of wall time,
        and the CPU the load processes spent while driving (start-up not counted).

    Raises:
        RuntimeError: a load process failed (it could not connect, or a connection broke).
    """
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    workers = [ctx.Process(target=_drive, args=(host, port, list(pairs), share, pipeline,
                                                seconds, drain_s, i, go, results),
                           daemon=True)
               for i, share in enumerate(shares) if share]
    for worker in workers:
        worker.start()
    failed: list[str] = []
    try:
        started = [results.get(timeout=120) for _ in workers]  # every connection open
        failed = [why for why in started if why]
        if failed:
            raise RuntimeError(f"load process failed: {failed[0]}")
        go.set()  # all at once
        outcomes = [results.get(timeout=seconds + drain_s + 60) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=0 if failed else 10)
            if worker.is_alive():
                worker.terminate()
    failed = [o["failed"] for o in outcomes if o["failed"]]
    if failed:
        raise RuntimeError(f"load process failed: {failed[0]}")
    ok = sum(o["ok"] for o in outcomes)
    errors = sum((Counter(o["errors"]) for o in outcomes), Counter())
    wall = max(o["wall_s"] for o in outcomes)
    return {"requests": ok + sum(errors.values()), "ok": ok, "errors": dict(errors),
            "wall_s": wall, "throughput_rps": ok / wall if wall > 0 else 0.0, "p50_ms": None,
            "load_cpu_s": sum(o["cpu_s"] for o in outcomes)}


def _drive(host: str, port: int, pairs: list[tuple[str, str]], connections: int, pipeline: int,
           seconds: float, drain_s: float, index: int, go: Any, results: Any) -> None:
    """One load process: open its connections (then report "" or why it could not), wait for
    ``go``, drive them, report the counts and the CPU it spent driving them."""
    try:
        load = _Load(host, port, pairs, connections, pipeline, first=index * 7)
    except OSError as exc:
        results.put(f"could not connect: {exc}")
        return
    results.put("")
    outcome: dict[str, Any] = {"ok": 0, "errors": {}, "wall_s": 0.0, "cpu_s": 0.0,
                               "failed": None}
    go.wait()
    cpu = time.process_time()
    try:
        outcome.update(load.run(seconds, drain_s))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        outcome["failed"] = f"{type(exc).__name__}: {exc}"
    outcome["cpu_s"] = time.process_time() - cpu
    results.put(outcome)


class _Load:
    """One process's connections, each with ``pipeline`` requests in flight."""

    def __init__(self, host: str, port: int, pairs: list[tuple[str, str]], connections: int,
                 pipeline: int, first: int) -> None:
        self.pairs, self.pipeline = pairs, pipeline
        self.selector = selectors.DefaultSelector()
        self.next_pair, self.next_id = first, 0
        self.owed: dict[socket.socket, int] = {}
        self.decoders: dict[socket.socket, FrameDecoder] = {}
        self.ok, self.errors = 0, Counter[str]()
        for _ in range(connections):
            sock = socket.create_connection((host, port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.owed[sock], self.decoders[sock] = 0, FrameDecoder()
            self.selector.register(sock, selectors.EVENT_READ)

    def run(self, seconds: float, drain_s: float) -> dict[str, Any]:
        """Send until ``seconds`` have passed, then collect what is owed for up to ``drain_s``;
        the counts."""
        started = time.perf_counter()
        stop_sending, give_up = started + seconds, started + seconds + drain_s
        for sock in self.owed:
            self._send(sock, self.pipeline)
        last = started
        while any(self.owed.values()) and time.perf_counter() < give_up:
            for key, _ in self.selector.select(timeout=0.5):
                replies = self._read(key.fileobj)  # type: ignore[arg-type]
                if replies:
                    last = time.perf_counter()
                    if last < stop_sending:
                        self._send(key.fileobj, replies)  # type: ignore[arg-type]
        missing = sum(self.owed.values())  # replies still owed after drain_s
        if missing:
            self.errors["timeout"] += missing
        for sock in self.owed:
            sock.close()
        return {"ok": self.ok, "errors": dict(self.errors), "wall_s": last - started}

    def _send(self, sock: socket.socket, count: int) -> None:
        frames = []
        for _ in range(count):
            question, context = self.pairs[self.next_pair % len(self.pairs)]
            frames.append(encode_frame(qa_request(self.next_id, question, context)))
            self.next_pair += 1
            self.next_id += 1
        sock.sendall(b"".join(frames))
        self.owed[sock] += count

    def _read(self, sock: socket.socket) -> int:
        """Read what is there; count its replies; how many were read."""
        data = sock.recv(1 << 18)
        if not data:
            raise ConnectionError(f"the server closed a connection owing {self.owed[sock]} "
                                  "replies")
        decoder, replies = self.decoders[sock], 0
        decoder.receive_data(data)
        while (message := decoder.next_message()) is not None:
            replies += 1
            if message.get("ok"):
                self.ok += 1
            else:
                self.errors[str((message.get("error") or {}).get("code"))] += 1
        self.owed[sock] -= replies
        return replies
