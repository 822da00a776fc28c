"""transport/bulk.py: what many threads put goes out in bulks, by one thread, in order."""

from __future__ import annotations

import threading

from tests.helpers import wait_until
from transport.bulk import BulkSender
from transport.coalesce import coalesced_sends


def test_what_is_put_during_a_send_goes_as_the_next_bulk() -> None:
    sent: list[list[int]] = []
    sending, go_on = threading.Event(), threading.Event()

    def send(bulk: list[int]) -> bool:
        sent.append(list(bulk))
        sending.set()
        return go_on.wait(5)

    sender: BulkSender[int] = BulkSender(send, "test-bulk")
    sender.start()
    sender.put(0)
    assert sending.wait(5)
    for item in range(1, 6):  # the first send is under way: these gather
        sender.put(item)
    assert sender.backlog == 5
    go_on.set()
    sender.close(5)
    assert sent == [[0], [1, 2, 3, 4, 5]]


def test_a_claimer_sends_its_own_while_idle_and_what_it_could_not_send_goes_first() -> None:
    sent: list[list[int]] = []
    sender: BulkSender[int] = BulkSender(lambda bulk: sent.append(bulk) is None, "test-bulk")
    sender.start()
    assert sender.claim_idle()
    assert not sender.claim_idle()  # one at a time
    sender.put(9)  # waits for the claim to end
    sender.release([7, 8])
    sender.close(5)
    assert sent == [[7, 8, 9]]
    assert not sender.claim_idle()  # closed


def test_a_peer_gone_ends_the_sending_and_what_comes_later_is_dropped() -> None:
    calls: list[list[int]] = []

    def send(bulk: list[int]) -> bool:
        calls.append(bulk)
        return False

    sender: BulkSender[int] = BulkSender(send, "test-bulk")
    sender.start()
    sender.put(1)
    wait_until(lambda: not sender._thread.is_alive())
    sender.put(2)
    assert sender.backlog == 0 and calls == [[1]]


def test_a_session_s_held_batch_goes_on_its_own_thread_only_while_nothing_waits() -> None:
    senders: list[tuple[str, list[int]]] = []

    def send(bulk: list[int]) -> bool:
        senders.append((threading.current_thread().name, bulk))
        return True

    waiting = [False]
    sender: BulkSender[int] = BulkSender(send, "test-bulk", idle=lambda: not waiting[0])
    sender.start()
    with coalesced_sends():
        sender.put(1)
        sender.put(2)
        assert senders == []  # held until the block ends
    waiting[0] = True  # work waits for the sessions: the sending thread takes it
    with coalesced_sends():
        sender.put(3)
    sender.close(5)
    assert senders == [(threading.current_thread().name, [1, 2]), ("test-bulk", [3])]
