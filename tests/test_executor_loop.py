"""An executor's batches in one process: a worker batch cut into groups by length and joined
back, batches that fill a CUDA graph's row step, and jobs answered whole and once, with the tiny
model on ONNX Runtime and real connections (multiprocessing pipes)."""

from __future__ import annotations

import time
from multiprocessing import Pipe
from pathlib import Path

import numpy as np
import pytest

from engines.onnx_engine import OnnxEngine
from engines.torch_cuda_graphs import TracedReplay
from engines.torch_engine import TorchEngine
from scheduling.cost_model import CostModel
from scheduling.planner import BatchPolicy, plan_batch
from scheduling.session import time_shapes
from workers.executor_jobs import JobState, Link, Piece, fill_step
from workers.executor_loop import Executor
from workers.executor_wire import Answer, Failure, Job, join_groups, split_by_length


def batch_of(lengths: list[int], width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A collated batch: row i has ``lengths[i]`` real tokens, then padding up to ``width``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 2000, size=(len(lengths), width))
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask,
            "token_type_ids": np.zeros_like(ids)}


def test_a_batch_cut_by_row_length_runs_to_the_same_outputs_once_joined(
        tiny_model_dir: Path) -> None:
    engine = OnnxEngine(tiny_model_dir, device="cpu", intra_op_threads=1)
    lengths = [10, 100, 60, 200, 5]
    feeds = batch_of(lengths, 256)
    split = split_by_length(feeds, (64, 128, 256))
    assert [next(iter(g.values())).shape for g in split.groups] == [(3, 64), (1, 128), (1, 256)]
    assert [p.tolist() for p in split.places] == [[0, 2, 4], [1], [3]]
    joined = join_groups([engine.run(group) for group in split.groups], split.places,
                         rows=5, width=256, per_token=True)
    whole = engine.run(feeds)
    for name, value in whole.items():
        assert joined[name].shape == value.shape
        for row, length in enumerate(lengths):  # the real tokens' outputs: trimming is padding
            np.testing.assert_allclose(joined[name][row, :length], value[row, :length],
                                       rtol=1e-4, atol=1e-4)
    pooled = [{"embeddings": np.full((len(p), 4), float(i))} for i, p in enumerate(split.places)]
    rows = join_groups(pooled, split.places, rows=5, width=256, per_token=False)["embeddings"]
    assert rows[:, 0].tolist() == [0.0, 1.0, 0.0, 2.0, 0.0]  # one row per input, in order


def gpu_graph_policy(max_tokens: int) -> BatchPolicy:
    """A GPU's costs (a fixed launch, tokens cheap) on an engine with graphs of 1 to 64 rows."""
    cost = CostModel(row_steps=(1, 2, 4, 8, 16, 32, 64))
    for rows in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(rows, 64, (0.8 + 0.0005 * rows * 64) / 1000, warmup=True)
    return BatchPolicy(mode="auto", max_items=64, max_tokens=max_tokens, cost=cost, fill=True)


def pieces_of(*rows: int) -> list[Piece]:
    send, _ = Pipe()
    jobs = [JobState(Link(send), Job(n, [batch_of([64] * r, 64)])) for n, r in enumerate(rows)]
    return [Piece(job, 0, 0, r, 64, float(n)) for n, (job, r) in enumerate(zip(jobs, rows))]


def test_a_batch_fills_its_row_step_with_part_of_the_next_job() -> None:
    policy = gpu_graph_policy(max_tokens=64 * 64)
    window = pieces_of(20, 20, 30)
    chosen = fill_step(plan_batch(window, policy), window, policy)
    assert [p.rows for p in chosen] == [20, 20, 24]  # 40 rows run as 64: 24 of the third job
    assert [p.first for p in chosen] == [0, 0, 0]
    assert (window[2].first, window[2].rows) == (24, 6)  # its rest waits at its place
    assert chosen[2].state is window[2].state
    lone = pieces_of(20)
    assert fill_step(plan_batch(lone, policy), lone, policy) == lone  # nothing else waits
    without_steps = BatchPolicy(mode="auto", max_items=64, max_tokens=64 * 64, cost=CostModel(),
                                fill=True)
    window = pieces_of(20, 20, 30)
    assert [p.rows for p in fill_step(window[:2], window, without_steps)] == [20, 20]


def test_every_job_is_answered_once_with_its_own_rows_outputs(tiny_model_dir: Path) -> None:
    engine = OnnxEngine(tiny_model_dir, device="cpu", intra_op_threads=1)
    policy = BatchPolicy(mode="auto", max_items=64, max_tokens=16 * 64,
                         cost=CostModel(row_steps=(1, 2, 4, 8, 16)), fill=True)
    time_shapes(engine, policy, (64,))
    executor = Executor(engine, policy, per_token=True)
    ours, theirs = Pipe()
    link = Link(theirs)
    jobs = [Job(n, split_by_length(batch_of([40 + n] * rows, 64, seed=n), (64,)).groups)
            for n, rows in enumerate((5, 9, 13, 3, 7))]
    for job in jobs:
        executor.submit(link, job)
    answers = [ours.recv() for _ in jobs]
    executor.stop(timeout=10)
    assert not ours.poll(0.2)  # nothing answered twice
    assert sorted(a.job_id for a in answers) == [0, 1, 2, 3, 4]
    for answer in answers:
        assert isinstance(answer, Answer)
        [group] = jobs[answer.job_id].groups
        expected = engine.run(group)
        for name, value in expected.items():
            np.testing.assert_allclose(answer.outputs[0][name], value, rtol=1e-4, atol=1e-4)
    figures = executor.figures()
    assert figures["rows"] == 37 and figures["jobs"] == 5
    assert figures["pieces_waiting"] == 0


