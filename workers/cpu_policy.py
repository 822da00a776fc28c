"""``--cpu_scheduling``: the Linux CPU scheduling policy the serving processes run under.

``batch`` (the default) puts every thread of ``python server.py``, and of each worker process,
under ``SCHED_BATCH``: Linux's policy for CPU-bound work. It changes one thing: a thread of
ours that wakes up does not preempt the thread running on a busy core; it waits for that
thread's time slice to end, or takes an idle core at once. An idle machine therefore serves a
lone request exactly as before, while a saturated one stops switching between its front end,
its workers and their threads on every wake-up: each thread keeps the core, and its caches,
for a whole slice, and more requests gather for each socket read, pipe message and batch. On
this project's 2-core machine, that took the server's CPU per request down by about a fifth
with worker processes (docs/benchmarks.md, the eighth session).

``normal`` leaves the default policy (``SCHED_OTHER``). Threads under a policy other than these
two (real-time, or ``SCHED_IDLE``, set by an operator with ``chrt``) are left alone, as is every
thread where the operating system has no such policy (not Linux).

Policies belong to threads, and a new thread or process inherits its creator's: setting it
early, in the main thread, covers every thread started later, the engines' own thread pools
included. Threads already running are set too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The choices of ``--cpu_scheduling``.
CPU_POLICIES = ("batch", "normal")
#: The server setting whose values these are (settings/choices.py).
SETTING_CHOICES = {"cpu_scheduling": CPU_POLICIES}
#: What each choice means, for the start-up log.
MEANINGS = {
    "batch": "SCHED_BATCH for every thread (one that wakes on a busy core waits for the "
             "running thread's time slice instead of preempting it: fewer switches under load; "
             "--cpu_scheduling normal turns it off)",
    "normal": "SCHED_OTHER, the kernel's default (--cpu_scheduling batch: fewer switches "
              "under load)",
}


@dataclass(frozen=True)
class Applied:
    """What ``apply_cpu_scheduling`` did: the policy set (None: none, and ``why_not`` says why,
    with the policy that applies instead), and how many threads kept an operator's own policy.
    ``str()`` is the short form (``batch``), ``explained()`` the start-up log's line."""

    policy: str | None
    kept: int = 0
    why_not: str = ""

    def __str__(self) -> str:
        if self.policy is None:
            return self.why_not
        return self.policy + (f" ({self.kept} thread(s) under the operator's own policy kept it)"
                              if self.kept else "")

    def explained(self) -> str:
        """The short form with what the policy means (``batch = SCHED_BATCH for every ...``)."""
        if self.policy is None:
            return self.why_not
        kept = (f"; {self.kept} thread(s) under the operator's own policy kept it"
                if self.kept else "")
        return f"{self.policy} = {MEANINGS[self.policy]}{kept}"


def _os_policies() -> dict[str, int]:
    """Our choices' ``os`` constants, where this operating system has them (Linux)."""
    names = {"batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}
    if not hasattr(os, "sched_setscheduler"):
        return {}
    return {ours: getattr(os, name) for ours, name in names.items() if hasattr(os, name)}


def _threads() -> list[int]:
    """The ids of this process's threads (only the calling one where /proc does not list them)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{os.getpid()}/task")]
    except OSError:
        return [0]  # 0: the calling thread


def apply_cpu_scheduling(policy: str) -> Applied:
    """Put this process's threads, and those it starts later, under ``policy``.

    Args:
        policy: One of ``CPU_POLICIES``.

    Returns:
        What now applies (``str()`` of it for a log line).
    """
    if policy not in CPU_POLICIES:
        raise ValueError(f"cpu scheduling must be one of {CPU_POLICIES}, not {policy!r}")
    policies = _os_policies()
    if policy not in policies:
        return Applied(None, why_not=f"{'normal' if policy == 'normal' else 'unchanged'} "
                                     f"({policy} needs Linux)")
    ours = set(policies.values())
    kept = 0
    for tid in _threads():
        try:
            if os.sched_getscheduler(tid) not in ours:
                kept += 1  # real-time or idle: the operator's choice
                continue
            os.sched_setscheduler(tid, policies[policy], os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:  # refused (a sandbox's seccomp, say): serve as we are
            log.warning("cannot set the CPU scheduling policy to %s (%s); serving under the "
                        "current one", policy, exc)
            return Applied(None, why_not=f"unchanged ({exc.strerror or exc})")
    return Applied(policy, kept)
