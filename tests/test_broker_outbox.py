"""broker/outbox.py against a real redis-server: who sends a batch's replies, and that none is
lost when Redis is away (the outbox thread is started only where a test needs it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.connect import GROUP, Keys, connect, ensure_group
from broker.local_server import RedisServer
from broker.outbox import ReplyOutbox
from broker.wire import FIELD
from tests.broker_fixtures import running_redis
from tests.helpers import wait_until
from transport.coalesce import coalesced_sends

REPLIES = "qa:replies:test"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path_factory.mktemp("redis-outbox"))


@pytest.fixture()
def work(broker: RedisServer) -> Iterator[tuple[redis.Redis, Keys, list[bytes]]]:
    """A clean work stream holding three entries taken by one consumer, and a reply stream."""
    client, keys = broker.client(), Keys("qa")
    client.flushall()
    ensure_group(client, keys)
    ids = [client.xadd(keys.work, {FIELD: b"w%d" % i}) for i in range(3)]
    client.xreadgroup(GROUP, "tester", {keys.work: ">"}, count=3)
    client.xadd(REPLIES, {"x": b"start"})  # replies are written with NOMKSTREAM
    yield client, keys, ids
    client.close()


def replies(client: redis.Redis) -> list[bytes]:
    return [fields[FIELD] for _, fields in client.xrange(REPLIES) if FIELD in fields]


def answer_batch(outbox: ReplyOutbox, ids: list[bytes]) -> None:
    """What a session does: answer each request of its batch inside coalesced_sends()."""
    with coalesced_sends():
        for n, entry_id in enumerate(ids):
            outbox.put(entry_id, REPLIES, b"reply-%d" % n)


def test_an_idle_sessions_batch_goes_out_on_its_own_thread_in_one_bulk(
        broker: RedisServer, work: tuple[redis.Redis, Keys, list[bytes]]) -> None:
    client, keys, ids = work
    counts: list[int] = []
    outbox = ReplyOutbox(broker.client(), keys, counts.append, idle=lambda: True)
    answer_batch(outbox, ids)  # the outbox thread is not even started
    assert replies(client) == [b"reply-0", b"reply-1", b"reply-2"]
    assert counts == [3]  # one bulk, settled once
    assert client.xpending(keys.work, GROUP)["pending"] == 0  # acknowledged
    assert client.xlen(keys.work) == 0  # and deleted


def test_with_work_waiting_the_outbox_thread_sends_and_the_session_goes_on(
        broker: RedisServer, work: tuple[redis.Redis, Keys, list[bytes]]) -> None:
    client, keys, ids = work
    counts: list[int] = []
    outbox = ReplyOutbox(broker.client(), keys, counts.append, idle=lambda: False)
    answer_batch(outbox, ids)
    assert replies(client) == [] and outbox.backlog == 3  # left for the outbox thread
    outbox.start()
    wait_until(lambda: len(replies(client)) == 3)
    outbox.close(5)
    assert replies(client) == [b"reply-0", b"reply-1", b"reply-2"] and sum(counts) == 3


def test_replies_outside_a_batch_go_through_the_outbox_thread(
        broker: RedisServer, work: tuple[redis.Redis, Keys, list[bytes]]) -> None:
    client, keys, ids = work
    counts: list[int] = []
    outbox = ReplyOutbox(broker.client(), keys, counts.append, idle=lambda: True)
    outbox.put(ids[0], REPLIES, b"expired")  # the reader settling an expired entry
    outbox.put(ids[1], None, None)  # an unreadable one: settled without a reply
    assert replies(client) == [] and outbox.backlog == 2
    outbox.start()
    wait_until(lambda: sum(counts) == 2)
    outbox.close(5)
    assert replies(client) == [b"expired"]
    assert client.xpending(keys.work, GROUP)["pending"] == 1  # only ids[2] still held


def test_a_batch_that_cannot_be_sent_inline_is_kept_and_sent_once_redis_is_back(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # not started yet: its port refuses connections
    counts: list[int] = []
    outbox = ReplyOutbox(connect(server.url), Keys("qa"), counts.append, idle=lambda: True)
    sent = threading.Thread(target=answer_batch, args=(outbox, [b"1-0", b"2-0"]))
    sent.start()
    sent.join(30)  # one failed try, never the outbox thread's retries
    assert not sent.is_alive() and counts == [] and outbox.backlog == 2
    server.start()
    try:
        client = server.client()
        client.xadd(REPLIES, {"x": b"start"})
        outbox.start()  # it retries until Redis answers
        wait_until(lambda: sum(counts) == 2, 30)
        outbox.close(5)
        assert replies(client) == [b"reply-0", b"reply-1"]
    finally:
        server.stop()
