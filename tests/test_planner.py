"""The batch planner is pure: plain lists of waiting requests in, a batch out, no threads."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.cost_model import CostModel
from scheduling.planner import (
    MIN_GAIN,
    SHORTER_SLACK,
    BatchPolicy,
    cheaper_together,
    plan_batch,
    wait_for_more,
)


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


def test_a_device_bound_engine_fills_batches_to_the_token_budget_whatever_the_costs() -> None:
    waiting = [Waiting(1, 64, enqueued_at=100.0) for _ in range(8)]
    dear = linear_cost(0.0, 0.01)  # every cost scales with tokens: batching looks worthless
    judged = BatchPolicy(mode="auto", max_items=8, max_tokens=320, cost=dear)
    filled = BatchPolicy(mode="auto", max_items=8, max_tokens=320, cost=dear, fill=True)
    assert len(plan_batch(waiting, judged)) == 1
    assert plan_batch(waiting, filled) == waiting[:5]  # 5 x 64 tokens: the budget
    assert len(plan_batch(waiting, BatchPolicy(mode="auto", fill=True))) == 8  # no cost data
    assert len(plan_batch(waiting, BatchPolicy(mode="off", fill=True))) == 1
    # and it waits for more as fixed does, not only where the cost model says it pays
    delayed = BatchPolicy(mode="auto", max_items=4, max_delay_s=0.010, cost=dear, fill=True)
    assert wait_for_more(delayed, waiting[:1], 1, busy=1, arrival_rate=1000.0,
                         now=100.002) > 0.007
    assert wait_for_more(BatchPolicy(mode="auto", max_items=4, max_delay_s=0.010, cost=dear),
                         waiting[:1], 1, busy=1, arrival_rate=1000.0, now=100.002) == 0.0


def test_a_device_bound_batch_takes_another_length_only_where_its_padding_pays() -> None:
    # a GPU's costs: a fixed launch, then tokens cheap (the H200's curve: 32 x 64 costs 1.5 ms,
    # 32 x 384 6.6 ms, 1 x 384 0.9 ms)
    gpu = CostModel()
    for rows in (1, 2, 4, 8, 16, 32):
        for length in (64, 128, 384):
            gpu.observe(rows, length, (0.8 + 0.0005 * rows * length) / 1000, warmup=True)
    short = [Waiting(1, 64) for _ in range(20)]
    long = [Waiting(1, 384) for _ in range(10)]
    filled = BatchPolicy(mode="auto", max_items=32, cost=gpu, fill=True)
    # led by a short request: every short one, no long one (20 x 384 would cost far more)
    assert plan_batch(short[:1] + long + short[1:], filled) == short
    # led by a long one: the long ones only: a short one padded to 384 tokens would cost
    # about 3 times what it costs in a full batch of its own length
    assert plan_batch(long[:1] + short + long[1:], filled) == long
    # where a long batch's extra rows cost little, short requests fill it
    flat = CostModel()  # a fixed cost per batch, rows almost free at any length
    for rows in (1, 2, 4, 8, 16, 32):
        for length in (64, 384):
            flat.observe(rows, length, (1.0 + 0.001 * rows * length / 384) / 1000, warmup=True)
    cheap = BatchPolicy(mode="auto", max_items=32, cost=flat, fill=True)
    assert plan_batch(long[:1] + short + long[1:], cheap) == long + short
    # without the device's costs it fills as before, whatever the lengths
    assert len(plan_batch(short[:1] + long + short[1:],
                          BatchPolicy(mode="auto", max_items=32, fill=True))) == 30


def one_by_one_plan(waiting: list[Waiting], policy: BatchPolicy) -> list[Waiting]:
    """The planner's rule, asked of the cost model request by request (no shortcuts)."""
    oldest = waiting[0]
    chosen, rows, length = [oldest], oldest.rows, oldest.length
    others = sorted(waiting[1:policy.lookahead], key=lambda item: abs(item.length - oldest.length))
    for item in others:
        if len(chosen) >= policy.cap:
            break
        new_rows, new_length = rows + item.rows, max(length, item.length)
        if policy.max_tokens and new_rows * new_length > policy.max_tokens:
            continue
        judged = policy.mode == "auto" and not policy.fill
        if judged and not cheaper_together(
                policy.cost, (rows, length), [(item.rows, item.length)], 0.0):
            continue
        shapes = [(new_rows, new_length), (rows, length), (item.rows, item.length)]
        known = policy.cost is not None and all(policy.cost.estimate(*shape) is not None
                                                for shape in shapes)
        if policy.fill and policy.mode == "auto" and known and item.length > length and \
                not cheaper_together(policy.cost, (rows, length), [(item.rows, item.length)],
                                     0.0):
            continue  # it would pad the batch longer, at a predicted loss
        if policy.fill and policy.mode == "auto" and known and item.length < length:
            assert policy.cost is not None
            adds = policy.cost.estimate(new_rows, new_length) - policy.cost.estimate(rows, length)
            own = min(policy.cost.estimate(r, item.length) / r
                      for r in (1, 2, 4, 8, 16, 32, 64, 128)
                      if r == 1 or (r <= policy.cap and (not policy.max_tokens
                                                         or r * item.length <= policy.max_tokens)))
            if adds > SHORTER_SLACK * own * item.rows:
                continue  # padded to the batch's length it costs more than in its own batch
        chosen.append(item)
        rows, length = new_rows, new_length
    if policy.mode == "auto" and not policy.fill and len(chosen) > 1 and not cheaper_together(
            policy.cost, None, [(i.rows, i.length) for i in chosen], MIN_GAIN):
        return [oldest]
    if policy.fill and policy.mode == "auto" and policy.cost is not None and policy.cost.stepped:
        return cut_to_cheapest_per_row(chosen, policy.cost)
    return chosen


