"""The objective a tuning run optimises, and the order trials rank in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Objective:
    """Closed loop (``rate`` None): the most requests/s with p99 at most ``p99_ms`` at
    ``clients`` clients. Open loop: the lowest p99 at ``rate`` requests/s of Poisson arrivals,
    meeting it where p99 is at most ``p99_ms``."""

    p99_ms: float = 200.0
    clients: int = 32
    rate: float | None = None

    def describe(self) -> str:
        """The objective in words."""
        if self.rate is not None:
            return (f"the lowest p99 at {self.rate:g} requests/s (open loop), "
                    f"at most {self.p99_ms:g} ms")
        return f"the most requests/s with p99 at most {self.p99_ms:g} ms at {self.clients} clients"

    def meets(self, figures: dict[str, Any]) -> bool:
        """Whether a trial's figures meet the objective: every request answered, and
        correctly, and p99 within bound."""
        return answered_all(figures) and figures["p99_ms"] <= self.p99_ms

    def rank_key(self, figures: dict[str, Any] | None) -> tuple[float, ...]:
        """Sorts trials best first: those that answered everything correctly before those that
        did not. Closed loop: those that meet the objective before those that do not, each by
        requests/s (where nothing meets it, the most requests/s is the closest: at a fixed
        number of clients, latency falls as throughput rises, and a short trial's p99 is
        noisier than its throughput). Open loop: by p99."""
        if figures is None or not answered_all(figures):
            return (2.0, -(figures or {}).get("ok", 0))
        if self.rate is None:
            return (0.0 if self.meets(figures) else 1.0, -figures["throughput_rps"])
        return (0.0, figures["p99_ms"])

    def shortfall(self, figures: dict[str, Any]) -> str:
        """By how much a trial misses the objective."""
        if not answered_all(figures):
            return "it did not answer every request correctly"
        return (f"its p99 was {figures['p99_ms']:.0f} ms, {figures['p99_ms'] / self.p99_ms:.1f}x "
                f"the objective's {self.p99_ms:g} ms")


def answered_all(figures: dict[str, Any] | None) -> bool:
    """Every request of the trial answered, with the model's answer (no error, no
    ``wrong_answer``); false for a trial without figures."""
    return figures is not None and figures["requests"] > 0 and \
        figures["ok"] == figures["requests"]
