"""The GPU cost curve: what one engine run costs per batch shape, as bench/gpu_check.sh measures
it, and the loader and validator that a simulated device imports. Standard library only.

    from engines.cost_curve import load_cost_curve

    curve = load_cost_curve("bench/results/cost_curve.json")     # CostCurveError if malformed
    variant = curve.variants()[0]            # Variant(engine, device, precision, graph)
    curve.lookup(variant, rows=5, length=200).wall_ms_median     # the 8 x 256 cell

The file (``SCHEMA``, version ``VERSION``) is one JSON object:

- ``schema``: ``"qa-server/gpu-cost-curve"``; ``version``: 1. A reader refuses other versions.
- ``machine``: what it ran on: ``gpu`` (a name, or null), ``cpu``, ``cores``, ``python`` and
  the versions of ``torch``, ``onnxruntime``, ``transformers``, ``tokenizers``.
- ``date``: when it ran (ISO 8601, UTC); ``commit``: the code's git commit (or ``unknown``).
- ``model``: ``name`` and ``dir`` of the model folder measured.
- ``rows``: the grid's rows per batch, ascending (1, 2, 4, 8, 16, 32, 64);
  ``lengths``: its tokens per row, ascending (64, 128, 256, 384).
- ``cells``: one object per measured (variant, rows, length):
  ``engine`` (``onnx``, ``pytorch``), ``device`` (``cuda:0``, ``cpu``), ``precision`` (what
  really ran: ``fp16``, ``fp32``, ``bf16``), ``graph`` (PyTorch: the ``--pytorch_graph`` asked
  for; ONNX: ``cudagraphs`` with ``--onnx_cuda_graphs on``, else null), ``runs_as`` (the graph
  the engine really ran, where it fell back; null for
  ONNX), ``rows``, ``length``, ``runs`` (timed runs, after untimed warm-up runs),
  ``wall_ms``: ``{"median", "p90"}`` of one run (inputs copied in, outputs copied back to host
  memory, as the server's engine call), and ``host_cpu_ms``: the process's CPU time over the
  timed runs (every thread: launches, copies, a CPU engine's own threads) divided by ``runs``;
  optionally ``host_ms``: the run's host parts, ``{part: median ms}`` (engines/sim_host.py's
  ``PARTS``), where the check measured them (CUDA graphs).
- ``skipped``: the cells of a variant not measured, each with its variant, ``rows``,
  ``length`` and ``why`` (the check's time ran short, the model is shorter, the engine failed).

Every variant covers the whole grid between ``cells`` and ``skipped``: ``validate`` says where
one does not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "qa-server/gpu-cost-curve"
VERSION = 1
#: The grid bench/gpu_check.sh measures.
ROWS = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = (64, 128, 256, 384)
_TOP = {"schema": str, "version": int, "machine": dict, "date": str, "commit": str,
        "model": dict, "rows": list, "lengths": list, "cells": list, "skipped": list}
_CELL = {"engine": str, "device": str, "precision": str, "rows": int, "length": int,
         "runs": int, "wall_ms": dict, "host_cpu_ms": (int, float)}
_SKIPPED = {"engine": str, "device": str, "precision": str, "rows": int, "length": int,
            "why": str}


class CostCurveError(ValueError):
    """A cost-curve file that does not follow the schema; ``problems`` lists each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Variant:
    """One engine as measured: ``graph`` is None for ONNX without CUDA graphs."""

    engine: str
    device: str
    precision: str
    graph: str | None

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> Variant:
        """The variant of a cell or skipped entry."""
        return cls(entry["engine"], entry["device"], entry["precision"], entry.get("graph"))

    def label(self) -> str:
        """``pytorch cuda:0 fp16 traced``."""
        return " ".join(filter(None, (self.engine, self.device, self.precision, self.graph)))


@dataclass(frozen=True)
class Cell:
    """One measured shape of one variant (milliseconds per run)."""

    variant: Variant
    rows: int
    length: int
    runs: int
    wall_ms_median: float
    wall_ms_p90: float
    host_cpu_ms: float
    runs_as: str | None = None
    host_ms: dict[str, float] | None = None


@dataclass(frozen=True)
class CostCurve:
    """A loaded, validated cost curve."""

    data: dict[str, Any]
    cells: dict[tuple[Variant, int, int], Cell]

    def variants(self) -> list[Variant]:
        """Every variant with at least one measured cell, in the file's order."""
        return list(dict.fromkeys(variant for variant, _, _ in self.cells))

    def lookup(self, variant: Variant, rows: int, length: int) -> Cell:
        """The cell of the smallest grid shape that holds ``rows`` x ``length`` (a batch is
        padded up to it, as the server pads to its length buckets).

        Raises:
            KeyError: the shape is beyond the grid, or that cell was not measured.
        """
        grid_rows = next((r for r in self.data["rows"] if r >= rows), None)
        grid_length = next((n for n in self.data["lengths"] if n >= length), None)
        key = (variant, grid_rows, grid_length)
        if grid_rows is None or grid_length is None or key not in self.cells:
            raise KeyError(f"{variant.label()}: no measured cell holds {rows} x {length}")
        return self.cells[key]  # type: ignore[index]


