"""--workers N over a repository: N worker processes per model where the memory holds them,
fewer (at least one) where it does not, said in words."""

from __future__ import annotations

from workers.memory_plan import available_mb, plan_workers, worker_mb


def test_workers_as_asked_where_the_memory_holds_them() -> None:
    plan = plan_workers(2, [86.0, 86.0], 20_000.0)
    assert plan.workers == 2
    assert plan.why.startswith("4 worker processes, about ")
    assert plan.why.endswith("MB of 20000 MB available")


def test_fewer_workers_where_the_memory_does_not_hold_them() -> None:
    each = worker_mb(86.0) + worker_mb(86.0)
    plan = plan_workers(4, [86.0, 86.0], each * 2 / 0.7 + 1)  # room for two per model
    assert plan.workers == 2
    assert plan.why.startswith("2 worker(s) per model, not 4: 8 processes would take about")
    assert plan_workers(4, [86.0, 86.0], 10.0).workers == 1  # one each, whatever the memory


def test_unknown_memory_keeps_the_workers_asked() -> None:
    assert plan_workers(3, [500.0], None).workers == 3


def test_this_machine_says_how_much_memory_is_available() -> None:
    found = available_mb()
    assert found is None or found > 0
