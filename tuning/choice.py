"""The objective a run tunes for where the user gives none, or only part of one: derived from
the model alone, measured first on this machine, so that it is one the model can meet here
(docs/tuning.md#the-objective).

Closed loop (no ``--rate``), each part the user did not give:

- **clients** = 2 x the requests in flight the model needs: the fewest at which the model alone
  came within 10% of its ceiling (``KNEE``; among one request at a time, its batches, and its
  one-thread engines at once), and at least one per such engine (a core each). Twice that, so
  that as many again wait while those run: no engine idles between a reply and the next request.
- **p99 bound** = ``HEADROOM`` x (the model's p99 for a request alone + the time to drain the
  ``clients - 1`` requests that can be ahead of it at the ceiling) + ``SERVER_MS``, rounded up
  to two significant figures. In a closed loop no more than ``clients - 1`` requests are ever
  ahead of one, so a server as fast as the model alone answers within the sum. The headroom is
  for what a server adds to the model's time (a long request on a one-thread session takes
  about twice what it takes on 2 cores; its queues and threads; the load's own processes on the
  same cores), and for a host whose speed moves between the model alone and a trial;
  ``SERVER_MS`` for what a round trip through a server costs whatever the model (sockets,
  scheduling), which rules where the model takes a few milliseconds.

Open loop (``--rate``): the bound is ``HEADROOM`` x (the p99 alone + the p99 wait of one queue
(M/M/1) at the rate against the ceiling) + ``SERVER_MS``, the queue's load capped at
``MAX_LOAD``; its connections stay ``OPEN_LOOP_CONNECTIONS`` where not given (they carry the
rate, they do not make it). A part the user gives is used as given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tuning.objective import Objective

#: The share of the ceiling that counts as reaching it.
KNEE = 0.9
#: The bound's margin over an ideal server's worst case: a factor (a long request on a
#: one-thread session of 2 cores, 2x; a host whose speed moves by a quarter, 1.25x), and
#: milliseconds.
HEADROOM = 3.0
SERVER_MS = 50.0
#: Open loop: the queue's load (rate / ceiling) the wait is computed at, at most.
MAX_LOAD = 0.9
#: Open loop: connections where the user gives none.
OPEN_LOOP_CONNECTIONS = 32


@dataclass(frozen=True)
class Asked:
    """The objective as the user gave it: each part None where not given."""

    p99_ms: float | None = None
    clients: int | None = None
    rate: float | None = None

    def given(self) -> Objective | None:
        """The objective where nothing is left to derive, else None."""
        if self.p99_ms is None or (self.clients is None and self.rate is None):
            return None
        clients = self.clients if self.clients is not None else OPEN_LOOP_CONNECTIONS
        return Objective(self.p99_ms, clients, self.rate)

    def describe(self) -> str:
        """What is asked, in words, before the model alone is measured."""
        objective = self.given()
        if objective is not None:
            return objective.describe()
        parts = [f"{self.rate:g} requests/s" if self.rate is not None else "",
                 f"{self.clients} clients" if self.clients is not None else "",
                 f"p99 at most {self.p99_ms:g} ms" if self.p99_ms is not None else ""]
        given = ", ".join(p for p in parts if p)
        return (f"{given}, the rest " if given else "") + "derived from the model alone"


@dataclass(frozen=True)
class Chosen:
    """The objective a run tunes for, why (one or two lines), and the parts derived."""

    objective: Objective
    why: tuple[str, ...]
    derived: tuple[str, ...] = ()


def in_flight(rates: Mapping[int, float], ceiling_rps: float, engines: int = 1) -> int:
    """The requests in flight the model needs to run near its ceiling: the fewest of ``rates``
    (requests/s by requests in flight) within ``KNEE`` of ``ceiling_rps``, ``engines`` at least.
    """
    if ceiling_rps <= 0 or not rates:
        raise ValueError("the model alone's rates must be positive")
    near = [n for n, rps in rates.items() if rps >= KNEE * ceiling_rps]
    return max(min(near) if near else max(rates), engines, 1)


def clients_for(needed: int) -> int:
    """Closed-loop clients: twice the requests in flight the model needs."""
    return 2 * needed


def queue_ms(clients: int, ceiling_rps: float) -> float:
    """What the ``clients - 1`` requests that can be ahead of one take at the ceiling (ms)."""
    return 1000.0 * (clients - 1) / ceiling_rps


def closed_loop_p99_ms(alone_p99_ms: float, clients: int, ceiling_rps: float) -> float:
    """The closed loop's p99 bound: the headroom times (the p99 alone + the queue ahead), and
    a server's round trip."""
    return round_up(HEADROOM * (alone_p99_ms + queue_ms(clients, ceiling_rps)) + SERVER_MS)


