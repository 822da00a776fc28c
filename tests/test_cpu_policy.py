"""--cpu_scheduling: the CPU scheduling policy of the serving processes, read back from Linux."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from client import Client
from tests.helpers import CONTEXTS, QUESTIONS
from tests.test_server_process import drain_log, start_server
from workers.cpu_policy import CPU_POLICIES, apply_cpu_scheduling

ROOT = Path(__file__).resolve().parent.parent

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux policies")


def thread_policies(pid: int) -> list[int]:
    """The scheduling policy of each thread of process ``pid`` (threads that end meanwhile are
    left out)."""
    policies = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.append(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:
            continue
    return policies


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (policies are per process: not this one's)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@linux_only
@pytest.mark.parametrize("policy", CPU_POLICIES)
def test_every_thread_running_or_started_later_gets_the_policy(policy: str) -> None:
    out = run_python(f"""
        import os, threading
        from tests.test_cpu_policy import thread_policies
        from workers.cpu_policy import apply_cpu_scheduling
        stop = threading.Event()
        before = threading.Thread(target=stop.wait, daemon=True)
        before.start()
        print(apply_cpu_scheduling({policy!r}))
        seen = []
        after = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        after.start(); after.join()
        names = {{os.SCHED_BATCH: "batch", os.SCHED_OTHER: "normal"}}
        print(sorted({{names.get(p, p) for p in thread_policies(os.getpid())}}), names[seen[0]])
        stop.set()
    """)
    assert out.split("\n")[:2] == [policy, f"['{policy}'] {policy}"]


@linux_only
def test_a_thread_under_the_operators_own_policy_keeps_it() -> None:
    out = run_python("""
        import os, threading
        from workers.cpu_policy import apply_cpu_scheduling
        ready, stop = threading.Event(), threading.Event()
        tid = []
        def idle():
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            tid.append(threading.get_native_id()); ready.set(); stop.wait()
        thread = threading.Thread(target=idle, daemon=True)
        thread.start(); ready.wait()
        print(apply_cpu_scheduling("batch"))
        print(os.sched_getscheduler(tid[0]) == os.SCHED_IDLE,
              os.sched_getscheduler(0) == os.SCHED_BATCH)
        stop.set()
    """)
    said, kept = out.strip().split("\n")
    assert said.startswith("batch (1 thread(s) under the operator's own policy")
    assert kept == "True True"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="batch"):
        apply_cpu_scheduling("fifo")


def test_the_flag_refuses_an_unknown_policy() -> None:
    done = subprocess.run([sys.executable, "server.py", "--cpu_scheduling", "fifo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--cpu_scheduling" in done.stderr


@linux_only
@pytest.mark.parametrize(("flags", "policy"), [((), "batch"),
                                               (("--cpu_scheduling", "normal"), "normal")])
def test_server_py_and_its_worker_processes_run_under_the_policy(
        tiny_model_dir: Path, flags: tuple[str, ...], policy: str) -> None:
    proc, address, lines = start_server("--model_dir", str(tiny_model_dir), "--workers", "2",
                                        "--num_inference_sessions", "1", "--log_level",
                                        "DEBUG", *flags)
    reader = drain_log(proc, lines)
    try:
        with Client(*address) as client:
            assert client.answer(QUESTIONS[0], CONTEXTS[0], timeout=30)["answer"]
            workers = [w["pid"] for w in client.stats(timeout=30)["workers"]]
        expected = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
        for pid in [proc.pid, *workers]:  # every thread, the engines' own pools included
            assert set(thread_policies(pid)) == {expected}, pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(10)
    meaning = {"batch": "SCHED_BATCH for every thread (one that wakes on a busy core waits",
               "normal": "SCHED_OTHER, the kernel's default"}[policy]
    assert f"CPU scheduling: {policy} = {meaning}" in "".join(lines)  # in words, at DEBUG
