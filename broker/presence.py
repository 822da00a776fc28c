"""A worker's presence in Redis: the heartbeat that announces it (front ends count it while it
is renewed, broker/monitor.py), and its goodbye."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis

from broker.connect import GROUP, Keys

log = logging.getLogger("worker")

#: Heartbeat period, and how long one stays valid.
HEARTBEAT_S = 1.0
HEARTBEAT_TTL_MS = 5000


def announce(client: redis.Redis, keys: Keys, name: str,
             beat: Callable[[], dict[str, Any]]) -> None:
    """Renew worker ``name``'s heartbeat with what ``beat`` says now; never raises (a lost
    broker is the reader's to report)."""
    try:
        pipe = client.pipeline(transaction=False)
        pipe.set(keys.heartbeat(name), json.dumps(beat()), px=HEARTBEAT_TTL_MS)
        pipe.sadd(keys.workers, name)
        pipe.execute()
    except redis.RedisError:
        pass
    except Exception:  # noqa: BLE001 - a bug of ours must not silence the heartbeat
        log.exception("sending the heartbeat failed; going on")


def leave(client: redis.Redis, keys: Keys, name: str, drained: bool) -> None:
    """Remove worker ``name``'s heartbeat; leave the group if it holds nothing (else others
    claim what it holds)."""
    try:
        client.delete(keys.heartbeat(name))
        client.srem(keys.workers, name)
        if drained and not client.xpending_range(keys.work, GROUP, min="-", max="+", count=1,
                                                 consumername=name):
            client.xgroup_delconsumer(keys.work, GROUP, name)
    except redis.RedisError as exc:
        log.warning("could not say goodbye to the broker: %s", exc)
