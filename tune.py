"""Find the server settings that serve this machine best: every trial a real server.py on the
real model under real load, every answer checked, the winner given as a command line and as a
settings file for ``server.py --config FILE``.

    python tune.py --model_dir saved_models/qa --out tuned.toml     # about 10 minutes
    python tune.py --p99_ms 500 --clients 64 --budget_s 1200
    python tune.py --rate 40 --p99_ms 300        # open loop: the lowest p99 at 40 requests/s
    python tune.py --budget_s 120 -- --inference_engine_type pytorch   # fix flags after --

The objective: the most requests/s with p99 at most --p99_ms at --clients clients (closed
loop), or the lowest p99 at --rate requests/s (open loop). The model alone is measured first:
its ceiling, its answer to each request of the mix, which every reply must match, and how long
a request alone takes. Where --p99_ms or --clients is not given, it is derived from those, so
that the model can meet it on this machine (tuning/choice.py), and said. Then successive
halving: every candidate briefly, the best third three times as long, and so on, within
--budget_s. Flags after ``--`` go to every trial's server as they are and are not searched.
See docs/tuning.md.
"""

from __future__ import annotations

import argparse
import math
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from bench.mix import DEFAULT_DATA
from bench.servers import ROOT
from dispatch.registry import setting_registry
from settings.cli import HelpFormatter
from tuning.choice import Asked, Chosen
from tuning.model_alone import ModelAlone
from tuning.objective import Objective, answered_all
from tuning.progress import Progress
from tuning.report import (
    command_line,
    plot_trials,
    server_words,
    settings_file,
    trial_record,
    trials_table,
    verdict,
    write_json,
)
from tuning.search import BudgetTooSmall
from tuning.setup import SetupError, plan_from
from tuning.trial import Trial
from tuning.tuner import Outcome, Plan, tune


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (the server's fixed flags come after ``--``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter,
                                usage="%(prog)s [options] [-- SERVER FLAGS...]")
    p.add_argument("--model_dir", default="saved_models",
                   help="a model folder or a repository, as server.py's")
    p.add_argument("--model", help="the repository's model to tune for (default: its only "
                                   "model, else the one named qa); the server serves them all")
    p.add_argument("--p99_ms", type=float,
                   help="the objective's p99 bound (default: derived from the model alone, "
                        "measured first, so that it can be met here; docs/tuning.md)")
    p.add_argument("--clients", type=int,
                   help="closed loop: clients at once (default: derived from the model alone); "
                        "open loop: connections (default: 32)")
    p.add_argument("--rate", type=float,
                   help="open loop: the lowest p99 at this many requests/s (Poisson arrivals)")
    p.add_argument("--data", help="the request mix: JSON lines of {question, context} (or "
                                  "{text}) objects (default: bench/data/qa_pairs.jsonl)")
    p.add_argument("--budget_s", type=float, default=600.0,
                   help="seconds the whole run may take, the model alone included")
    p.add_argument("--search", choices=("halving", "grid"), default="halving",
                   help="halving: successive halving within the budget; grid: every candidate "
                        "for --trial_s seconds each, whatever the budget (to measure the "
                        "halving against)")
    p.add_argument("--trial_s", type=float, default=60.0, help="--search grid: seconds of load "
                                                                "per trial")
    p.add_argument("--out", help="write the winner's settings here (TOML for server.py "
                                 "--config)")
    p.add_argument("--json", help="write every figure of every trial here")
    p.add_argument("--plot", help="draw requests/s against p99 of every trial to this PNG")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(tune.py's options, the server flags after ``--``), checked."""
    ours, fixed = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = build_parser()
    args = p.parse_args(ours)
    for name in ("p99_ms", "clients", "budget_s", "trial_s", "rate"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"--{name} must be a positive number")
    return args, fixed


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 when the winner meets the objective, 1 when nothing does (said, with
    by how much), 2 on a usage error, a model that cannot run, a first trial that fails or a
    budget too small for one trial, 130 when interrupted (SIGINT or SIGTERM)."""
    args, fixed = parse_args(sys.argv[1:] if argv is None else argv)
    asked = Asked(args.p99_ms, args.clients, args.rate)
    try:
        plan = plan_from(args, fixed, asked, setting_registry())
    except SetupError as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 2
    print(f"tune: {plan.server.model_dir} on {plan.server.engine}, {plan.machine_words}; "
          f"objective: {asked.describe()}; {len(plan.candidates)} candidates; budget "
          f"{args.budget_s:g} s", flush=True)
    seen: dict[str, Any] = {"trials": []}
    was = signal.signal(signal.SIGTERM, _interrupt)  # a trial's server is stopped either way
    try:
        outcome = _run(plan, args, seen)
    except (BudgetTooSmall, RuntimeError) as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if seen["trials"] and "model" in seen:
            print(trials_table(seen["trials"], seen["model"].ceiling_rps,
                               seen["chosen"].objective))
        print("tune: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, was)
    return _report(outcome, plan, args, fixed)


def _interrupt(signum: int, _frame: Any) -> None:
    """SIGTERM as Ctrl+C: the trial running stops its server, and the trials so far are
    printed."""
    raise KeyboardInterrupt


def _run(plan: Plan, args: argparse.Namespace, seen: dict[str, Any]) -> Outcome:
    """Tune, with a progress bar; the model alone and each trial go into ``seen`` as they
    come."""
    with Progress(args.budget_s, not args.no_progress) as progress:
        def on_model(model: ModelAlone, chosen: Chosen) -> None:
            seen["model"], seen["chosen"] = model, chosen
            objective = chosen.objective
            progress.say(f"the model alone: {model.ceiling_rps:.1f} req/s; objective: p99 <= "
                         f"{objective.p99_ms:g} ms")

        def on_trial(trial: Trial) -> None:
            seen["trials"].append(trial)
            rps = (trial.figures or {}).get("throughput_rps", 0.0)
            progress.say(f"trial {trial.number} (rung {trial.rung}): {rps:.1f} req/s")

        return tune(plan, on_trial=on_trial, on_model=on_model)


def _report(outcome: Outcome, plan: Plan, args: argparse.Namespace, fixed: list[str]) -> int:
    """Print the objective, the trials and the winner, write the files asked for; the exit
    status."""
    model, winner, objective = outcome.model, outcome.winner, outcome.chosen.objective
    print(f"\nthe model alone: {model.describe()}")
    print("\n".join(outcome.chosen.why))
    print(trials_table(outcome.trials, model.ceiling_rps, objective))
    for note in outcome.notes:
        print(f"note: {note}")
    budget = "(a grid: the budget does not apply)" if plan.grid_load_s else \
        f"of the {args.budget_s:g} s budget"
    print(f"took {outcome.seconds:.0f} s {budget}, {len(outcome.trials)} trials")
    status = 0
    if winner is None or not answered_all(winner.figures):
        print("no trial answered every request correctly: nothing to recommend")
        _write_files(outcome, plan, args, objective, recommend=False)
        return 1
    figures = winner.figures
    rps = figures["throughput_rps"]
    print(f"\nwinner: trial {winner.number}: "
          f"{winner.candidate.label() or 'the flags after -- alone'}\n"
          f"  {rps:.1f} req/s ({rps / model.ceiling_rps:.2f} of the model alone), "
          f"p50 {figures['p50_ms']:.0f} ms, p99 {figures['p99_ms']:.0f} ms, "
          f"{verdict(winner, objective)}")
    if not objective.meets(figures):
        status = 1
        print(f"nothing meets the objective ({objective.describe()}): the best is trial "
              f"{winner.number}, and {objective.shortfall(figures)}")
    print(f"\n  {command_line(args.model_dir, fixed, winner.candidate, _server_words())}")
    _write_files(outcome, plan, args, objective, recommend=True)
    return status


def _write_files(outcome: Outcome, plan: Plan, args: argparse.Namespace,
                 objective: Objective, recommend: bool) -> None:
    """--out (where there is a winner to ``recommend``), --json and --plot."""
    winner = outcome.winner
    if args.out and recommend and winner is not None and winner.figures is not None:
        use = shlex.join([*_server_words(), "--config", args.out])
        header = [f"qa-tune's winner for {args.model_dir}", *outcome.chosen.why,
                  f"measured {winner.figures['throughput_rps']:.1f} req/s, p99 "
                  f"{winner.figures['p99_ms']:.0f} ms ({verdict(winner, objective)})",
                  f"use: {use} (flags given there win)"]
        Path(args.out).write_text(settings_file(plan.fixed_settings, winner.candidate, header),
                                  encoding="utf-8")
        print(f"wrote the winner's settings to {Path(args.out).resolve()} "
              f"({use})")
    if args.json:
        document: dict[str, Any] = {
            "tool": "tune.py", "objective": vars(objective),
            "objective_derived": list(outcome.chosen.derived),
            "objective_why": list(outcome.chosen.why), "budget_s": args.budget_s,
            "seconds": outcome.seconds, "data": str(args.data or DEFAULT_DATA),
            "model_alone": {k: v for k, v in vars(outcome.model).items() if k != "expected"},
            "candidates": [dict(c.settings) for c in plan.candidates],
            "winner": winner.number if recommend and winner else None, "notes": outcome.notes,
            "trials": [trial_record(t, objective) for t in outcome.trials]}
        write_json(args.json, document)
        print(f"wrote every figure to {Path(args.json).resolve()}")
    if args.plot:
        plot_trials(args.plot, outcome.trials, objective, winner if recommend else None,
                    f"qa-tune: {args.model_dir}, {plan.machine_words}; {objective.describe()}")
        print(f"wrote the plot to {Path(args.plot).resolve()}")


def _server_words() -> list[str]:
    """The server as the user starts it from here: this interpreter, and the server.py the
    trials ran, each relative to the current folder where it is under it."""
    return server_words(sys.executable, ROOT / "server.py", Path.cwd())


if __name__ == "__main__":
    sys.exit(main())
