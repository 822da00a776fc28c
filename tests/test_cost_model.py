"""The cost model holds no batch as cheaper than a smaller one of its length, and warm-up
timing keeps the figures a busy machine would inflate out of it: plain numbers, and an engine
whose times the test gives."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.base import Engine
from scheduling.cost_model import CostModel, monotone
from scheduling.planner import BatchPolicy, worth_batching
from scheduling.session import WARMUP_RETIMES, WARMUP_RUNS, time_shapes


@pytest.mark.parametrize("warmup", [True, False], ids=["warm-up", "learned"])
def test_a_figure_a_bigger_batch_undercuts_is_left_out(warmup: bool) -> None:
    cost = CostModel()
    cost.observe(1, 384, 0.2168, warmup=warmup)  # timed while other workers warmed up
    cost.observe(2, 384, 0.1807, warmup=warmup)
    assert cost.table() == {"2x384": pytest.approx(180.7)}
    assert cost.estimate(1, 384) == pytest.approx(0.1807 / 2)  # from the 2-row figure
    assert cost.estimate(2, 384) == pytest.approx(0.1807)
    policy = BatchPolicy(mode="auto", max_items=32, cost=cost)
    assert worth_batching(policy, 384) == 1  # 2 rows are no cheaper per row than 1


def test_the_figure_counts_again_once_no_bigger_batch_undercuts_it() -> None:
    cost = CostModel()
    cost.observe(1, 384, 0.2168, warmup=True)
    cost.observe(2, 384, 0.1807, warmup=True)
    cost.observe(2, 384, 0.2500)  # live: replaces the 2-row warm-up figure
    assert cost.table() == {"1x384": pytest.approx(216.8), "2x384": pytest.approx(250.0)}
    cost.observe(1, 64, 0.050)  # another length is judged on its own
    assert cost.table()["1x64"] == pytest.approx(50.0)


def test_monotone_keeps_the_points_no_bigger_batch_undercuts() -> None:
    assert monotone([(1, 3.0), (2, 2.0), (4, 5.0), (8, 4.0), (16, 9.0)]) == \
        [(2, 2.0), (8, 4.0), (16, 9.0)]
    assert monotone([(1, 1.0), (2, 1.0), (4, 3.0)]) == [(1, 1.0), (2, 1.0), (4, 3.0)]  # ties stay


@settings(max_examples=200, deadline=None)
@given(observed=st.lists(st.tuples(st.integers(1, 64), st.sampled_from([32, 64, 200, 384]),
                                   st.floats(1e-4, 1.0), st.booleans()), min_size=1, max_size=40),
       stepped=st.booleans())
def test_estimates_never_fall_as_rows_grow(observed: list[tuple[int, int, float, bool]],
                                           stepped: bool) -> None:
    cost = CostModel(row_steps=(1, 2, 4, 8, 16, 32, 64) if stepped else None)
    for rows, length, seconds, warmup in observed:
        cost.observe(rows, length, seconds, warmup=warmup)
    for length in (32, 64, 100, 384, 512):
        estimates = [cost.estimate(rows, length) for rows in range(1, 80)]
        assert all(a is not None and b is not None and a <= b * (1 + 1e-12)
                   for a, b in zip(estimates, estimates[1:])), (length, estimates)
    held: dict[int, list[tuple[int, float]]] = {}
    for shape, ms in cost.table().items():
        rows, length = map(int, shape.split("x"))
        held.setdefault(length, []).append((rows, ms))
    for points in held.values():
        figures = [ms for _, ms in sorted(points)]
        assert figures == sorted(figures)


# -- warm-up ------------------------------------------------------------------------------------

class ScriptedEngine(Engine):
    """Reports the device time the test scripts for each run of a shape (the last one again
    once a shape's script runs out); records every shape it ran."""

    name = "scripted"

    def __init__(self, script: Mapping[tuple[int, int], list[float]]) -> None:
        self.script = {shape: list(times) for shape, times in script.items()}
        self.input_names = ("input_ids", "attention_mask")
        self.ran: list[tuple[int, int]] = []

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, length = feeds["input_ids"].shape
        self.ran.append((rows, length))
        times = self.script[(rows, length)]
        self.device_s = times.pop(0) if len(times) > 1 else times[0]
        logits = np.zeros((rows, length), dtype=np.float32)
        return {"start_logits": logits, "end_logits": logits.copy()}


def warmed(script: Mapping[tuple[int, int], list[float]]) -> tuple[CostModel, ScriptedEngine]:
    cost, engine = CostModel(), ScriptedEngine(script)
    time_shapes(engine, BatchPolicy(mode="auto", max_items=32, cost=cost), [64])
    return cost, engine


def test_warm_up_keeps_the_fastest_of_its_runs_of_a_shape() -> None:
    cost, engine = warmed({(1, 64): [0.050, 0.012, 0.010, 0.030], (2, 64): [0.040]})
    assert engine.ran.count((1, 64)) == WARMUP_RUNS
    assert cost.table() == {"1x64": pytest.approx(10.0), "2x64": pytest.approx(40.0)}


def test_a_smaller_shape_a_bigger_one_undercuts_is_timed_again() -> None:
    busy, idle = [0.030] * WARMUP_RUNS, [0.010]
    cost, engine = warmed({(1, 64): busy + idle, (2, 64): [0.018], (4, 64): [0.040]})
    assert engine.ran.count((1, 64)) == 2 * WARMUP_RUNS  # once more, with the machine its own
    assert cost.table() == {"1x64": pytest.approx(10.0), "2x64": pytest.approx(18.0),
                            "4x64": pytest.approx(40.0)}  # 4 rows stopped paying: the end


def test_a_shape_busy_through_every_retime_is_left_out_of_the_cost_model() -> None:
    cost, engine = warmed({(1, 64): [0.030], (2, 64): [0.018], (4, 64): [0.040]})
    assert engine.ran.count((1, 64)) == (1 + WARMUP_RETIMES) * WARMUP_RUNS
    assert cost.table() == {"2x64": pytest.approx(18.0), "4x64": pytest.approx(40.0)}
    assert cost.estimate(1, 64) == pytest.approx(0.009)  # no cheaper per row than 2 rows