def wait_p99_ms(rate: float, ceiling_rps: float) -> float:
    """The p99 wait in one queue (M/M/1) at ``rate`` against ``ceiling_rps`` (ms), the load
    capped at ``MAX_LOAD``: P(wait > t) = load x e^(-(ceiling - rate) t)."""
    load = min(rate / ceiling_rps, MAX_LOAD)
    return 1000.0 * max(0.0, math.log(100 * load)) / (ceiling_rps * (1 - load))


def open_loop_p99_ms(alone_p99_ms: float, rate: float, ceiling_rps: float) -> float:
    """The open loop's p99 bound: the headroom times (the p99 alone + the queue's p99 wait),
    and a server's round trip."""
    return round_up(HEADROOM * (alone_p99_ms + wait_p99_ms(rate, ceiling_rps)) + SERVER_MS)


def round_up(value: float) -> float:
    """``value`` rounded up to two significant figures (656 -> 660, 2754 -> 2800)."""
    if value <= 0:
        return value
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    return round(math.ceil(value / step - 1e-9) * step, 9)


def choose_objective(asked: Asked, *, ceiling_rps: float, alone_p99_ms: float,
                     rates: Mapping[int, float], engines: int = 1) -> Chosen:
    """The objective of ``asked``, its missing parts derived from the model alone's figures:
    its ceiling, its p99 for a request alone, its requests/s by requests in flight, and its
    one-thread engines run at once (1: none)."""
    if asked.rate is not None:
        return _open_loop(asked, asked.rate, ceiling_rps, alone_p99_ms)
    needed = in_flight(rates, ceiling_rps, engines)
    clients = asked.clients if asked.clients is not None else clients_for(needed)
    p99 = asked.p99_ms if asked.p99_ms is not None else \
        closed_loop_p99_ms(alone_p99_ms, clients, ceiling_rps)
    objective = Objective(p99, clients)
    if asked.given() is not None:
        return Chosen(objective, (f"objective (as given): {objective.describe()}",))
    first = f"objective: the most requests/s at {clients} clients" + (
        " (as given)" if asked.clients is not None else
        f", 2 x the {needed} in flight that bring the model near its {ceiling_rps:.1f} "
        "req/s ceiling")
    second = f"  with p99 at most {p99:g} ms" + (
        " (as given)" if asked.p99_ms is not None else
        f": {HEADROOM:g} x (its p99 alone, {alone_p99_ms:.0f} ms, + {clients - 1} requests "
        f"ahead at {ceiling_rps:.1f} req/s, {queue_ms(clients, ceiling_rps):.0f} ms) + "
        f"{SERVER_MS:g} ms")
    derived = tuple(name for name, value in (("clients", asked.clients), ("p99_ms", asked.p99_ms))
                    if value is None)
    return Chosen(objective, (first, second), derived)


def _open_loop(asked: Asked, rate: float, ceiling_rps: float, alone_p99_ms: float) -> Chosen:
    """The open loop's objective: ``rate`` as given, its bound derived where not given."""
    connections = asked.clients if asked.clients is not None else OPEN_LOOP_CONNECTIONS
    if asked.p99_ms is not None:
        objective = Objective(asked.p99_ms, connections, rate)
        return Chosen(objective, (f"objective (as given): {objective.describe()}",))
    p99 = open_loop_p99_ms(alone_p99_ms, rate, ceiling_rps)
    objective = Objective(p99, connections, rate)
    load = rate / ceiling_rps
    return Chosen(objective, (
        f"objective: the lowest p99 at {rate:g} requests/s ({load:.2f} of the model's ceiling, "
        f"as given), over {connections} connections,",
        f"  met at p99 at most {p99:g} ms: {HEADROOM:g} x (its p99 alone, {alone_p99_ms:.0f} ms, "
        f"+ a queue's p99 wait at load {min(load, MAX_LOAD):.2f}, "
        f"{wait_p99_ms(rate, ceiling_rps):.0f} ms) + {SERVER_MS:g} ms"),
        ("p99_ms",))
