"""The settings the tuner searches on this machine, as candidates: each a set of server flags.

On CPUs: how the cores are split among worker processes, sessions and threads (every split
that uses every core once), times the batching mode and its caps. On GPUs: the layout of
executors and CPU processes (one process; ``--workers N``; N workers around one executor per
GPU), sessions, precision, length buckets, and batching caps fit for a GPU. A setting the user
fixes (tune.py's flags after ``--``) is searched no more.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Value = str | int | float
#: A short name for each searched setting in the trials table.
SHORT = {"workers": "proc", "executors": "exec", "num_inference_sessions": "sess",
         "threads_per_session": "thr", "batching": "batch", "max_batch_size": "rows",
         "max_batch_tokens": "tok", "precision": "prec", "length_buckets": "buckets"}
#: Batching on CPUs: the mode, with its caps (rows, rows x padded tokens) where it has any.
CPU_BATCHING: tuple[dict[str, Value], ...] = (
    {"batching": "auto", "max_batch_size": 32, "max_batch_tokens": 16384},
    {"batching": "fixed", "max_batch_size": 8, "max_batch_tokens": 4096},
    {"batching": "fixed", "max_batch_size": 32, "max_batch_tokens": 16384},
    {"batching": "off"},
)
#: Batching on GPUs, where large batches pay: no "off", larger caps.
GPU_BATCHING: tuple[dict[str, Value], ...] = (
    {"batching": "auto", "max_batch_size": 64, "max_batch_tokens": 32768},
    {"batching": "fixed", "max_batch_size": 32, "max_batch_tokens": 16384},
    {"batching": "fixed", "max_batch_size": 64, "max_batch_tokens": 32768},
)
GPU_PRECISIONS = ("fp16", "fp32")
GPU_BUCKETS = ("none", "64,128,256,384")  # "none": the flag left out


@dataclass(frozen=True)
class Machine:
    """What the search adapts to: CPU cores, and GPUs the engine can use."""

    cores: int
    gpus: int = 0

    @classmethod
    def here(cls, engine: str, device: str | None) -> Machine:
        """This machine, for ``engine`` (``--device cpu`` rules GPUs out)."""
        from engines.devices import usable_gpus

        gpus = 0 if device == "cpu" else usable_gpus(engine)[0]
        return cls(cores=os.cpu_count() or 1, gpus=gpus)

    def describe(self) -> str:
        """The machine in words."""
        gpus = f", {self.gpus} GPU(s)" if self.gpus else ", no GPU"
        return f"{self.cores} CPU core(s){gpus}"


@dataclass(frozen=True)
class Candidate:
    """One configuration: the searched settings' values, by flag name without dashes."""

    settings: tuple[tuple[str, Value], ...]

    @classmethod
    def of(cls, settings: Mapping[str, Value]) -> Candidate:
        """A candidate of these settings (``length_buckets`` "none": left out)."""
        return cls(tuple((k, v) for k, v in settings.items()
                         if not (k == "length_buckets" and v == "none")))

    def flags(self) -> list[str]:
        """The server flags that give these settings."""
        return [word for name, value in self.settings for word in (f"--{name}", str(value))]

    def label(self) -> str:
        """The settings in short, for the trials table."""
        return " ".join(f"{SHORT.get(name, name)}={value}" for name, value in self.settings)


def search_space(machine: Machine, fixed: Mapping[str, Any]) -> list[Candidate]:
    """Every candidate for ``machine``, most likely first, the settings in ``fixed`` (flag
    names without dashes) left out of the search; never empty."""
    rows = _gpu_rows(machine, fixed) if machine.gpus else _cpu_rows(machine, fixed)
    seen: dict[Candidate, None] = {}
    for row in rows:
        seen.setdefault(Candidate.of({k: v for k, v in row.items() if k not in fixed}))
    return list(seen)


def _values(fixed: Mapping[str, Any], name: str, searched: list[Any]) -> list[Any]:
    """The values of one setting to try: the user's, where fixed."""
    return [int(fixed[name])] if name in fixed else searched


def _cpu_rows(machine: Machine, fixed: Mapping[str, Any]) -> list[dict[str, Value]]:
    """Core splits (processes x sessions x threads = cores, powers of two) x batching."""
    cores = machine.cores
    powers = [2 ** n for n in range(cores.bit_length()) if 2 ** n <= cores]
    pairs = list(itertools.product(_values(fixed, "workers", powers),
                                   _values(fixed, "num_inference_sessions",
                                           [p for p in powers if p <= 4])))
    min_engines = min(procs * sessions for procs, sessions in pairs)  # where none fits: those
    splits: list[dict[str, Value]] = []
    for procs, sessions in pairs:
        if procs * sessions <= cores or not splits and procs * sessions == min_engines:
            threads = max(1, cores // (procs * sessions))
            splits.append({"workers": procs, "num_inference_sessions": sessions,
                           "threads_per_session": threads})
    splits.sort(key=lambda s: (s["workers"], -s["threads_per_session"]))  # 1 process first
    return [{**split, **batching} for batching in _batching(CPU_BATCHING, fixed)
            for split in splits]


def _gpu_rows(machine: Machine, fixed: Mapping[str, Any]) -> list[dict[str, Value]]:
    """Layouts (one process; N workers with an executor per GPU; N workers owning engines)
    x precision x length buckets x batching."""
    workers = [n for n in (2, 4, 8) if n <= max(2, machine.cores // 2)]
    layouts: list[dict[str, Value]] = [
        *({"workers": n, "executors": "on", "num_inference_sessions": 2} for n in workers),
        *({"workers": 1, "executors": "off", "num_inference_sessions": s} for s in (2, 1)),
        *({"workers": n, "executors": "off", "num_inference_sessions": 1}
          for n in workers[:2] if n <= 2 * machine.gpus * 2)]
    return [{**layout, "precision": precision, "length_buckets": buckets, **batching}
            for precision, buckets, batching, layout in itertools.product(
                GPU_PRECISIONS, GPU_BUCKETS, _batching(GPU_BATCHING, fixed), layouts)]


def _batching(options: tuple[dict[str, Value], ...],
              fixed: Mapping[str, Any]) -> list[dict[str, Value]]:
    """The batching options to try: those of the user's mode where it is fixed (its caps
    are still searched, unless "off", which has none)."""
    if "batching" not in fixed:
        return list(options)
    return [o for o in options if o["batching"] == fixed["batching"]] or \
        [{"batching": fixed["batching"]}]