def cut_to_cheapest_per_row(chosen: list[Waiting], cost: CostModel) -> list[Waiting]:
    """The longest prefix of ``chosen`` whose estimate per row is least (all without
    estimates)."""
    prefixes = [chosen[:n] for n in range(1, len(chosen) + 1)]
    costs = [cost.estimate(sum(i.rows for i in p), max(i.length for i in p)) for p in prefixes]
    if None in costs:
        return chosen
    per_row = [c / sum(i.rows for i in p) for c, p in zip(costs, prefixes, strict=True)]
    return max((p for p, c in zip(prefixes, per_row, strict=True)
                if c <= min(per_row) * (1 + 1e-9)), key=len)


LENGTHS = st.sampled_from([64, 100, 128, 384])
OBSERVATIONS = st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 16]), LENGTHS,
                                  st.sampled_from([0.001, 0.0025, 0.0027, 0.004, 0.01])),
                        min_size=1, max_size=12)


@settings(max_examples=500, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 3), LENGTHS), min_size=1, max_size=80),
       observed=OBSERVATIONS, mode=st.sampled_from(["auto", "fixed", "off"]),
       cap=st.integers(1, 40), max_tokens=st.sampled_from([None, 512, 2048, 8192]),
       lookahead=st.integers(1, 128), fill=st.booleans(), stepped=st.booleans())
def test_plans_match_the_rule_asked_request_by_request(
        shapes: list[tuple[int, int]], observed: list[tuple[int, int, float]], mode: str,
        cap: int, max_tokens: int | None, lookahead: int, fill: bool, stepped: bool) -> None:
    cost = CostModel(row_steps=(1, 2, 4, 8, 16) if stepped else None,
                     length_steps=(64, 128, 384) if stepped else None)
    for rows, length, seconds in observed:
        cost.observe(rows, length, seconds)
    waiting = [Waiting(rows, length) for rows, length in shapes]
    policy = BatchPolicy(mode=mode, max_items=cap, max_tokens=max_tokens, lookahead=lookahead,
                         cost=cost, fill=fill)
    assert plan_batch(waiting, policy) == one_by_one_plan(waiting, policy)


def test_estimates_follow_the_nearest_measured_length_as_lengths_are_measured() -> None:
    cost = CostModel()
    cost.observe(1, 64, 0.010)
    assert cost.estimate(1, 256) == 0.040  # only 64 measured: scaled by the tokens ratio
    cost.observe(1, 256, 0.050)
    assert cost.estimate(1, 256) == 0.050  # now measured itself
    assert cost.estimate(1, 128) == 0.020  # as near to 64 as to 256 (x2 each way): the shorter
    cost.observe(1, 512, 0.300)
    assert cost.estimate(1, 448) == 0.300 * 448 / 512  # nearer to the newly measured length
    assert cost.estimate(2, 64) == 0.020  # proportional below the first measured row count


