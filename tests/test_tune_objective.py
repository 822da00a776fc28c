"""The tuner's objective where the user gives none (tuning/choice.py), on plain numbers: the
clients that keep the model near its ceiling, a p99 bound an ideal server meets with headroom,
the parts the user gives kept as given, and the lines that say why; and the winner's command
line, which names the interpreter the tuner ran with (tuning/report.py)."""

from __future__ import annotations

import math

import pytest

from tuning.choice import (
    HEADROOM,
    OPEN_LOOP_CONNECTIONS,
    SERVER_MS,
    Asked,
    choose_objective,
    clients_for,
    closed_loop_p99_ms,
    in_flight,
    open_loop_p99_ms,
    queue_ms,
    round_up,
    wait_p99_ms,
)
from tuning.objective import Objective
from tuning.report import command_line, server_words, shown_path
from tuning.space import Candidate

#: The README's 2-core machine, MiniLM QA: requests/s by requests in flight (batch 1 on both
#: cores, batches of 4 and 16, two one-thread engines at once), and a request's p99 alone.
TWO_CORES = {"ceiling_rps": 19.3, "alone_p99_ms": 170.4,
             "rates": {1: 15.0, 4: 17.5, 16: 18.0, 2: 19.3}, "engines": 2}
#: A GPU: batches of 1, 8, 32 and 64.
GPU = {"ceiling_rps": 1234.5, "alone_p99_ms": 12.3,
       "rates": {1: 300.0, 8: 900.0, 32: 1200.0, 64: 1234.5}, "engines": 1}


def test_the_requests_in_flight_are_the_fewest_near_the_ceiling_one_per_engine_at_least() -> None:
    assert in_flight({1: 15.0, 4: 17.5, 16: 18.0}, 18.0) == 4  # 17.5 is within 10% of 18
    assert in_flight({1: 17.0, 4: 17.5, 16: 18.0}, 18.0) == 1
    assert in_flight({1: 15.0, 4: 17.5, 16: 18.0, 2: 19.3}, 19.3, engines=2) == 2
    assert in_flight({1: 17.0, 2: 18.0}, 18.0, engines=2) == 2  # a core each at least
    assert in_flight(GPU["rates"], 1234.5) == 32
    with pytest.raises(ValueError):
        in_flight({}, 10.0)
    assert clients_for(2) == 4 and clients_for(32) == 64


def test_the_bound_is_an_ideal_server_s_worst_case_with_headroom_rounded_up() -> None:
    assert queue_ms(4, 20.0) == pytest.approx(150.0)  # 3 ahead at 20 req/s
    assert queue_ms(1, 20.0) == 0.0
    assert closed_loop_p99_ms(170.4, 4, 19.3) == 1100.0  # 3 x (170.4 + 155.4) + 50 = 1027.5
    ideal = 170.4 + queue_ms(4, 19.3)
    assert closed_loop_p99_ms(170.4, 4, 19.3) >= HEADROOM * ideal + SERVER_MS
    assert [round_up(v) for v in (656.0, 2754.0, 45.3, 660.0, 5.31, 0.0)] == \
        [660.0, 2800.0, 46.0, 660.0, 5.4, 0.0]


def test_the_open_loop_bound_adds_a_queue_s_p99_wait_at_the_rate() -> None:
    assert wait_p99_ms(10.0, 20.0) == pytest.approx(1000 * math.log(50) / 10)  # load 0.5
    assert wait_p99_ms(0.1, 20.0) == 0.0  # under 1% load: 99% never wait
    assert wait_p99_ms(40.0, 20.0) == wait_p99_ms(18.0, 20.0)  # the load capped at 0.9
    assert open_loop_p99_ms(170.4, 10.0, 19.3) == \
        round_up(HEADROOM * (170.4 + wait_p99_ms(10.0, 19.3)) + SERVER_MS)