def test_an_overlapping_executor_answers_every_job_once_with_its_own_rows_outputs(
        tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cpu", threads=1, graph="cudagraphs",
                         capture=TracedReplay, lengths=(64,), max_seq_len=64, max_tokens=1024)
    assert engine.overlaps
    policy = BatchPolicy(mode="auto", max_items=64, max_tokens=16 * 64,
                         cost=CostModel(engine.row_steps, engine.length_steps), fill=True)
    time_shapes(engine, policy, (64,))
    executor = Executor(engine, policy, per_token=True, overlap=True)
    assert executor.overlap
    ours, theirs = Pipe()
    link = Link(theirs)
    jobs = [Job(n, split_by_length(batch_of([30 + n] * rows, 64, seed=n), (64,)).groups)
            for n, rows in enumerate((5, 9, 13, 3, 7, 16, 1, 11))]
    for job in jobs:
        executor.submit(link, job)
    answers = [ours.recv() for _ in jobs]
    executor.stop(timeout=10)
    assert not ours.poll(0.2)  # nothing answered twice
    assert sorted(a.job_id for a in answers) == list(range(len(jobs)))
    for answer in answers:
        assert isinstance(answer, Answer)
        [group] = jobs[answer.job_id].groups
        for name, value in engine.run(group).items():
            np.testing.assert_allclose(answer.outputs[0][name], value, rtol=1e-5, atol=1e-6)
    assert executor.figures()["rows"] == 65 and executor.figures()["jobs"] == len(jobs)
    assert Executor(engine, policy, per_token=True).overlap is False  # asked for, only


def plain_executor(model_dir: Path, overlap: bool = False) -> Executor:
    """An executor over the tiny model, its cost model unmeasured: on ONNX Runtime, or with
    ``overlap`` on PyTorch's graphs (their CPU stand-in), launching batches as they run."""
    engine = TorchEngine(model_dir, device="cpu", threads=1, graph="cudagraphs",
                         capture=TracedReplay, lengths=(64,), max_seq_len=64,
                         max_tokens=1024) if overlap else \
        OnnxEngine(model_dir, device="cpu", intra_op_threads=1)
    policy = BatchPolicy(mode="auto", max_items=64, max_tokens=16 * 64, cost=CostModel(),
                         fill=True)
    return Executor(engine, policy, per_token=True, overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_worker_gone_mid_answer_stops_no_one_else(tiny_model_dir: Path, overlap: bool) -> None:
    executor = plain_executor(tiny_model_dir, overlap)
    gone_end, gone_peer = Pipe()
    gone = Link(gone_peer)
    ours, theirs = Pipe()
    alive = Link(theirs)
    group = split_by_length(batch_of([40] * 3, 64), (64,)).groups
    gone_end.close()  # its worker died: every answer to it fails
    for n in range(20):
        executor.submit(gone, Job(n, group))
        executor.submit(alive, Job(100 + n, group))
        if n == 10:
            gone.close()  # its connection thread saw the end, mid-way through the answers
    answers = [ours.recv() for _ in range(20)]
    executor.stop(timeout=10)
    assert sorted(a.job_id for a in answers) == list(range(100, 120))
    gone.send(Job(0, []))  # a closed link: nothing sent, nothing raised


@pytest.mark.parametrize("overlap", [False, True])
def test_a_job_past_its_deadline_is_answered_so_and_never_runs(tiny_model_dir: Path,
                                                               overlap: bool) -> None:
    executor = plain_executor(tiny_model_dir, overlap)
    ours, theirs = Pipe()
    link = Link(theirs)
    group = split_by_length(batch_of([40] * 3, 64), (64,)).groups
    now = time.monotonic()
    executor.submit(link, Job(0, group, now - 0.001))  # its requests stopped waiting
    executor.submit(link, Job(1, group, now + 60))
    executor.submit(link, Job(2, group))  # no deadline
    replies = {reply.job_id: reply for reply in (ours.recv() for _ in range(3))}
    executor.stop(timeout=10)
    assert isinstance(replies[0], Failure) and replies[0].code == "deadline_exceeded"
    for job_id in (1, 2):
        answer = replies[job_id]
        assert isinstance(answer, Answer)
        assert answer.queued_s >= 0 and answer.run_s > 0 and answer.device_s > 0
    figures = executor.figures()
    assert figures["expired_jobs"] == 1 and figures["jobs"] == 2
    assert figures["rows"] == 6  # the expired job's rows never ran