def gpu_graph_costs() -> CostModel:
    """A GPU's costs (a fixed launch, then tokens cheap: about the H100's grid) on an engine
    that captured CUDA graphs at 1, 2, 4 ... 64 rows."""
    cost = CostModel(row_steps=(1, 2, 4, 8, 16, 32, 64))
    for rows in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(rows, 384, (0.8 + 0.0005 * rows * 384) / 1000, warmup=True)
    return cost


def test_with_row_steps_a_batch_costs_what_the_step_holding_it_costs() -> None:
    cost = gpu_graph_costs()
    assert cost.estimate(33, 384) == cost.estimate(64, 384)  # 33 rows replay the 64-row graph
    assert cost.estimate(32, 384) < cost.estimate(33, 384)
    cost.observe(42, 384, 0.0131)  # a live batch of 42 rows: the 64-row graph's time, as is
    assert cost.estimate(64, 384) == 0.0131
    smooth = CostModel()  # an engine that runs any row count: 42 rows' time scaled to 64
    smooth.observe(42, 384, 0.0131)
    assert abs(smooth.estimate(64, 384) - 0.0131 * 64 / 42) < 1e-12


def test_a_stepped_engines_batch_fills_a_step_rather_than_spilling_into_the_next() -> None:
    policy = BatchPolicy(mode="auto", max_items=128, max_tokens=16384, cost=gpu_graph_costs(),
                         fill=True)
    forty_two = [Waiting(1, 384) for _ in range(42)]
    assert plan_batch(forty_two, policy) == forty_two[:32]  # 42 would run as 64, dearer per row
    sixty_four = [Waiting(1, 256) for _ in range(64)]
    assert plan_batch(sixty_four, policy) == sixty_four  # a full step: cheapest per row
    smooth = BatchPolicy(mode="auto", max_items=128, max_tokens=16384, cost=CostModel(),
                         fill=True)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        smooth.cost.observe(rows, 384, (0.8 + 0.0005 * rows * 384) / 1000, warmup=True)
    assert plan_batch(forty_two, smooth) == forty_two  # no steps: the token budget's fill


def test_with_length_steps_rows_shorter_than_a_step_cost_what_the_step_costs() -> None:
    def graphs(length_steps: tuple[int, ...] | None) -> BatchPolicy:
        cost = CostModel(row_steps=(1, 2, 4, 8, 16), length_steps=length_steps)
        for rows in (1, 2, 4, 8, 16):
            for length in (64, 128):
                cost.observe(rows, length, (0.8 + 0.0005 * rows * length) / 1000, warmup=True)
        return BatchPolicy(mode="auto", max_items=16, max_tokens=4096, cost=cost, fill=True)

    stepped = graphs((64, 128)).cost
    assert stepped is not None
    assert stepped.estimate(2, 30) == stepped.estimate(2, 36) == stepped.estimate(2, 64)
    waiting = [Waiting(2, 30), Waiting(4, 28), Waiting(1, 28), Waiting(4, 36), Waiting(4, 36)]
    assert plan_batch(waiting, graphs((64, 128))) == waiting  # all run as the 64-token graph
    # scaled from 64 tokens, 30 would look half as dear as 36, and the 36s would stay out
    assert plan_batch(waiting, graphs(None)) == waiting[:3]


def test_a_shape_refused_may_join_once_the_batch_has_grown() -> None:
    cost = CostModel()  # two rows cost more than two runs of one; four cost little more than two
    for rows, seconds in ((1, 0.0010), (2, 0.0025), (4, 0.0027)):
        cost.observe(rows, 64, seconds)
    waiting = [Waiting(1, 64), Waiting(1, 64), Waiting(2, 64), Waiting(1, 64)]
    policy = BatchPolicy(mode="auto", max_items=8, cost=cost)
    assert plan_batch(waiting, policy) == [waiting[0], waiting[2], waiting[3]]