def test_with_nothing_given_the_objective_is_derived_and_said_in_two_short_lines() -> None:
    chosen = choose_objective(Asked(), **TWO_CORES)
    assert chosen.objective == Objective(1100.0, 4)  # not 200 ms at 32 clients: out of reach
    assert chosen.derived == ("clients", "p99_ms")
    first, second = chosen.why
    assert first.startswith("objective: the most requests/s at 4 clients, 2 x the 2 in flight")
    assert "19.3 req/s ceiling" in first
    assert second == "  with p99 at most 1100 ms: 3 x (its p99 alone, 170 ms, + 3 requests " \
                     "ahead at 19.3 req/s, 155 ms) + 50 ms"
    gpu = choose_objective(Asked(), **GPU)
    assert gpu.objective == Objective(240.0, 64)  # 3 x (12.3 + 51.0) + 50 = 240.0
    for lines in (chosen.why, gpu.why):
        assert all(len(line) <= 120 for line in lines), lines


def test_the_parts_given_are_kept_as_given_and_the_rest_derived() -> None:
    as_given = choose_objective(Asked(p99_ms=200.0, clients=32), **TWO_CORES)
    assert as_given.objective == Objective(200.0, 32) and as_given.derived == ()
    assert as_given.why == ("objective (as given): the most requests/s with p99 at most 200 ms "
                            "at 32 clients",)
    clients = choose_objective(Asked(clients=8), **TWO_CORES)
    assert clients.objective == Objective(closed_loop_p99_ms(170.4, 8, 19.3), 8)
    assert clients.derived == ("p99_ms",) and "8 clients (as given)" in clients.why[0]
    bound = choose_objective(Asked(p99_ms=500.0), **TWO_CORES)
    assert bound.objective == Objective(500.0, 4) and bound.derived == ("clients",)
    assert bound.why[1] == "  with p99 at most 500 ms (as given)"


def test_the_open_loop_keeps_its_rate_and_derives_its_bound() -> None:
    chosen = choose_objective(Asked(rate=10.0), **TWO_CORES)
    assert chosen.objective == Objective(open_loop_p99_ms(170.4, 10.0, 19.3),
                                         OPEN_LOOP_CONNECTIONS, 10.0)
    assert chosen.derived == ("p99_ms",) and "0.52 of the model's ceiling" in chosen.why[0]
    over = choose_objective(Asked(rate=40.0), **TWO_CORES)  # more than the model serves
    assert "2.07 of the model's ceiling" in over.why[0] and "load 0.90" in over.why[1]
    given = choose_objective(Asked(p99_ms=300.0, rate=40.0), **TWO_CORES)
    assert given.objective == Objective(300.0, OPEN_LOOP_CONNECTIONS, 40.0)
    assert given.derived == ()
    for lines in (chosen.why, over.why):
        assert all(len(line) <= 120 for line in lines), lines


def test_what_is_asked_is_said_before_the_model_alone_is_measured() -> None:
    assert Asked().describe() == "derived from the model alone"
    assert Asked(clients=8).describe() == "8 clients, the rest derived from the model alone"
    assert Asked(200.0, 32).describe() == \
        "the most requests/s with p99 at most 200 ms at 32 clients"
    assert Asked(200.0, 32).given() == Objective(200.0, 32)
    assert Asked(clients=32).given() is None


def test_the_winner_s_command_line_names_the_interpreter_the_tuner_ran_with() -> None:
    here = "/home/me/qa-server"
    assert server_words(f"{here}/.venv/bin/python", f"{here}/server.py", here) == \
        [".venv/bin/python", "server.py"]
    assert server_words("/usr/bin/python3", f"{here}/server.py", here) == \
        ["/usr/bin/python3", "server.py"]  # not under the current folder: as it is
    assert server_words(f"{here}/python", f"{here}/server.py", here) == \
        ["./python", "server.py"]  # not a bare name PATH would find another for
    assert server_words("", f"{here}/server.py", "/tmp") == ["python", f"{here}/server.py"]
    assert shown_path("/a/b/c", "/a") == "b/c" and shown_path("rel/x", "/a") == "rel/x"
    candidate = Candidate((("workers", 1), ("batching", "off")))
    assert command_line("saved_models", ["--max_seq_len", "256"], candidate,
                        server_words(f"{here}/.venv/bin/python", f"{here}/server.py", here)) == \
        ".venv/bin/python server.py --model_dir saved_models --max_seq_len 256 --workers 1 " \
        "--batching off"
    spaced = server_words("/my env/bin/python", f"{here}/server.py", here)
    assert command_line("m", [], Candidate(()), spaced) == \
        "'/my env/bin/python' server.py --model_dir m"
