"""The search: successive halving within a time budget, or the exhaustive grid.

Successive halving runs every candidate briefly, keeps the best third (``ETA``), runs those
three times as long, and so on down to one, the winner, measured longest. Each rung's trial
length comes from the budget left and what a trial costs beyond its load (server start and
stop, the load's processes), measured on the probe and re-measured as trials run; where even
the shortest useful trial of every candidate does not fit, the least likely candidates are
left out, and that is said.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tuning.objective import Objective, answered_all
from tuning.space import Candidate
from tuning.trial import Load, Server, Trial, run_trial

#: Each rung keeps 1/ETA of the candidates and runs them ETA times as long.
ETA = 3
#: The shortest load a trial is given (seconds): below it, p99 is a handful of requests.
MIN_LOAD_S = 3.0
#: The share of the budget left that each plan spends: trials that start slower than those
#: before them (more processes) take the rest.
PLANNED = 0.95


class BudgetTooSmall(Exception):
    """Not even one trial fits in the time budget."""


@dataclass(frozen=True)
class Rung:
    """One round of successive halving: how many candidates, and seconds of load each."""

    count: int
    load_s: float


def rung_counts(candidates: int, eta: int = ETA) -> list[int]:
    """Candidates per rung: all of them, then 1/eta of the last (rounded up), down to one."""
    counts = [max(1, candidates)]
    while counts[-1] > 1:
        counts.append(math.ceil(counts[-1] / eta))
    return counts


def plan(candidates: int, overhead_s: float, budget_s: float, eta: int = ETA,
         min_load_s: float = MIN_LOAD_S) -> list[Rung]:
    """The rungs for the first ``n <= candidates`` candidates that fit ``budget_s`` with the
    first rung's trials at ``min_load_s`` at least, each next rung's ``eta`` times as long
    (``n``: the first rung's count).

    Raises:
        BudgetTooSmall: not even one candidate fits.
    """
    for n in range(candidates, 0, -1):
        counts = rung_counts(n, eta)
        weight = sum(count * eta ** k for k, count in enumerate(counts))
        first = (budget_s - overhead_s * sum(counts)) / weight
        if first >= min_load_s:
            return [Rung(count, first * eta ** k) for k, count in enumerate(counts)]
    raise BudgetTooSmall(f"{budget_s:.0f} s holds no trial of {overhead_s:.0f} s of start and "
                         f"stop plus {min_load_s:g} s of load")


@dataclass
class Search:
    """A search's state: its trials so far, and its clock."""

    server: Server
    load: Load
    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    trials: list[Trial] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_trial: Callable[[Trial], None] | None = None

    @property
    def objective(self) -> Objective:
        """The objective trials are ranked by."""
        return self.load.objective

    def left_s(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (time.perf_counter() - self.started)

    def run(self, rung: int, candidate: Candidate, load_s: float,
            start_timeout_s: float | None = None) -> Trial:
        """One trial, recorded (its server's start given at most ``start_timeout_s``, and
        never more than ``Server.start_timeout_s``)."""
        limit = min(start_timeout_s or self.server.start_timeout_s, self.server.start_timeout_s)
        trial = run_trial(len(self.trials) + 1, rung, candidate, load_s, self.server, self.load,
                          limit)
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial

    def overhead_s(self) -> float:
        """What a trial has cost beyond its load, at most (start, stop, load processes)."""
        costs = [t.wall_s - t.load_s for t in self.trials if t.figures is not None]
        return max(costs) if costs else 0.0

    def best(self, trials: Sequence[Trial]) -> list[Trial]:
        """``trials`` best first, by the objective."""
        return sorted(trials, key=lambda t: self.objective.rank_key(t.figures))


def halving(search: Search, candidates: Sequence[Candidate]) -> Trial:
    """Successive halving over ``candidates`` (most likely first) within what is left of the
    budget; the winner's trial (``winner``: the best of the last rung where a trial answered
    everything).

    Raises:
        BudgetTooSmall: not even the first rung's shortest trial of one candidate fits.
    """
    rungs = plan(len(candidates), search.overhead_s(), PLANNED * search.left_s())
    if rungs[0].count < len(candidates):
        search.notes.append(f"the budget holds {rungs[0].count} of {len(candidates)} "
                            "candidates: the rest (least likely first) were not tried")
    alive = list(candidates[:rungs[0].count])
    for k, rung in enumerate(rungs):
        load_s = rung.load_s
        if k:  # re-planned on what is left and what trials have really cost
            try:
                left = plan(len(alive), search.overhead_s(), PLANNED * search.left_s())
            except BudgetTooSmall:
                search.notes.append(f"the budget ran short: rung {k} was not run")
                break
            if left[0].count < len(alive):
                search.notes.append(f"the budget ran short: rung {k} ran the best "
                                    f"{left[0].count} of {len(alive)}")
                alive = alive[:left[0].count]
            load_s = left[0].load_s
        ranked = search.best(_rung(search, k, alive, load_s))
        sound = [t.candidate for t in ranked if answered_all(t.figures)]
        if len(alive) == 1 or len(sound) < 2:
            break
        alive = sound[:math.ceil(len(alive) / ETA)]
    return winner(search)


def _rung(search: Search, k: int, candidates: Sequence[Candidate],
          load_s: float) -> list[Trial]:
    """One rung's trials, stopping short (said) where the next would overrun the budget."""
    trials = []
    for n, candidate in enumerate(candidates):
        if n and search.left_s() < search.overhead_s() + load_s:
            search.notes.append(f"the budget ran short: rung {k} tried {n} of "
                                f"{len(candidates)}")
            break
        trials.append(search.run(k, candidate, load_s,
                                 start_timeout_s=max(10.0, search.left_s() - load_s)))
    return trials


def winner(search: Search) -> Trial:
    """The best trial of the highest rung where one answered everything (the longest
    measured), else the best of all."""
    sound = [t for t in search.trials if answered_all(t.figures)]
    top = max((t.rung for t in sound), default=None)
    return search.best([t for t in sound if t.rung == top] if sound else search.trials)[0]


def grid(search: Search, candidates: Sequence[Candidate], load_s: float) -> Trial:
    """Every candidate for ``load_s`` seconds (no budget): the exhaustive reference the
    halving is measured against; the best trial (``winner``)."""
    for candidate in candidates:
        search.run(0, candidate, load_s)
    return winner(search)
