"""--executors on: one executor process per device, fed by every worker process, with real
processes, Unix sockets and the simulated GPU (--inference_engine_type sim)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from protocol import encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection, freeze, wait_until
from tests.test_workers import alive, sigterm_under_load


def executor_config(model_dir: Path, **overrides: object) -> ServerConfig:
    # a slow simulated device (1 x 64 tokens: 16 ms), so that jobs wait for it under load
    settings: dict[str, object] = dict(port=0, model_dir=str(model_dir), workers=2,
                                       executors="on", inference_engine_type="sim",
                                       num_inference_sessions=2, max_batch_size=4,
                                       sim_scale=0.05)
    settings.update(overrides)
    return ServerConfig(**settings)  # type: ignore[arg-type]


def pipelined(address: tuple[str, int], total: int, repeat: int = 1,
              timeout_ms: int | None = None) -> RawConnection:
    conn = RawConnection(address)
    conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * repeat,
                                                   timeout_ms=timeout_ms))
                           for i in range(total)))
    return conn


def test_one_executor_batches_the_rows_of_both_worker_processes(tiny_model_dir: Path) -> None:
    with InferenceServer(executor_config(tiny_model_dir, num_inference_sessions=4)) as srv:
        with Client(*srv.address) as client:
            pid = client.stats(timeout=30)["executors"][0]["pid"]
        # held a moment, so that jobs of both workers wait together (else a slow device's
        # batches can fall into step with the workers, each batch one worker's jobs)
        freeze(pid)
        try:
            conn = pipelined(srv.address, 120)
            time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        replies = conn.recv_replies(120)
        conn.close()
        assert all(reply["ok"] for reply in replies.values())
        with Client(*srv.address) as client:  # figures the executor gave for this query
            while not (stats := client.stats(timeout=30))["executors"][0]["answered_stats"]:
                time.sleep(0.1)
    [executor] = stats["executors"]
    assert executor["state"] == "serving" and executor["device"] == "auto"
    assert "sim engine" in executor["description"]
    assert executor["batches"] > 0
    assert executor["shared_batches"] > 0 and executor["most_processes_in_a_batch"] == 2
    assert len({w["pid"] for w in stats["workers"]}) == 2
    for worker in stats["workers"]:  # its jobs' time at the executor, in three parts
        link = worker["executor_link"]
        assert set(link) == {"queued", "run", "hop"}
        assert link["hop"]["count"] == link["run"]["count"] > 0
        assert link["run"]["p50_ms"] > 0
    assert "in the executor of auto" in stats["engine"]["description"]


def killed_under_load(srv: InferenceServer, pid: int, total: int) -> dict[int, Any]:
    """Every reply (each once, or recv_replies fails) to ``total`` pipelined requests, with
    process ``pid`` killed (SIGKILL) once 20 of them are answered."""
    conn = pipelined(srv.address, total)
    wait_until(lambda: srv.stats.snapshot()["requests"].get("qa", {}).get("ok", 0) > 20)
    os.kill(pid, signal.SIGKILL)
    replies = conn.recv_replies(total)  # every one answered: nothing left hanging
    conn.close()
    return replies


def test_an_executor_killed_under_load_fails_only_what_it_held_and_is_restarted(
        tiny_model_dir: Path) -> None:
    with InferenceServer(executor_config(tiny_model_dir)) as srv:
        with Client(*srv.address) as client:
            victim = client.stats(timeout=30)["executors"][0]["pid"]
        replies = killed_under_load(srv, victim, 400)
        codes = {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}
        # typed: lost with the job it held; refused while no executor could be reached
        assert codes <= {"worker_lost", "unavailable"}, codes
        assert "worker_lost" in codes, "it held none: make it slower"

        def restarted() -> bool:
            with Client(*srv.address) as client:
                entry = client.stats(timeout=30)["executors"][0]
            return entry["state"] == "serving" and entry["pid"] != victim

        wait_until(restarted, timeout=60)
        time.sleep(0.2)
        with Client(*srv.address) as client:  # the workers reconnect at their next batch
            for _ in range(5):
                answer = client.call("qa", {"question": QUESTIONS[0], "context": CONTEXTS[0]},
                                     timeout=30)
            stats = client.stats(timeout=30)
        assert set(answer) == {"answer", "score", "start", "end"}
    assert not alive(victim)
    assert stats["events"]["executor_restart"] == 1
    assert stats["executors"][0]["restarts"] == 1
    assert stats["events"]["worker_restart"] == 0  # the workers lived on
    assert stats["in_flight"] == 0


def test_the_default_layout_on_a_gpu_box_drains_every_admitted_request_at_sigterm(
        tiny_model_dir: Path) -> None:
    # no --workers, no --executors: the sim engine's simulated GPU gets the GPU box's layout
    replies, status, log, before = sigterm_under_load(
        ["--model_dir", str(tiny_model_dir), "--inference_engine_type", "sim", "--sim_scale",
         "0.05", "--max_batch_size", "4"], total=150, repeat=1)
    assert "layout: one executor per simulated GPU (cuda:0) and " in log
    assert len(before["executors"]) == 1 and len(before["workers"]) >= 2
    assert before["config"]["num_inference_sessions"] == 4
    assert all(reply["ok"] for reply in replies.values())
    assert status == 0
    assert "all admitted requests answered" in log
    executor = before["executors"][0]["pid"]
    wait_until(lambda: not alive(executor), timeout=10)


def test_two_devices_get_an_executor_each_and_both_serve(tiny_model_dir: Path) -> None:
    config = executor_config(tiny_model_dir, cuda_devices="0,1", metrics_port=0)
    with InferenceServer(config) as srv:
        conn = pipelined(srv.address, 80)
        assert all(reply["ok"] for reply in conn.recv_replies(80).values())
        conn.close()
        with Client(*srv.address) as client:
            stats = client.stats(timeout=30)
        host, port = srv.metrics_address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    executors = {e["device"]: e for e in stats["executors"]}
    assert set(executors) == {"cuda:0", "cuda:1"}
    assert all(e["batches"] > 0 and 0 < e["device_busy"] <= 1 for e in executors.values())
    assert "simulated device 1" in executors["cuda:1"]["description"]
    up = {s.labels["device"]: s.value for f in text_string_to_metric_families(text)
          for s in f.samples if s.name == "qa_server_executor_up"}
    assert up == {"cuda:0": 1.0, "cuda:1": 1.0}


def test_a_stalled_executor_is_passed_over_while_another_device_serves(
        tiny_model_dir: Path) -> None:
    config = executor_config(tiny_model_dir, cuda_devices="0,1")
    with InferenceServer(config) as srv:
        with Client(*srv.address) as client:
            before = client.stats(timeout=30)
        pids = {e["device"]: e["pid"] for e in before["executors"]}
        freeze(pids["cuda:1"])  # a GPU that stops answering (or is swamped)
        try:
            conn = pipelined(srv.address, 80)
            # a job or so per worker waits on the stalled one; the rest go to cuda:0
            served = conn.recv_replies(56)
            assert all(reply["ok"] for reply in served.values())
            with Client(*srv.address) as client:
                during = client.stats(timeout=30)
        finally:
            os.kill(pids["cuda:1"], signal.SIGCONT)
        # the worker on cuda:1 kept serving too, through cuda:0's executor
        ran = {w["device"]: w["batches"] for w in during["workers"]}
        was = {w["device"]: w["batches"] for w in before["workers"]}
        assert ran["cuda:1"] - was["cuda:1"] >= 2, (was, ran)
        rest = conn.recv_replies(80 - len(served))  # the held ones, once it runs again
        conn.close()
        assert not set(rest) & set(served) and all(reply["ok"] for reply in rest.values())


def test_a_dead_executor_s_workers_go_on_through_another_at_once(tiny_model_dir: Path) -> None:
    config = executor_config(tiny_model_dir, cuda_devices="0,1")
    with InferenceServer(config) as srv:
        with Client(*srv.address) as client:
            pids = {e["device"]: e["pid"] for e in client.stats(timeout=30)["executors"]}
        os.kill(pids["cuda:1"], signal.SIGKILL)  # idle: it held no job
        wait_until(lambda: not alive(pids["cuda:1"]))
        conn = pipelined(srv.address, 40)
        replies = conn.recv_replies(40)
        conn.close()
    # each session's connection to it broke; a job that never reached it goes to the other
    assert all(reply["ok"] for reply in replies.values()), \
        {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}


def test_a_stalled_executor_s_jobs_are_answered_once_their_deadline_passes(
        tiny_model_dir: Path) -> None:
    with InferenceServer(executor_config(tiny_model_dir)) as srv:
        with Client(*srv.address) as client:
            pid = client.stats(timeout=30)["executors"][0]["pid"]
        freeze(pid)  # alive, its listener open, answering nothing
        codes = set()
        try:
            for _ in range(2):  # the sessions wait on their connections, then on new ones
                conn = pipelined(srv.address, 6, timeout_ms=300)
                replies = conn.recv_replies(6)  # each session gave up after a grace
                conn.close()
                codes |= {reply["error"]["code"] for reply in replies.values()}
        finally:
            os.kill(pid, signal.SIGCONT)
        assert codes == {"deadline_exceeded"}
        conn = pipelined(srv.address, 40)  # enough for every session: none takes a late answer
        replies = conn.recv_replies(40)
        conn.close()
        assert all(reply["ok"] for reply in replies.values()), replies


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_deadlines_hold_at_a_saturated_device(tiny_model_dir: Path, overlap: str) -> None:
    # device batches of a few rows, and 8 sessions' jobs before the executor
    config = executor_config(tiny_model_dir, sim_scale=0.01, executor_overlap=overlap,
                             num_inference_sessions=4, max_batch_tokens=512)
    with InferenceServer(config) as srv:
        conn = RawConnection(srv.address)
        total = 100
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6],
                                                       timeout_ms=150))
                               for i in range(total)))
        replies = conn.recv_replies(total)  # each answered once, in time or not
        conn.close()
        with Client(*srv.address) as client:
            executor = client.stats(timeout=30)["executors"][0]
    codes = {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}
    assert codes == {"deadline_exceeded"}, codes  # a device this slow cannot serve them all
    assert any(reply["ok"] for reply in replies.values())
    assert executor["overlapping"] is (overlap == "on")
    # a job whose deadline passes in the executor's queue is dropped there, unrun, in either
    # mode: tests/test_executor_loop.py's deadline test (here it depends on timing)


def test_a_worker_killed_under_load_with_executors_loses_no_reply(tiny_model_dir: Path) -> None:
    with InferenceServer(executor_config(tiny_model_dir)) as srv:
        with Client(*srv.address) as client:
            victim = client.stats(timeout=30)["workers"][0]["pid"]
        replies = killed_under_load(srv, victim, 300)  # its jobs on the executor: nowhere
        codes = {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}
        assert codes <= {"worker_lost"}, codes
        wait_until(lambda: srv.ready)
        with Client(*srv.address) as client:
            assert client.answer(QUESTIONS[1], CONTEXTS[1], timeout=30)["answer"]
            stats = client.stats(timeout=30)
    assert stats["events"]["worker_restart"] == 1 and stats["events"]["executor_restart"] == 0
    assert stats["executors"][0]["state"] == "serving"


def test_two_stats_queries_at_once_each_get_their_own_executor_answer(
        tiny_model_dir: Path) -> None:
    import threading

    with InferenceServer(executor_config(tiny_model_dir)) as srv:
        pipelined(srv.address, 40).recv_replies(40)
        answers: dict[int, list[dict[str, Any]]] = {0: [], 1: []}

        def ask(n: int) -> None:
            with Client(*srv.address) as client:
                answers[n] += [client.stats(timeout=30)["executors"][0] for _ in range(8)]

        threads = [threading.Thread(target=ask, args=(n,)) for n in answers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    for mine in answers.values():
        assert len(mine) == 8 and all(e["answered_stats"] for e in mine)
        assert all(e["batches"] >= 10 for e in mine)  # 40 requests, at most 4 rows a batch


def test_stats_answers_go_to_their_own_query_and_a_lost_child_ends_the_wait() -> None:
    import threading

    from workers.stats_answers import StatsAnswers, new_token

    answers, first, second = StatsAnswers(), new_token(), new_token()
    assert first != second
    answers.expect(first)
    answers.expect(second)
    answers.answer(second, {"batches": 2})  # out of order
    answers.answer(first, {"batches": 1})
    answers.answer(new_token(), {"batches": 9})  # a query no one awaits: dropped
    until = time.monotonic() + 5
    assert answers.wait(first, until) == {"batches": 1}
    assert answers.wait(second, until) == {"batches": 2}
    assert answers.last == {"batches": 1}
    third = new_token()
    answers.expect(third)
    threading.Timer(0.2, answers.cancel).start()
    started = time.monotonic()
    assert answers.wait(third, started + 30) is None
    assert time.monotonic() - started < 20  # ended by the cancel, not by its 30 s


def test_an_executor_whose_restart_cannot_load_is_tried_again_until_one_serves(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    with InferenceServer(executor_config(model)) as srv:
        with Client(*srv.address) as client:
            first = client.stats(timeout=30)["executors"][0]["pid"]
        model.rename(tmp_path / "gone")  # the next start finds no model: it fails to load
        os.kill(first, signal.SIGKILL)

        def entry() -> dict[str, Any]:
            with Client(*srv.address) as client:
                return client.stats(timeout=30)["executors"][0]

        wait_until(lambda: entry()["restarts"] >= 2, timeout=60)  # a failed start, tried again
        (tmp_path / "gone").rename(model)
        wait_until(lambda: entry()["state"] == "serving", timeout=60)  # within the back-off
        with Client(*srv.address) as client:
            answer = client.call("qa", {"question": QUESTIONS[0], "context": CONTEXTS[0]},
                                 timeout=30)
    assert set(answer) == {"answer", "score", "start", "end"}
