"""The batch planner is pure: plain lists of waiting requests in, a batch out, no threads."""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.cost_model import CostModel
from scheduling.planner import BatchPolicy, plan_batch, wait_for_more


@dataclass(eq=False)
class Waiting:
    rows: int
    length: int
    enqueued_at: float = 0.0


def linear_cost(per_batch_ms: float, per_token_ms: float) -> CostModel:
    """A cost model timed on shapes whose cost is a fixed part plus a part per token."""
    cost = CostModel()
    for rows in (1, 2, 4, 8, 16):
        for length in (64, 128, 256):
            cost.observe(rows, length, (per_batch_ms + per_token_ms * rows * length) / 1000,
                         warmup=True)
    return cost


def test_fixed_fills_to_the_cap_with_similar_lengths_first() -> None:
    waiting = [Waiting(1, 100), Waiting(1, 300), Waiting(1, 110), Waiting(1, 105)]
    batch = plan_batch(waiting, BatchPolicy(mode="fixed", max_items=3))
    assert batch == [waiting[0], waiting[3], waiting[2]]


def test_the_oldest_is_always_taken_and_the_token_cap_holds() -> None:
    waiting = [Waiting(4, 256), Waiting(4, 256), Waiting(1, 16)]
    batch = plan_batch(waiting, BatchPolicy(mode="fixed", max_items=8, max_tokens=1024))
    assert batch[0] is waiting[0]
    assert sum(w.rows for w in batch) * max(w.length for w in batch) <= 1024
    assert waiting[1] not in batch


def test_off_takes_one() -> None:
    waiting = [Waiting(1, 10) for _ in range(5)]
    assert plan_batch(waiting, BatchPolicy(mode="off")) == [waiting[0]]


def test_auto_batches_only_where_the_cost_model_says_it_pays() -> None:
    waiting = [Waiting(1, 64) for _ in range(8)]
    fixed_cost = BatchPolicy(mode="auto", max_items=8, cost=linear_cost(5.0, 0.001))
    assert len(plan_batch(waiting, fixed_cost)) == 8  # a big fixed part: batching pays
    per_token = BatchPolicy(mode="auto", max_items=8, cost=linear_cost(0.0, 0.01))
    assert len(plan_batch(waiting, per_token)) == 1  # all cost scales with tokens: it does not


def test_waiting_for_more_only_under_load_and_before_the_delay_runs_out() -> None:
    policy = BatchPolicy(mode="fixed", max_items=4, max_delay_s=0.010)
    chosen = [Waiting(1, 64, enqueued_at=100.0)]
    assert wait_for_more(policy, chosen, 1, busy=1, arrival_rate=1000.0, now=100.002) > 0.007
    assert wait_for_more(policy, chosen, 1, busy=0, arrival_rate=1000.0, now=100.002) == 0.0
    assert wait_for_more(policy, chosen, 1, busy=1, arrival_rate=10.0, now=100.002) == 0.0
    assert wait_for_more(policy, chosen, 1, busy=1, arrival_rate=1000.0, now=100.011) == 0.0
