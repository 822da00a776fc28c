"""A whole tuning run: the model alone first (the ceiling, the reference answers, and the
objective where the user gives none), a probe trial of the likeliest candidate (what a trial
costs), then the search."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.loadgen import Item
from settings.server_config import ServerConfig
from tuning.choice import Asked, Chosen, choose_objective
from tuning.model_alone import ModelAlone, measure_model
from tuning.search import ETA, MIN_LOAD_S, BudgetTooSmall, Search, grid, halving, rung_counts
from tuning.space import Candidate
from tuning.trial import Load, Server, Trial


@dataclass(frozen=True)
class Plan:
    """What to tune: the served model, how trials start and load, and how long it may take."""

    server: Server
    folder: str  # the model loaded (a repository's: the one the requests name)
    items: Sequence[Item]
    asked: Asked  # the objective as given; what is not given is derived from the model alone
    config: ServerConfig  # the server's settings under the fixed flags: the task's, for one
    candidates: Sequence[Candidate]
    budget_s: float
    device: str = "auto"
    gpu: bool = False
    grid_load_s: float | None = None  # set: the exhaustive grid, each trial this long
    machine_words: str = ""  # the machine, in words
    check_answers: bool = True  # false for engines that answer at random (zero, sim)
    #: the fixed flags' settings as a --config file names them (flag without dashes, value)
    fixed_settings: tuple[tuple[str, Any], ...] = ()
    op: str = "qa"  # the op every request sends
    model_name: str | None = None  # the model requests name (a repository's; None: the only one)


@dataclass
class Outcome:
    """What the run found: the objective, the winner (None: no trial ran), every trial, and
    notes."""

    model: ModelAlone
    chosen: Chosen
    winner: Trial | None
    trials: list[Trial]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def tune(plan: Plan, *, on_trial: Callable[[Trial], None] | None = None,
         on_model: Callable[[ModelAlone, Chosen], None] | None = None) -> Outcome:
    """Run the tuning ``plan``: the model alone, the objective (as asked, the rest derived
    from the model alone), then the trials.

    Raises:
        BudgetTooSmall: the budget holds not even one trial (what it holds is said).
        RuntimeError: the model alone could not run, or the probe trial failed (said).
    """
    began = time.perf_counter()
    try:
        model = measure_model(plan.folder, plan.server.engine, plan.items, plan.config,
                              device=plan.device, gpu=plan.gpu)
    except Exception as exc:  # noqa: BLE001 - any failure to load or run it: said, exit 2
        raise RuntimeError(f"the model alone could not run: {type(exc).__name__}: {exc}") \
            from exc
    chosen = choose_objective(plan.asked, ceiling_rps=model.ceiling_rps,
                              alone_p99_ms=model.alone_p99_ms, rates=model.in_flight_rates(),
                              engines=model.engines)
    if on_model is not None:
        on_model(model, chosen)
    load = Load(chosen.objective, plan.items, model.expected if plan.check_answers else None,
                op=plan.op, model=plan.model_name)
    search = Search(plan.server, load, plan.budget_s, started=began, on_trial=on_trial)
    if not plan.check_answers:
        search.notes.append(f"answers were not checked: the {plan.server.engine} engine "
                            "answers at random")
    if plan.grid_load_s is not None:
        winner = grid(search, plan.candidates, plan.grid_load_s)
        return Outcome(model, chosen, winner, search.trials, search.notes,
                       time.perf_counter() - began)
    probe = _probe(search, plan.candidates[0], model)
    winner = probe
    try:
        winner = halving(search, plan.candidates)
    except BudgetTooSmall:
        search.notes.append(f"the budget held the probe only: give --budget_s "
                            f"{_enough(search, len(plan.candidates)):.0f} or more to search "
                            f"all {len(plan.candidates)} candidates")
    return Outcome(model, chosen, winner, search.trials, search.notes,
                   time.perf_counter() - began)


def _probe(search: Search, candidate: Candidate, model: ModelAlone) -> Trial:
    """The first candidate, briefly: it measures what a trial costs beyond its load.

    Raises:
        BudgetTooSmall: its server could not start and load within the budget.
    """
    left = search.left_s() - MIN_LOAD_S
    why = (f"--budget_s {search.budget_s:g} is too small for even one trial: measuring the "
           f"model alone took {model.seconds:.1f} s")
    if left <= 0:
        raise BudgetTooSmall(f"{why}, and a trial is a server start plus {MIN_LOAD_S:g} s of "
                             f"load at least; try --budget_s {_floor(model):.0f} or more")
    probe = search.run(-1, candidate, MIN_LOAD_S, start_timeout_s=left)
    if probe.figures is None and probe.start_timed_out:
        raise BudgetTooSmall(f"{why}, and its first server was not serving {left:.1f} s later, "
                             f"which left no time for its {MIN_LOAD_S:g} s of load; try "
                             f"--budget_s {_floor(model):.0f} or more")
    if probe.figures is None:
        raise RuntimeError(f"the first trial (the likeliest candidate: "
                           f"{candidate.label() or 'the flags after --'}) failed, so what a "
                           f"trial costs is unknown: {probe.error}")
    return probe


def _floor(model: ModelAlone) -> float:
    """A budget that holds a trial or two: the model alone, and a generous server start."""
    return max(60.0, 4 * model.seconds + 30)


def _enough(search: Search, candidates: int) -> float:
    """The budget that holds every candidate at the shortest trial, at least."""
    counts = rung_counts(candidates)
    used = search.budget_s - search.left_s()
    return used + sum(c * (search.overhead_s() + MIN_LOAD_S * ETA ** k)
                      for k, c in enumerate(counts))
