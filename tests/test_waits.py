"""scheduling/waits.py: a signal the kernel hands to another thread still reaches the handler
while the main thread waits (the server's SIGTERM on a GPU, docs/operations.md)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from scheduling.waits import SIGNAL_POLL_S, wait_until_set


@pytest.mark.timeout(30)
def test_a_signal_taken_by_another_thread_still_runs_its_handler_in_the_waiting_main_thread(
) -> None:
    assert threading.current_thread() is threading.main_thread()
    stop = threading.Event()
    handled_in: list[str] = []

    def on_signal(_signum: int, _frame: object) -> None:
        handled_in.append(threading.current_thread().name)
        stop.set()

    def signal_myself() -> None:  # as the kernel may: to a thread other than the main one
        time.sleep(0.1)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    sender = threading.Thread(target=signal_myself, name="sender")
    try:
        sender.start()
        started = time.monotonic()
        wait_until_set(stop)
        waited = time.monotonic() - started
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
    assert handled_in == ["MainThread"]
    assert waited < 0.1 + SIGNAL_POLL_S + 5  # woken by a poll, not by some later event


def test_every_slot_restarts_by_one_policy_backing_off_until_one_serves() -> None:
    from scheduling.waits import BACKOFF_S, Restarts

    restarts = Restarts()
    in_a_row = [restarts.next_delay(served=False) for _ in range(len(BACKOFF_S) + 2)]
    assert in_a_row == [*BACKOFF_S, BACKOFF_S[-1], BACKOFF_S[-1]]  # the last value repeats
    assert restarts.next_delay(served=True) == 0.0  # it had served: replaced at once
    assert restarts.next_delay(served=False) == BACKOFF_S[1]  # and backing off afresh
    assert restarts.count == len(BACKOFF_S) + 4 and restarts.failures == 2
