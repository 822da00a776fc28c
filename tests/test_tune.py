"""tune.py (``qa-tune``): real tuning runs of the tiny model under short budgets (every trial a
real server.py under real load, every reply checked against the model's own answer), its
settings file read back by server.py's parser, a budget too small for one trial, an objective
nothing meets, and the pieces: the plan of rungs, the search space, the ranking, and the
answer check."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import tomllib

import tune
from bench.answers import WRONG_ANSWER, agrees
from bench.mix import load_pairs
from bench.raw import load_raw_task, reference_answers, task_requests
from bench.runs import run_closed_loop
from bench.servers import ROOT, start_server, stop_servers
from bench.tune_vs_grid import compare
from dispatch.registry import setting_registry
from settings.server_config import given_settings, parse_args
from tuning.objective import Objective
from tuning.report import server_words
from tuning.search import BudgetTooSmall, Search, plan, rung_counts, winner
from tuning.space import Candidate, Machine, search_space
from tuning.trial import Load, Server, Trial

#: Flags that leave the tiny model few candidates, so that a short budget searches them all.
FEW = ["--", "--workers", "1", "--threads_per_session", "1"]
#: And the batching modes alone: 4 candidates.
MODES = [*FEW, "--num_inference_sessions", "1"]
#: The winner's server as the tuner names it: this interpreter, the checkout's server.py.
SERVER = shlex.join(server_words(sys.executable, ROOT / "server.py", Path.cwd()))


def run_tune(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = tune.main(["--no_progress", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_tiny_model_s_tuning_ends_with_a_winner_the_server_reads(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, record, plot = tmp_path / "tuned.toml", tmp_path / "trials.json", tmp_path / "t.png"
    # room for the model alone (in-process and one process per core), the probe, the first
    # rung and a second on a busy machine (45 s held no second rung beside two CPU hogs)
    budget = 60
    status, text, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s",
                                 str(budget), "--p99_ms", "5000", "--clients", "4", "--out",
                                 str(out), "--json", str(record), "--plot", str(plot), *MODES)
    assert status == 0, text + err
    document = json.loads(record.read_text())
    trials = document["trials"]
    assert [t["rung"] for t in trials][:2] == [-1, 0] and max(t["rung"] for t in trials) >= 1
    for trial in trials:  # every reply of every trial was checked, and each one agreed
        figures = trial["figures"]
        assert figures["requests"] > 0 and figures["ok"] == figures["requests"], trial
        assert trial["verdict"] == "meets"
    assert document["seconds"] <= budget * 1.2  # plans spend 95% of what is left
    winner = next(t for t in trials if t["number"] == document["winner"])
    assert winner["rung"] == max(t["rung"] for t in trials)
    assert plot.stat().st_size > 10_000
    # the winner: a command line, and a file server.py --config reads, its flags winning
    assert f"\n  {SERVER} --model_dir" in text and "--workers 1" in text
    assert f"# use: {SERVER} --config {out} (flags given there win)" in out.read_text()
    settings = tomllib.loads(out.read_text())
    assert settings == {"workers": 1, "num_inference_sessions": 1, "threads_per_session": 1,
                        **winner["settings"]}
    registry = setting_registry()
    read = parse_args(None, ["--config", str(out), "--max_batch_size", "5"], registry=registry)
    assert (read.workers, read.num_inference_sessions) == (1, 1)
    assert read.batching == settings["batching"] and read.max_batch_size == 5
    assert set(settings) <= given_settings(["--config", str(out)], registry)


def test_with_no_objective_given_it_derives_one_from_the_model_alone_and_says_why(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, record = tmp_path / "tuned.toml", tmp_path / "trials.json"
    # the model alone is measured before the one trial: a budget a busy machine fits both in
    status, text, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s", "30",
                                 "--out", str(out), "--json", str(record), *MODES,
                                 "--batching", "off")  # one candidate
    assert record.exists(), text + err
    document = json.loads(record.read_text())
    objective, why = document["objective"], document["objective_why"]
    assert document["objective_derived"] == ["clients", "p99_ms"]
    assert objective["rate"] is None and objective["clients"] >= 2
    assert "objective: derived from the model alone;" in text  # before it is measured
    assert why[0].startswith(f"objective: the most requests/s at {objective['clients']} "
                             "clients, 2 x the ")
    assert why[1].startswith(f"  with p99 at most {objective['p99_ms']:g} ms: 3 x (its p99 alone")
    assert "\n".join(why) in text and all(len(line) <= 120 for line in why)
    assert [f"# {line}" for line in why] == out.read_text().splitlines()[1:3]
    assert status == 0, text + err  # the tiny model meets what it was derived to meet


def test_an_objective_nothing_meets_says_so_and_by_how_much(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    everything = [*FEW, "--num_inference_sessions", "1", "--batching", "off"]  # one candidate
    status, text, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s", "25",
                                 "--p99_ms", "0.01", "--clients", "2", *everything)
    assert status == 1, text + err
    assert "nothing meets the objective (the most requests/s with p99 at most 0.01 ms at 2 " \
           "clients)" in text
    assert "the objective's 0.01 ms" in text and "x the objective" in text
    assert "misses" in text and f"{SERVER} --model_dir" in text  # the closest, still given


def test_the_open_loop_objective_is_the_lowest_p99_at_a_rate(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "open.json"
    # a budget a machine with two busy processes beside it starts a server in (12 s did not),
    # after the model alone in-process and one process per core
    status, text, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s", "25",
                                 "--rate", "40", "--p99_ms", "5000", "--json", str(record),
                                 *MODES, "--batching", "off")  # one candidate
    assert status == 0, text + err
    assert "the lowest p99 at 40 requests/s (open loop), at most 5000 ms" in text
    for trial in json.loads(record.read_text())["trials"]:
        figures = trial["figures"]
        assert figures["settings"]["mode"] == "open" and figures["settings"]["rate"] == 40
        assert figures["ok"] == figures["requests"] > 0  # every reply checked, and right


def test_a_budget_too_small_for_one_trial_is_said_with_what_would_do(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s", "1")
    assert status == 2
    assert "--budget_s 1 is too small for even one trial" in err
    assert "try --budget_s" in err


def test_the_grid_runs_every_candidate_for_the_same_time(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "grid.json"
    status, text, _ = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--search", "grid",
                               "--trial_s", "2", "--p99_ms", "5000", "--clients", "2",
                               "--json", str(record), *FEW, "--num_inference_sessions", "1",
                               "--max_batch_size", "8", "--max_batch_tokens", "4096")
    assert status == 0, text
    trials = json.loads(record.read_text())["trials"]
    assert [t["settings"] for t in trials] == [{"batching": "auto"}, {"batching": "fixed"},
                                               {"batching": "off"}]
    assert {t["load_s"] for t in trials} == {2.0}


def test_server_flags_the_tuner_owns_or_the_server_refuses_are_usage_errors(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flags, words in ((["--port", "9000"], "--port after -- is the tuner's to set"),
                         (["--batching", "sometimes"], "invalid choice"),
                         (["--workers", "0"], "--workers must be at least 1")):
        status, _, err = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--", *flags)
        assert status == 2 and words in err, err


def test_on_a_simulated_gpu_it_searches_layouts_with_executors_and_precision(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "sim.json"
    status, text, _ = run_tune(capsys, "--model_dir", str(tiny_model_dir), "--budget_s", "20",
                               "--p99_ms", "5000", "--clients", "4", "--json", str(record),
                               "--", "--inference_engine_type", "sim", "--batching", "auto",
                               "--length_buckets", "64,128,256,384")
    assert status == 0, text
    document = json.loads(record.read_text())
    candidates = document["candidates"]
    assert {c["precision"] for c in candidates} == {"fp16", "fp32"}
    assert {(c["workers"], c["executors"]) for c in candidates} >= {(2, "on"), (1, "off")}
    assert "answers were not checked: the sim engine answers at random" in document["notes"]
    probe = document["trials"][0]  # the likeliest: workers around one executor per GPU
    assert probe["settings"]["executors"] == "on" and probe["verdict"] == "meets"


def test_a_wrong_answer_is_counted_as_an_error(tiny_model_dir: Path) -> None:
    pairs = load_pairs(None)[:6]
    from engines import load_engine

    task = load_raw_task(tiny_model_dir)
    expected = reference_answers(task, load_engine("onnx", tiny_model_dir, threads=1),
                                 task_requests(task, pairs))
    expected[2] = {**expected[2], "answer": expected[2]["answer"] + " and more",
                   "score": expected[2]["score"] + 0.5}  # not what the model says
    proc, port = start_server("onnx", str(tiny_model_dir), 1, [], timeout_s=120)
    try:
        result = run_closed_loop("127.0.0.1", port, clients=1, requests_per_client=12,
                                 pairs=pairs, progress=False, expected=expected)
    finally:
        stop_servers(proc)
    assert result["errors"] == {WRONG_ANSWER: 2}  # items 2 and 8 of 12: the bad reference's
    assert result["ok"] == 10


def test_answers_agree_within_tolerance_and_ties_count_as_agreeing() -> None:
    answer = {"answer": "Paris", "score": 0.41, "start": 3, "end": 8}
    assert agrees(answer, {**answer, "score": 0.4101, "extra": 1})
    assert agrees(answer, {"answer": "the city", "score": 0.4105, "start": 9, "end": 17})  # tie
    assert not agrees(answer, {"answer": "the city", "score": 0.30, "start": 9, "end": 17})
    assert not agrees(answer, {"answer": "Paris", "score": 0.41})  # a field missing
    assert agrees({"embeddings": [[0.5, -0.25]], "dim": 2},
                  {"embeddings": [[0.5004, -0.2502]], "dim": 2})
    assert not agrees({"embeddings": [[0.5, -0.25]]}, {"embeddings": [[0.25, -0.25]]})
    assert not agrees({"label": "POSITIVE"}, {"label": "NEGATIVE"})
    assert not agrees({"dim": 2}, {"dim": True})
    low = {"answer": "a", "score": 1.0e-4, "start": 0, "end": 1}  # low scores are no tie
    assert not agrees(low, {"answer": "b", "score": 1.5e-4, "start": 2, "end": 3})
    assert agrees(low, {"answer": "b", "score": 1.005e-4, "start": 2, "end": 3})
    label = {"label": "POSITIVE", "score": 0.5, "scores": {"POSITIVE": 0.5, "NEGATIVE": 0.5}}
    assert agrees(label, {"label": "NEGATIVE", "score": 0.501,
                          "scores": {"POSITIVE": 0.499, "NEGATIVE": 0.501}})  # a tie, broken


def test_the_plan_fits_the_budget_and_drops_the_least_likely_candidates_first() -> None:
    assert rung_counts(12) == [12, 4, 2, 1] and rung_counts(1) == [1]
    rungs = plan(12, overhead_s=8.0, budget_s=600.0)
    assert [r.count for r in rungs] == [12, 4, 2, 1]
    assert [round(r.load_s / rungs[0].load_s) for r in rungs] == [1, 3, 9, 27]
    spent = sum(r.count * (8.0 + r.load_s) for r in rungs)
    assert spent == pytest.approx(600.0)
    short = plan(12, overhead_s=8.0, budget_s=120.0)  # not all 12 fit at 3 s of load
    assert short[0].count < 12 and short[0].load_s >= 3.0
    with pytest.raises(BudgetTooSmall):
        plan(12, overhead_s=8.0, budget_s=10.0)


def test_the_space_splits_the_cores_and_leaves_fixed_settings_out() -> None:
    cpu = search_space(Machine(cores=2), {})
    splits = {(c["workers"], c["num_inference_sessions"], c["threads_per_session"])
              for c in map(dict, (c.settings for c in cpu))}
    assert splits == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}  # every core used, none twice
    assert len(cpu) == 12 and dict(cpu[0].settings)["batching"] == "auto"
    fixed = search_space(Machine(cores=2), {"workers": 1, "batching": "off"})
    assert [dict(c.settings) for c in fixed] == [
        {"num_inference_sessions": 1, "threads_per_session": 2},
        {"num_inference_sessions": 2, "threads_per_session": 1}]
    gpu = [dict(c.settings) for c in search_space(Machine(cores=16, gpus=1), {})]
    assert {c["precision"] for c in gpu} == {"fp16", "fp32"}
    assert {c.get("length_buckets") for c in gpu} == {None, "64,128,256,384"}
    assert {(c["workers"], c["executors"]) for c in gpu} >= {(4, "on"), (1, "off"), (2, "off")}
    assert all(c["batching"] != "off" for c in gpu)
    assert search_space(Machine(cores=2), {"workers": 1, "num_inference_sessions": 1,
                                           "threads_per_session": 1, "batching": "off"}) \
        == [Candidate(())]


def test_trials_that_meet_rank_first_then_by_throughput_failures_last_open_loop_by_p99() -> None:
    objective = Objective(p99_ms=100, clients=8)

    def figures(rps: float, p99: float, ok: int = 10) -> dict[str, float]:
        return {"throughput_rps": rps, "p99_ms": p99, "ok": ok, "requests": 10}

    trials = {"fast": figures(50, 90), "faster": figures(80, 99), "late": figures(90, 150),
              "later": figures(95, 300), "wrong": figures(200, 10, ok=9)}
    ranked = sorted(trials, key=lambda name: objective.rank_key(trials[name]))
    assert ranked == ["faster", "fast", "later", "late", "wrong"]
    assert objective.rank_key(None) > objective.rank_key(trials["wrong"])
    open_loop = Objective(p99_ms=100, rate=40)
    assert sorted(trials, key=lambda n: open_loop.rank_key(trials[n])) == [
        "fast", "faster", "late", "later", "wrong"]  # the lowest p99 first


def test_the_comparison_with_the_grid_reads_both_runs_by_the_grid_s_own_figures() -> None:
    def trial(number: int, sessions: int, rps: float) -> dict[str, object]:
        return {"number": number, "settings": {"num_inference_sessions": sessions},
                "figures": {"throughput_rps": rps}}

    tuned = {"seconds": 100.0, "winner": 3, "trials": [trial(1, 1, 9.0), trial(2, 2, 11.0),
                                                       trial(3, 2, 12.5)]}
    grid = {"seconds": 400.0, "winner": 2, "trials": [trial(1, 1, 10.0), trial(2, 4, 12.0),
                                                      trial(3, 2, 11.5)]}
    figures = compare(tuned, grid)
    assert figures["of_best"] == pytest.approx(11.5 / 12.0)  # the grid's own figure of it
    assert figures["time_share"] == 0.25 and figures["grid_best"] == {"num_inference_sessions": 4}
    with pytest.raises(ValueError, match="not the same candidates"):
        compare(tuned, {**grid, "trials": grid["trials"][:2]})


def test_the_winner_is_the_best_sound_trial_of_the_highest_round_that_has_one() -> None:
    search = Search(Server("saved_models"), Load(Objective(p99_ms=100, clients=4), [], None),
                    budget_s=60)

    def trial(number: int, rung: int, rps: float, ok: int = 10) -> Trial:
        figures = {"throughput_rps": rps, "p99_ms": 50.0, "ok": ok, "requests": 10}
        return Trial(number, rung, Candidate((("workers", number),)), 3.0, figures=figures)

    search.trials += [trial(1, 0, 9.0), trial(2, 0, 12.0), trial(3, 1, 10.0),
                      trial(4, 1, 11.0), trial(5, 2, 30.0, ok=9)]  # the last round's failed
    assert winner(search).number == 4
    search.trials.append(Trial(6, 3, Candidate(()), 3.0, error="did not start"))
    assert winner(search).number == 4


def test_the_model_alone_is_measured_in_processes_too_and_the_ceiling_is_the_best(
        tiny_model_dir: Path) -> None:
    import os

    from bench.mix import load_mix
    from settings.server_config import ServerConfig
    from tuning.model_alone import measure_model

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no engines or processes at once to measure")
    model = measure_model(tiny_model_dir, "onnx", load_mix("qa")[:16], ServerConfig())
    assert model.parallel is not None and model.processes is not None
    processes, rate = model.processes
    assert processes == min(os.cpu_count() or 1, 8) and rate > 0
    assert model.ceiling_rps == max(*model.per_batch_rps.values(), model.parallel[1], rate)
    assert model.in_flight_rates()[processes * model.best_batch] >= rate
    assert f"{processes} processes at once, batch {model.best_batch}" in model.describe()