def _typed(entry: Any, fields: Mapping[str, Any], where: str) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where}: not an object"]
    return [f"{where}: {name} missing or not {getattr(kind, '__name__', 'a number')}"
            for name, kind in fields.items()
            if not isinstance(entry.get(name), kind) or isinstance(entry.get(name), bool)]


def validate(data: Any) -> list[str]:
    """Every way ``data`` (a parsed cost-curve file) breaks the schema; empty when it follows."""
    problems = _typed(data, _TOP, "file")
    if problems:
        return problems
    if data["schema"] != SCHEMA or data["version"] != VERSION:
        return [f"file: schema {data['schema']!r} version {data['version']}, not {SCHEMA!r} "
                f"version {VERSION}"]
    rows, lengths = data["rows"], data["lengths"]
    for name, grid in (("rows", rows), ("lengths", lengths)):
        if not grid or grid != sorted(set(grid)) or not all(
                isinstance(v, int) and v > 0 for v in grid):
            problems.append(f"file: {name} must be ascending positive integers")
    covered: dict[Variant, set[tuple[int, int]]] = {}
    for n, cell in enumerate(data["cells"]):
        found = _typed(cell, _CELL, f"cells[{n}]")
        if not found:
            wall = cell["wall_ms"]
            if not all(isinstance(wall.get(k), (int, float)) for k in ("median", "p90")):
                found.append(f"cells[{n}]: wall_ms needs median and p90")
            elif not 0 < wall["median"] <= wall["p90"] or cell["host_cpu_ms"] < 0 \
                    or cell["runs"] < 1:
                found.append(f"cells[{n}]: needs 0 < median <= p90, host_cpu_ms >= 0, runs >= 1")
            host = cell.get("host_ms")
            if host is not None and not (isinstance(host, dict) and all(
                    isinstance(v, (int, float)) and v >= 0 for v in host.values())):
                found.append(f"cells[{n}]: host_ms must map parts to ms >= 0")
        problems += found or _place(cell, f"cells[{n}]", rows, lengths, covered)
    for n, entry in enumerate(data["skipped"]):
        problems += _typed(entry, _SKIPPED, f"skipped[{n}]") or _place(
            entry, f"skipped[{n}]", rows, lengths, covered)
    grid = {(r, n) for r in rows for n in lengths}
    for variant, shapes in covered.items():
        if shapes != grid:
            missing = sorted(grid - shapes)
            problems.append(f"{variant.label()}: {len(missing)} grid cells neither measured nor "
                            f"skipped, e.g. {missing[:3]}")
    return problems


def _place(entry: dict[str, Any], where: str, rows: list[int], lengths: list[int],
           covered: dict[Variant, set[tuple[int, int]]]) -> list[str]:
    """Record the entry's shape under its variant; problems with the shape or a duplicate."""
    shape = (entry["rows"], entry["length"])
    if shape[0] not in rows or shape[1] not in lengths:
        return [f"{where}: {shape[0]} x {shape[1]} is not on the grid"]
    shapes = covered.setdefault(Variant.of(entry), set())
    if shape in shapes:
        return [f"{where}: {Variant.of(entry).label()} {shape[0]} x {shape[1]} appears twice"]
    shapes.add(shape)
    return []


def parse_cost_curve(data: Any) -> CostCurve:
    """A validated cost curve from parsed JSON.

    Raises:
        CostCurveError: it breaks the schema (every problem listed).
    """
    problems = validate(data)
    if problems:
        raise CostCurveError(problems)
    cells = {}
    for cell in data["cells"]:
        variant = Variant.of(cell)
        cells[variant, cell["rows"], cell["length"]] = Cell(
            variant, cell["rows"], cell["length"], cell["runs"], float(cell["wall_ms"]["median"]),
            float(cell["wall_ms"]["p90"]), float(cell["host_cpu_ms"]), cell.get("runs_as"),
            cell.get("host_ms"))
    return CostCurve(data, cells)


def load_cost_curve(path: str | Path) -> CostCurve:
    """Read and validate a cost-curve file.

    Raises:
        OSError: it cannot be read.
        CostCurveError: it is not JSON, or breaks the schema.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CostCurveError([f"{path}: not JSON ({exc})"]) from exc
    return parse_cost_curve(data)
