"""The cost model holds no batch as cheaper than a smaller one of its length: plain numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.cost_model import CostModel, monotone
from scheduling.planner import BatchPolicy, worth_batching


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

