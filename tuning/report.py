"""The tuner's report: the trials table against the ceiling, the winner as a command line and
as a settings file (``server.py --config FILE``), the plot, and every figure as JSON."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.figures import json_safe
from tuning.objective import Objective, answered_all
from tuning.space import Candidate
from tuning.trial import Trial

RUNG_NAMES = {-1: "probe"}


def verdict(trial: Trial, objective: Objective) -> str:
    """Whether the trial meets the objective, in a word or a few."""
    if trial.figures is None:
        return f"failed: {trial.error}"
    figures = trial.figures
    if not answered_all(figures):
        errors = ", ".join(f"{n} {code}" for code, n in sorted(figures["errors"].items()))
        return f"failed: {errors or 'no request answered'}"
    return "meets" if objective.meets(figures) else "misses"


def trials_table(trials: Sequence[Trial], ceiling_rps: float, objective: Objective) -> str:
    """One line per trial: its rung, load, settings and figures against the ceiling."""
    lines = [f"{'#':>3} {'rung':>5} {'load s':>6} {'req/s':>8} {'of ceil':>7} {'p50 ms':>8} "
             f"{'p99 ms':>8} {'batch':>5}  verdict  settings"]
    for t in trials:
        f = t.figures or {}
        rps = f.get("throughput_rps", 0.0)
        batch = (f.get("server") or {}).get("mean_batch_size") or 0.0
        lines.append(f"{t.number:>3} {RUNG_NAMES.get(t.rung, str(t.rung)):>5} "
                     f"{t.load_s:>6.1f} {rps:>8.1f} {rps / ceiling_rps:>7.2f} "
                     f"{f.get('p50_ms', float('nan')):>8.1f} {f.get('p99_ms', float('nan')):>8.1f} "
                     f"{batch:>5.1f}  {verdict(t, objective)}  {t.candidate.label() or '-'}")
    return "\n".join(lines)


def command_line(model_dir: str, fixed: Sequence[str], candidate: Candidate,
                 server: Sequence[str] = ("python", "server.py")) -> str:
    """The winner as a server command line, ``server`` its first words (``server_words``)."""
    words = [*server, "--model_dir", model_dir, *fixed, *candidate.flags()]
    return shlex.join(words)


def server_words(executable: str, script: str | Path, cwd: str | Path) -> list[str]:
    """How to run ``script`` with the interpreter ``executable`` (``sys.executable``) from
    ``cwd``, as a person types it: each path relative where it is under ``cwd``
    (``.venv/bin/python server.py``), else as it is; ``python`` where the interpreter is
    unknown (an empty ``executable``)."""
    python = shown_path(executable, cwd) if executable else "python"
    if Path(executable).is_absolute() and python == Path(python).name:
        python = f"./{python}"  # in cwd itself: not the one a bare name finds on PATH
    return [python, shown_path(script, cwd)]


def shown_path(path: str | Path, cwd: str | Path) -> str:
    """``path`` relative to ``cwd`` where it is under it, else as it is (symbolic links are
    not followed: a virtual environment's interpreter is a link that must stay one)."""
    try:
        return str(Path(path).relative_to(cwd))
    except ValueError:
        return str(path)


def settings_file(fixed: Sequence[tuple[str, Any]], candidate: Candidate,
                  header: Sequence[str]) -> str:
    """The winner as ``server.py --config`` reads it: ``name = value`` lines (the fixed
    settings first, then the searched ones), under ``header`` as comments."""
    lines = [f"# {line}" for line in header]
    lines += [f"{name} = {_toml_value(value)}" for name, value in
              [*fixed, *candidate.settings]]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A TOML scalar: numbers as they are, strings as basic strings (JSON's escapes, which
    TOML's basic strings share; characters beyond ASCII as themselves)."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Every figure of the tuning run; NaN becomes null."""
    Path(path).write_text(json.dumps(json_safe(document), indent=2) + "\n", encoding="utf-8")


def trial_record(trial: Trial, objective: Objective) -> dict[str, Any]:
    """One trial for the JSON file."""
    return {"number": trial.number, "rung": trial.rung, "load_s": trial.load_s,
            "wall_s": trial.wall_s, "start_s": trial.start_s,
            "settings": dict(trial.candidate.settings), "verdict": verdict(trial, objective),
            "figures": trial.figures, "error": trial.error}


def plot_trials(path: str | Path, trials: Sequence[Trial], objective: Objective,
                winner: Trial | None, title: str) -> None:
    """Requests/s against p99 for every trial with figures, one colour per rung, the
    objective's p99 as a vertical line and the winner circled; a PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5.5), layout="constrained")
    axes = figure.add_subplot()
    rungs = sorted({t.rung for t in trials if t.figures})
    for rung in rungs:
        points = [t.figures for t in trials if t.rung == rung and t.figures]
        axes.scatter([f["p99_ms"] for f in points], [f["throughput_rps"] for f in points],
                     label=f"rung {RUNG_NAMES.get(rung, rung)}", alpha=0.8)
    axes.axvline(objective.p99_ms, color="tab:red", linestyle="--",
                 label=f"objective: p99 <= {objective.p99_ms:g} ms")
    if winner is not None and winner.figures:
        axes.scatter([winner.figures["p99_ms"]], [winner.figures["throughput_rps"]], s=240,
                     facecolors="none", edgecolors="black", label="winner")
    p99s = [t.figures["p99_ms"] for t in trials if t.figures] + [objective.p99_ms]
    wide = min(p99s) > 0 and max(p99s) / min(p99s) > 10
    axes.set_xscale("log" if wide else "linear")
    axes.set_xlabel("p99 latency (ms" + (", log scale)" if wide else ")"))
    axes.set_ylabel("requests/s")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
