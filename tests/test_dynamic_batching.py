"""Dynamic batching: batches form when a session is free, within caps, length- and cost-aware.

The engines here are real Engine implementations whose cost the test controls: they sleep for a
time given by a formula of the batch shape and return logits of the right shape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import Client
from engines.base import Engine
from scheduling.cost_model import CostModel
from scheduling.planner import BatchPolicy
from scheduling.queue import WorkItem, WorkQueue
from scheduling.session import InferenceSession
from server import InferenceServer, ServerConfig
from tasks.qa import QATask
from tests.helpers import CONTEXTS, QUESTIONS


class TimedEngine(Engine):
    """Sleeps ``cost(rows, length)`` seconds per batch; records every batch shape it ran."""

    name = "timed"

    def __init__(self, cost: Callable[[int, int], float]) -> None:
        self.cost = cost
        self.input_names = ("input_ids", "attention_mask", "token_type_ids")
        self.shapes: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a run began (it may be waiting at the gate)

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        self.entered.set()
        assert self.gate.wait(60)
        rows, length = feeds["input_ids"].shape
        self.shapes.append((rows, length))
        time.sleep(self.cost(rows, length))
        logits = np.zeros((rows, length), dtype=np.float32)
        return {"start_logits": logits, "end_logits": logits.copy()}


class HostWaitingEngine(TimedEngine):
    """A GPU beside busy host threads: the device spends ``device(rows, length)`` seconds on a
    batch, which it reports (``device_s``), but each run's wall time also holds host waits that
    grow faster than the batch (``waits``: the GIL taken back between launches)."""

    def __init__(self, device: Callable[[int, int], float],
                 waits: Callable[[int, int], float]) -> None:
        super().__init__(lambda rows, length: device(rows, length) + waits(rows, length))
        self.device_cost = device

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        outputs = super().run(feeds)
        self.device_s = self.device_cost(*feeds["input_ids"].shape)
        return outputs


def item(length: int, rows: int = 1, tag: Any = None) -> WorkItem:
    return WorkItem(features=tag if tag is not None else length, respond=lambda r, e: None,
                    rows=rows, length=length)


def drain(queue: WorkQueue, policy: BatchPolicy) -> list[list[Any]]:
    batches = []
    queue.close()
    while batch := queue.take_batch(policy):
        batches.append([i.features for i in batch])
        queue.done()
    return batches


# -- batch formation at the queue ---------------------------------------------------------------

def test_a_lone_request_is_taken_at_once_whatever_the_queue_delay() -> None:
    queue = WorkQueue()
    queue.put(item(64))
    policy = BatchPolicy(mode="fixed", max_items=8, max_delay_s=5.0)
    started = time.monotonic()
    assert len(queue.take_batch(policy)) == 1
    assert time.monotonic() - started < 2.5  # the 5 s delay was not spent: no other load


def test_a_burst_forms_batches_up_to_the_request_cap() -> None:
    queue = WorkQueue()
    for n in range(10):
        queue.put(item(64, tag=n))
    batches = drain(queue, BatchPolicy(mode="fixed", max_items=4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(sum(batches, [])) == list(range(10))


def test_the_token_budget_caps_rows_times_padded_length() -> None:
    queue = WorkQueue()
    shapes = [(64, 1), (300, 2), (64, 1), (128, 1), (300, 1), (32, 3), (64, 1), (500, 2)]
    for n, (length, rows) in enumerate(shapes):
        queue.put(WorkItem(features=n, respond=lambda r, e: None, rows=rows, length=length))
    policy = BatchPolicy(mode="fixed", max_items=8, max_tokens=640)
    for batch in drain(queue, policy):
        rows = sum(shapes[n][1] for n in batch)
        length = max(shapes[n][0] for n in batch)
        assert rows * length <= 640 or len(batch) == 1  # one oversized request runs alone


def test_similar_lengths_are_batched_together() -> None:
    queue = WorkQueue()
    for n, length in enumerate([40, 380, 42, 370, 44, 375]):
        queue.put(item(length, tag=(n, length)))
    batches = drain(queue, BatchPolicy(mode="fixed", max_items=3))
    lengths = [sorted(length for _, length in batch) for batch in batches]
    assert lengths == [[40, 42, 44], [370, 375, 380]]


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones() -> None:
    queue = WorkQueue()
    policy = BatchPolicy(mode="fixed", max_items=2, lookahead=4)
    queue.put(item(16, tag="short-0"))
    queue.put(item(500, tag="LONG"))
    taken: list[Any] = []
    for n in range(1, 40):  # shorts keep arriving, each preferred by length over the long one
        queue.put(item(16, tag=f"short-{n}"))
        taken.append([i.features for i in queue.take_batch(policy)])
        queue.done()
        if any("LONG" in b for b in taken):
            break
    position = next(k for k, b in enumerate(taken) if "LONG" in b)
    assert position <= 1  # served as soon as it is the oldest waiting request


def test_off_takes_one_request_at_a_time() -> None:
    queue = WorkQueue()
    for n in range(3):
        queue.put(item(64, tag=n))
    assert drain(queue, BatchPolicy(mode="off", max_items=8)) == [[0], [1], [2]]


@pytest.mark.parametrize("per_row_cost, expected_size", [
    (lambda rows, length: 0.001 * rows * (1 + 0.2 * (rows - 1)), 1),  # batching hurts (CPU-like)
    (lambda rows, length: 0.010 + 0.0005 * rows, 8),                  # overhead-bound (GPU-like)
])
def test_auto_batches_only_as_far_as_the_measured_cost_pays(per_row_cost: Any,
                                                            expected_size: int) -> None:
    cost = CostModel()
    for rows in (1, 2, 4, 8):
        cost.observe(rows, 64, per_row_cost(rows, 64))
    queue = WorkQueue()
    for n in range(8):
        queue.put(item(64, tag=n))
    batch = queue.take_batch(BatchPolicy(mode="auto", max_items=8, cost=cost))
    assert len(batch) == expected_size


# -- the server, end to end ----------------------------------------------------------------------

def serve(tiny_model_dir: Path, engine: TimedEngine, **options: Any) -> InferenceServer:
    config = ServerConfig(port=0, model_dir=str(tiny_model_dir), num_inference_sessions=1,
                          **options)
    return InferenceServer(config, engine_factory=lambda: engine)


def burst_batch_sizes(server: InferenceServer, engine: TimedEngine, count: int) -> list[int]:
    """Hold the session on a long request, send a burst of short ones, release; the batch sizes
    the session formed for the burst. (The held batch's time includes the hold: it is a long
    request so that outlier lands in another shape bucket than the burst's.)"""
    engine.gate.clear()
    engine.entered.clear()
    with Client(*server.address) as client:
        blocker = client.submit(QUESTIONS[0], " ".join(CONTEXTS * 3))
        # the session has taken the blocker alone and waits at the gate (admitted and out of
        # the queue is not enough: on a busy machine the burst could still join it there)
        assert engine.entered.wait(60)
        futures = [client.submit(QUESTIONS[i % 6], CONTEXTS[i % 6]) for i in range(count)]
        while server.stats.admitted < count + 1:
            time.sleep(0.01)
        engine.gate.set()
        results = [f.result(timeout=60) for f in futures]
        blocker.result(timeout=60)
    assert all(CONTEXTS[i % 6][r["start"]:r["end"]] == r["answer"] for i, r in enumerate(results))
    hist = server.stats.snapshot()["batch_size_histogram"]
    sizes = sorted((int(k) for k, v in hist.items() for _ in range(v)), reverse=True)
    sizes.remove(1)  # the blocker's own batch
    return sizes


@pytest.fixture
def gpu_like() -> TimedEngine:
    return TimedEngine(lambda rows, length: 0.02 + 0.0002 * rows)


def test_server_auto_batches_a_burst_on_overhead_bound_hardware(tiny_model_dir: Path,
                                                              gpu_like: TimedEngine) -> None:
    with serve(tiny_model_dir, gpu_like, batching="auto", max_batch_size=8) as server:
        sizes = burst_batch_sizes(server, gpu_like, 20)
        stats = server.stats_result()
    assert sum(sizes) == 20 and max(sizes) == 8  # held-back burst taken in full batches
    assert stats["batching"]["mode"] == "auto" and stats["batching"]["cost_model_ms"]


def test_server_auto_serves_batch_one_where_batching_does_not_pay(tiny_model_dir: Path) -> None:
    # costs of tens of ms, a row's cost doubling per row: beside two busy processes a late
    # wake-up (tens of ms under SCHED_BATCH) must not make one row look dearer per row than two
    cpu_like = TimedEngine(lambda rows, length: 0.02 * rows * rows)
    with serve(tiny_model_dir, cpu_like, batching="auto", max_batch_size=8) as server:
        sizes = burst_batch_sizes(server, cpu_like, 12)
    assert sizes == [1] * 12


def test_warm_up_times_shapes_before_ready_and_stops_where_batching_stops_paying(
        tiny_model_dir: Path) -> None:
    # costs as above: beside busy processes a 4 ms row timed 8 ms once, and two rows looked
    # cheaper per row than one
    cpu_like = TimedEngine(lambda rows, length: 0.02 * rows * rows)
    with serve(tiny_model_dir, cpu_like, batching="auto", max_batch_size=32) as server:
        warmed = list(cpu_like.shapes)
        assert server.ready
    assert warmed, "no warm-up before ready"
    assert max(rows for rows, _ in warmed) == 2  # per-row cost rose at 2 rows: stop there


def test_batches_grow_with_load_when_host_waits_inflate_the_wall_time_but_not_the_device_time(
        tiny_model_dir: Path) -> None:
    engine = HostWaitingEngine(lambda rows, length: 0.02 + 0.0002 * rows,  # GPU-like
                               lambda rows, length: 0.004 * rows * (1 + 0.3 * (rows - 1)))
    with serve(tiny_model_dir, engine, batching="auto", max_batch_size=8) as server:
        sizes = burst_batch_sizes(server, engine, 20)
        table = server.stats_result()["batching"]["cost_model_ms"]
    assert sum(sizes) == 20 and max(sizes) == 8  # the cost model learnt the device's costs
    assert table["8x64"] < 2 * table["1x64"]


def test_a_device_bound_engine_fills_batches_to_the_token_budget(tiny_model_dir: Path) -> None:
    engine = TimedEngine(lambda rows, length: 0.004 * rows * (1 + 0.3 * (rows - 1)))  # CPU-like
    engine.device_bound = True  # but the engine says a device runs its batches
    with serve(tiny_model_dir, engine, batching="auto", max_batch_size=16,
               max_batch_tokens=256, length_buckets="64") as server:
        sizes = burst_batch_sizes(server, engine, 12)
        described = server.stats_result()["engine"]
    assert sizes == [4, 4, 4]  # 4 x 64 tokens: the budget, whatever the costs measured
    assert described["device_bound"] is True


def test_fixed_batches_up_to_the_cap_and_off_never_batches(tiny_model_dir: Path,
                                                          gpu_like: TimedEngine) -> None:
    with serve(tiny_model_dir, gpu_like, batching="fixed", max_batch_size=5) as server:
        assert max(burst_batch_sizes(server, gpu_like, 12)) == 5
    off = TimedEngine(lambda rows, length: 0.001)
    with serve(tiny_model_dir, off, batching="off", max_batch_size=5) as server:
        assert burst_batch_sizes(server, off, 6) == [1] * 6


def test_batches_respect_the_token_budget_in_the_server(tiny_model_dir: Path,
                                                       gpu_like: TimedEngine) -> None:
    with serve(tiny_model_dir, gpu_like, batching="fixed", max_batch_size=16,
               max_batch_tokens=200) as server:
        burst_batch_sizes(server, gpu_like, 16)
    for rows, length in gpu_like.shapes:
        assert rows * length <= 200 or rows == 1


def test_live_measurements_replace_warm_up_ones_in_the_cost_model() -> None:
    cost = CostModel()
    cost.observe(4, 64, 0.010, warmup=True)  # measured with the server idle
    cost.observe(4, 64, 0.011, warmup=True)
    cost.observe(4, 64, 0.030)  # the same shape under load
    assert cost.estimate(4, 64) == pytest.approx(0.030)
    cost.observe(4, 64, 0.020)
    assert cost.estimate(4, 64) == pytest.approx(0.020)  # lower median of the live samples


def test_one_outlier_does_not_move_a_bucket_with_history() -> None:
    cost = CostModel()
    for _ in range(4):
        cost.observe(1, 64, 0.010)
    cost.observe(1, 64, 0.500)  # a pause
    assert cost.estimate(1, 64) == pytest.approx(0.010)


# -- learning corrects the warm-up's figures ----------------------------------------------------

def warm_then_burst(model_dir: Path, engine: TimedEngine, count: int,
                    settle: Callable[[], None]) -> tuple[list[int], dict[str, float], dict]:
    """One auto-batching session on ``engine``, warmed up at the length of the burst to come;
    ``settle`` runs once it is ready (what changes between warm-up and serving). It is then
    held on a longer request (another length: its figure stays apart) while ``count`` like
    requests queue, and let go. The rows of each burst batch in order, and the cost model's
    table after warm-up and at the end."""
    task = QATask.from_dir(model_dir)
    burst, long = task.preprocess(QUESTIONS[0], CONTEXTS[0]), \
        task.preprocess(QUESTIONS[0], " ".join(CONTEXTS * 3))
    length = task.padded_length(burst.max_len)
    queue, cost = WorkQueue(), CostModel()
    session = InferenceSession(0, lambda: engine, task, queue,
                               BatchPolicy(mode="auto", max_items=8, cost=cost), warmup=[length])
    session.start()
    assert session.ready.wait(60) and session.load_error is None
    warmed, ran_before = cost.table(), len(engine.shapes)
    settle()
    engine.gate.clear()
    queue.put(WorkItem(features=long, respond=lambda r, e: None, rows=long.rows,
                       length=task.padded_length(long.max_len)))
    while len(queue):  # the session took the long one and waits at the gate
        time.sleep(0.01)
    for _ in range(count):
        queue.put(WorkItem(features=burst, respond=lambda r, e: None, length=length))
    engine.gate.set()
    queue.close()
    session.join(60)
    assert not session.is_alive() and session.crash is None
    shapes = engine.shapes[ran_before:]
    return [rows for rows, n in shapes if n == length], warmed, cost.table()


def cpu_like(rows: int, length: int) -> float:
    """Batching does not pay: two rows cost more than two runs of one."""
    return 0.010 * rows * (1 + 0.2 * (rows - 1))


def test_live_batches_correct_a_warm_up_on_an_idle_machine_that_made_batching_pay(
        tiny_model_dir: Path) -> None:
    loaded = threading.Event()  # set once warmed up: serving beside other work
    engine = HostWaitingEngine(lambda rows, length: cpu_like(rows, length) if loaded.is_set()
                               else 0.010 + 0.001 * rows, lambda rows, length: 0.0)
    sizes, warmed, learned = warm_then_burst(tiny_model_dir, engine, 20, loaded.set)
    assert max(int(shape.split("x")[0]) for shape in warmed) == 8  # batching paid, to the cap
    assert sizes[0] == 8 and sizes[-4:] == [1, 1, 1, 1]  # batches until measured, then one
    assert sum(sizes) == 20
    two = next(shape for shape in learned if shape.startswith("2x"))
    assert learned[two] == pytest.approx(24.0)  # the live figure, not the warm-up's 12


def test_a_one_row_figure_inflated_through_warm_up_does_not_make_batches(
        tiny_model_dir: Path) -> None:
    """Other processes warm up beside this one the whole time: one row times 3x its cost,
    however often it is timed again. Held as it was, it made batching look cheap for good
    (batches of 8, then of 4, one row never run to be measured again); left out, one row is
    run and learnt."""
    warm = threading.Event()  # set once warmed up: the others are done
    engine = HostWaitingEngine(lambda rows, length: cpu_like(rows, length) * (
        1 if warm.is_set() or rows > 1 else 3), lambda rows, length: 0.0)
    sizes, warmed, learned = warm_then_burst(tiny_model_dir, engine, 12, warm.set)
    assert not any(shape.startswith("1x") for shape in warmed)  # 30 ms, undercut by 2 rows' 24
    assert sizes == [1] * 12
    one = next(shape for shape in learned if shape.startswith("1x"))
    assert learned[one] == pytest.approx(10.0)
