"""A stop asked while server.py starts (Ctrl+C, SIGTERM): the start-up stops, nothing serves,
the process exits at once (0; 1 for a second signal), no process prints a traceback, and no
worker process is left. Real processes and a tiny real model. The PyTorch engine holds the
start-up open while the signal arrives: its session threads import torch and trace the model
(seconds), where the ONNX engine loads the tiny model in a fraction of a second."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from broker.local_server import RedisServer
from tests.test_server_process import read_log_until, spawn_server

#: Seconds a stopped start-up may take to exit, on a busy 2-core machine: generous.
EXIT_S = 20
#: Keeps the start-up loading while the test signals it (see the module's docstring).
SLOW_START = ("--inference_engine_type", "pytorch", "--num_inference_sessions", "2",
              "--threads_per_session", "1")


def children_of(pid: int) -> set[int]:
    """The processes ``pid`` has started and not yet reaped (Linux: /proc)."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found.update(int(child) for child in listing.read().split())
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
    return found


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for_workers(proc: subprocess.Popen[str], count: int) -> set[int]:
    """The worker processes of ``proc``, once it has started ``count`` of them."""
    deadline = time.monotonic() + 60
    while len(workers := children_of(proc.pid)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, "no worker processes"
        time.sleep(0.01)
    return workers


def finish(proc: subprocess.Popen[str], lines: list[str]) -> tuple[int, str]:
    """Its exit status, within EXIT_S, and its whole log (every process writing to it closed
    it: the workers too)."""
    try:
        rest = proc.communicate(timeout=EXIT_S)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("still running: " + "".join(lines)) from None
    return proc.returncode, "".join(lines) + rest


def assert_stopped_before_serving(log: str) -> None:
    assert "stopping (again to force)" in log, log  # the signal was handled
    assert "serving on" not in log, log  # nor a worker process's "serving on cpu"
    assert "Traceback" not in log, log


def assert_all_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + EXIT_S
    while left := [pid for pid in pids if not gone(pid)]:
        assert time.monotonic() < deadline, f"worker processes left: {left}"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_sessions_load_stops_the_start_up_and_exits_zero(
        tiny_model_dir: Path, signum: int) -> None:
    proc = spawn_server("--model_dir", str(tiny_model_dir), *SLOW_START)
    lines: list[str] = []
    read_log_until(proc, lines, "accepting once loaded")
    proc.send_signal(signum)
    status, log = finish(proc, lines)
    assert status == 0, log
    assert f"{signal.Signals(signum).name}: stopping" in log
    assert_stopped_before_serving(log)
    assert "stopped during start-up, before serving" in log


def two_workers_loading(model_dir: Path) -> tuple[subprocess.Popen[str], list[str], set[int]]:
    """A server whose 2 worker processes are loading: (process, its log so far, worker pids)."""
    proc = spawn_server("--model_dir", str(model_dir), "--workers", "2", *SLOW_START)
    lines: list[str] = []
    read_log_until(proc, lines, "accepting once loaded")
    return proc, lines, wait_for_workers(proc, 2)


def test_ctrl_c_while_worker_processes_load_stops_them_all_at_once(tiny_model_dir: Path) -> None:
    proc, lines, workers = two_workers_loading(tiny_model_dir)
    proc.send_signal(signal.SIGINT)
    status, log = finish(proc, lines)
    assert status == 0, log
    assert_stopped_before_serving(log)
    assert "stopped during start-up, before serving" in log
    assert_all_gone(workers)


def test_a_second_ctrl_c_during_start_up_leaves_no_worker_and_no_traceback(
        tiny_model_dir: Path) -> None:
    proc, lines, workers = two_workers_loading(tiny_model_dir)
    proc.send_signal(signal.SIGINT)
    read_log_until(proc, lines, r"stopping \(again to force\)")
    proc.send_signal(signal.SIGINT)
    status, log = finish(proc, lines)
    # 1: forced; 0: the first stop had already ended the start-up (it takes a fraction of a
    # second) when the second signal came
    assert status in (0, 1), log
    assert_stopped_before_serving(log)
    assert_all_gone(workers)


def test_workers_loading_when_the_front_end_dies_exit_at_once_without_a_traceback(
        tiny_model_dir: Path) -> None:
    # What a second Ctrl+C did to them: the front end gone (os._exit), they went on loading
    # for seconds, then each printed a BrokenPipeError traceback sending "ready".
    proc, lines, workers = two_workers_loading(tiny_model_dir)
    proc.kill()
    status, log = finish(proc, lines)  # the log ends once the workers closed it too
    assert status == -signal.SIGKILL
    assert "Traceback" not in log, log
    assert_all_gone(workers)


def test_a_broker_worker_stopped_while_loading_exits_zero_having_taken_nothing(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    broker = RedisServer(tmp_path)
    broker.start()
    try:
        proc = spawn_server("--role", "worker", "--broker", broker.url,
                            "--model_dir", str(tiny_model_dir), *SLOW_START)
        lines: list[str] = []
        read_log_until(proc, lines, "layout: ")  # logged once the handlers are set
        proc.send_signal(signal.SIGINT)
        status, log = finish(proc, lines)
        assert status == 0, log
        assert "stopped during start-up, before serving" in log
        assert "warmed up; serving" not in log and "serving: work" not in log, log
        assert "Traceback" not in log, log
        assert broker.client().smembers("qa:workers") == set()  # never announced itself
    finally:
        broker.stop()


def feed_fifo(path: Path, text: str) -> None:
    """Write ``text`` to the FIFO at ``path`` once a reader has opened it, then close it."""
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            assert time.monotonic() < deadline, "nobody opened the FIFO"
            time.sleep(0.01)
    with os.fdopen(fd, "w") as fifo:
        fifo.write(text)


def test_a_broker_front_end_stopped_during_start_up_never_serves(tmp_path: Path,
                                                                 tiny_model_dir: Path) -> None:
    # A front end starts in a fraction of a second. A FIFO as its token file holds its start
    # (the file is read when the flags are checked, then again at start) until the test has
    # signalled it: deterministic.
    tokens = tmp_path / "tokens"
    os.mkfifo(tokens)
    broker = RedisServer(tmp_path)
    broker.start()
    try:
        proc = spawn_server("--broker", broker.url, "--model_dir", str(tiny_model_dir),
                            "--auth_token_file", str(tokens))
        feed_fifo(tokens, "a-token\n")  # the flags' check
        lines: list[str] = []
        read_log_until(proc, lines, "layout: ")  # logged once the handlers are set
        proc.send_signal(signal.SIGINT)
        feed_fifo(tokens, "a-token\n")  # the start's own read: it goes on, told to stop
        status, log = finish(proc, lines)
        assert status == 0, log
        assert_stopped_before_serving(log)
        assert "stopped during start-up, before serving" in log
    finally:
        broker.stop()
