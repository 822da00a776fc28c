"""server.py as users run it: a real process, its CLI, logs and signal handling."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from client import Client, ConnectionLost
from protocol import ShuttingDown, encode_frame, qa_request
from server import InferenceServer, ServerConfig
from tests.helpers import CONTEXTS, QUESTIONS, RawConnection
from transport import BindError, bind_socket

ROOT = Path(__file__).resolve().parent.parent


def spawn_server(*args: str) -> subprocess.Popen[str]:
    """server.py on a free port, its log on a pipe; not waited for."""
    return subprocess.Popen([sys.executable, "server.py", "--port", "0", *args], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def start_server(*args: str) -> tuple[subprocess.Popen[str], tuple[str, int], list[str]]:
    """Start server.py on a free port; return the process, its address and its log so far."""
    proc = spawn_server(*args)
    lines: list[str] = []
    match = read_log_until(proc, lines, r"serving on ([\d.]+):(\d+)")
    return proc, (match.group(1), int(match.group(2))), lines


def read_log_until(proc: subprocess.Popen[str], lines: list[str], pattern: str,
                   timeout_s: float = 120) -> re.Match[str]:
    """Read the server's log into ``lines`` up to the first line matching ``pattern``."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError("server exited:\n" + "".join(lines))
        lines.append(line)
        if match := re.search(pattern, line):
            return match
    proc.kill()
    raise AssertionError(f"no {pattern!r} in the server's log:\n" + "".join(lines))


def drain_log(proc: subprocess.Popen[str], lines: list[str]) -> threading.Thread:
    """Keep reading the server's log so it never blocks on a full pipe."""
    assert proc.stderr is not None
    thread = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_help_keeps_the_seed_options() -> None:
    out = subprocess.run([sys.executable, "server.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for flag in ("--host", "--port", "--num_inference_sessions", "--inference_engine_type",
                 "--model_dir", "--max_batch_size", "--device"):
        assert flag in out
    assert "{onnx,pytorch,zero,sim}" in out


def test_impossible_limits_are_a_usage_error_naming_the_flags() -> None:
    done = subprocess.run([sys.executable, "server.py", "--max_queue", "0", "--idle_timeout", "-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--max_queue must be at least 1" in done.stderr
    assert "--idle_timeout must not be negative" in done.stderr


def test_missing_model_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "server.py", "--port", "0", "--model_dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "prepare_model.py" in done.stderr and "Traceback" not in done.stderr


def test_missing_model_does_not_log_a_stop_it_never_started(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "server.py", "--port", "0",
                           "--model_dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot start" in done.stderr
    assert "stopped" not in done.stderr and "serving on" not in done.stderr


def test_a_busy_port_fails_before_the_model_is_loaded(tiny_model_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "server.py", "--port", str(port),
                               "--model_dir", str(tiny_model_dir)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "in use" in done.stderr and "--port" in done.stderr  # what, and what to do
    # the order proves the speed: nothing was loaded, nothing said it serves or stopped
    assert "loading" not in done.stderr and "NOT MEANINGFUL" not in done.stderr
    assert "serving" not in done.stderr and "stopped" not in done.stderr  # nor "...; serving"


def test_a_busy_metrics_port_also_fails_before_the_model_is_loaded(tiny_model_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]  # free again once this closes
    with socket.create_server(("127.0.0.1", 0)) as taken:
        config = ServerConfig(port=port, model_dir=str(tiny_model_dir),
                              metrics_port=taken.getsockname()[1])
        server = InferenceServer(config)
        with pytest.raises(BindError, match="--metrics_port"):
            server.start()
    assert server.backend is None  # it failed before loading anything
    bind_socket("127.0.0.1", port).close()  # and released the port it had bound


def test_logs_say_what_serves_where_and_warn_about_meaningless_models(tiny_model_dir: Path) -> None:
    proc, (host, port), lines = start_server("--model_dir", str(tiny_model_dir),
                                             "--num_inference_sessions", "3")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    log = "".join(lines)
    name = tiny_model_dir.name  # one line for the model, not one per session
    assert re.findall(rf"model {name} ready: qa, onnx fp32 on cpu, 3 sessions \(1 engine, "
                      r"\d+ MB\)", log), log
    assert "session-" not in log and "NOT MEANINGFUL" in log
    assert re.search(rf"serving on {host}:{port} and http://{host}:\d+; Ctrl\+C stops", log)
    # a person reads it: a screen's worth of short lines, nothing of GPU runtimes on a CPU
    start_up = log.split("SIGINT")[0].splitlines()
    assert len(start_up) <= 12 and max(map(len, start_up)) <= 125, log
    assert "CUDA" not in log and "TensorRT" not in log and "SCHED_BATCH" not in log


def test_sigterm_under_load_answers_every_admitted_request_and_exits_zero(
        tiny_model_dir: Path) -> None:
    # no deadline, and a drain as long as a busy machine needs: the test is of the stop, and
    # beside a CPU hog the last of 200 long requests may wait more than the default 30 s
    proc, address, lines = start_server("--model_dir", str(tiny_model_dir),
                                        "--num_inference_sessions", "2", "--threads_per_session", "1",
                                        "--request_timeout_ms", "0", "--shutdown_timeout", "300")
    reader = drain_log(proc, lines)
    conns = [RawConnection(address) for _ in range(4)]
    total = 50
    for conn in conns:
        conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 8))
                               for i in range(total)))
    with Client(*address) as observer:  # under load: SIGTERM once every request is admitted
        deadline = time.monotonic() + 60
        while (stats := observer.stats(timeout=30))["admitted"] < 4 * total:
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        assert stats["in_flight"] > 0, "the load finished before the signal; make it heavier"
        proc.send_signal(signal.SIGTERM)
        with pytest.raises((ShuttingDown, ConnectionLost)):  # refused while draining, or closed
            while observer.ping(timeout=30)["ready"]:
                time.sleep(0.005)
            observer.answer(QUESTIONS[0], CONTEXTS[0], timeout=60)
    for conn in conns:
        replies = conn.recv_replies(total)
        failed = [reply for reply in replies.values() if not reply["ok"]]
        assert not failed, failed[:3]  # every admitted one answered
        assert conn.recv_message() is None  # then closed
        conn.close()
    assert proc.wait(timeout=60) == 0
    reader.join(10)
    assert "all admitted requests answered" in "".join(lines)


def test_a_second_signal_while_draining_exits_at_once(tiny_model_dir: Path) -> None:
    proc, address, lines = start_server("--model_dir", str(tiny_model_dir),
                                        "--num_inference_sessions", "1", "--threads_per_session", "1")
    reader = drain_log(proc, lines)
    conn = RawConnection(address)
    total = 1000  # long contexts, several windows each: seconds of work to drain
    conn.send_raw(b"".join(encode_frame(qa_request(i, QUESTIONS[i % 6], CONTEXTS[i % 6] * 30))
                           for i in range(total)))
    with Client(*address) as observer:
        deadline = time.monotonic() + 60
        while observer.stats(timeout=30)["admitted"] < total:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while not any("stopping (again to force)" in line for line in lines):
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # the first is being handled: this one forces the exit
    assert proc.wait(timeout=10) == 1
    reader.join(10)
    log = "".join(lines)
    assert "second SIGINT: exiting now" in log and "stopped (" not in log
    conn.close()


SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def _signal_another_thread(pid: int, signum: int) -> None:
    """tgkill(2): the signal to the process's oldest thread after the main one (one that lives
    as long as the server: a session's, an engine's), as the kernel may choose itself."""
    import ctypes
    import platform

    number = SYS_TGKILL.get(platform.machine())
    if number is None:
        pytest.skip(f"no tgkill number known for {platform.machine()}")
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, "the server runs more than its main thread"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, pid, others[0], signum) == 0, os.strerror(ctypes.get_errno())


