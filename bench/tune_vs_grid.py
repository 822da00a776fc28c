"""The tuner against the exhaustive grid: reads the JSON of a ``tune.py`` run and of a
``tune.py --search grid`` run over the same candidates, and prints how close the tuner's winner
comes to the grid's best, by the grid's own figures, and in what share of the grid's time.

    python tune.py --model_dir saved_models/qa --json tune.json
    python tune.py --model_dir saved_models/qa --search grid --trial_s S --json grid.json
    python bench/tune_vs_grid.py tune.json grid.json

S is the tuner's longest trial (its winner's), so that the grid measures every candidate as
long as the tuner measured its winner.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def compare(tuned: dict[str, Any], grid: dict[str, Any]) -> dict[str, Any]:
    """The comparison's figures: each side's winner, the grid's figure for the tuner's winner
    against the grid's best (``of_best``), and the tuner's time against the grid's
    (``time_share``)."""
    if tuned["winner"] is None or grid["winner"] is None:
        raise ValueError("a run without a winner (no trial answered every request): nothing "
                         "to compare")
    winner = _trial(tuned, tuned["winner"])
    best = _trial(grid, grid["winner"])
    same = [t for t in grid["trials"] if t["settings"] == winner["settings"]]
    if not same:
        raise ValueError("the grid has no trial of the tuner's winner: not the same candidates")
    if same[0]["figures"] is None or best["figures"] is None:
        raise ValueError("the grid's trial of the tuner's winner, or its best, has no figures "
                         "(its server failed): nothing to compare")
    measured = same[0]["figures"]["throughput_rps"]
    best_rps = best["figures"]["throughput_rps"]
    return {"tuner_s": tuned["seconds"], "grid_s": grid["seconds"],
            "time_share": tuned["seconds"] / grid["seconds"],
            "tuner_trials": len(tuned["trials"]), "grid_trials": len(grid["trials"]),
            "tuner_winner": winner["settings"], "grid_best": best["settings"],
            "winner_rps_in_tuner": winner["figures"]["throughput_rps"],
            "winner_rps_in_grid": measured, "grid_best_rps": best_rps,
            "of_best": measured / best_rps,
            "grid_rps": sorted((t["figures"] or {}).get("throughput_rps", 0.0)
                               for t in grid["trials"])}


def _trial(document: dict[str, Any], number: int) -> dict[str, Any]:
    return next(t for t in document["trials"] if t["number"] == number)


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; 0 when the tuner's winner is within 5% of the grid's best in at
    most a third of its time (issue 35's target), else 1."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tune_json")
    p.add_argument("grid_json")
    args = p.parse_args(argv)
    figures = compare(*(json.loads(Path(f).read_text()) for f in (args.tune_json,
                                                                  args.grid_json)))
    print(f"tuner: {figures['tuner_trials']} trials in {figures['tuner_s']:.0f} s; winner "
          f"{figures['tuner_winner']}: {figures['winner_rps_in_tuner']:.2f} req/s there, "
          f"{figures['winner_rps_in_grid']:.2f} in the grid")
    print(f"grid: {figures['grid_trials']} trials in {figures['grid_s']:.0f} s; best "
          f"{figures['grid_best']}: {figures['grid_best_rps']:.2f} req/s")
    print(f"the tuner's winner is {figures['of_best']:.3f} of the grid's best, in "
          f"{figures['time_share']:.2f} of the grid's time")
    print("every grid trial, req/s: " + ", ".join(f"{r:.2f}" for r in figures["grid_rps"]))
    return 0 if figures["of_best"] >= 0.95 and figures["time_share"] <= 1 / 3 else 1


if __name__ == "__main__":
    sys.exit(main())