def test_sigterm_taken_by_another_thread_still_stops_the_server(tiny_model_dir: Path) -> None:
    # On a GPU the kernel often hands SIGTERM to a CUDA or ONNX Runtime thread; found on an H100,
    # where a server blocked in an untimed wait never stopped. Here: to a session's thread.
    proc, address, lines = start_server("--model_dir", str(tiny_model_dir),
                                        "--num_inference_sessions", "2")
    reader = drain_log(proc, lines)
    try:
        with Client(*address) as client:
            assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)
        _signal_another_thread(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
    reader.join(10)
    assert "SIGTERM: stopping" in "".join(lines)


def test_sigterm_to_another_thread_while_workers_load_stops_the_server(
        tiny_model_dir: Path) -> None:
    # The main thread waits for the workers to load; a signal another thread takes is handled
    # then, and the start-up stops at once (a GPU's start-up, with TensorRT, can take minutes).
    # tests/test_waits.py shows the wait itself lets the handler run.
    proc = spawn_server("--model_dir", str(tiny_model_dir), "--workers", "2")
    lines: list[str] = []
    reader: threading.Thread | None = None
    try:
        read_log_until(proc, lines, "accepting once loaded")
        _signal_another_thread(proc.pid, signal.SIGTERM)
        reader = drain_log(proc, lines)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    if reader is not None:
        reader.join(10)
    log = "".join(lines)
    assert "SIGTERM: stopping" in log
    # handled while loading, not once serving
    assert "serving on" not in log.split("SIGTERM: stopping")[0], log
