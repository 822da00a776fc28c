"""Connecting to Redis, the names of everything the server keeps there, and the one script.

``--broker`` is a redis-py URL: ``redis://[[USER]:PASSWORD@]HOST:PORT/DB`` for plain TCP,
``rediss://...`` for TLS (``?ssl_ca_certs=/path/ca.pem`` and the other ``ssl_*`` query options
of redis-py choose certificates), ``unix:///path/redis.sock?db=0`` for a local socket. The
password, if any, never appears in logs or stats (broker/urls.py's ``redact``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.exceptions import ResponseError

from broker.urls import redact

log = logging.getLogger(__name__)

#: Seconds to connect, and to wait for any reply but a blocking read's.
SOCKET_TIMEOUT_S = 2.0
#: Seconds a blocking read waits for entries before looking round (stop, health).
BLOCK_S = 1.0
#: The consumer group every worker reads the work stream in.
GROUP = "workers"

#: What a lost or refused connection raises in redis-py.
BROKER_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError,
                                                  OSError)

#: Adds each request (ARGV[2..]) to the work stream (KEYS[1]) while it holds fewer than ARGV[1]
#: entries; returns each one's entry id, or 0 where it was refused.
ADMIT_SCRIPT = """
local room = tonumber(ARGV[1]) - redis.call('XLEN', KEYS[1])
local ids = {}
for i = 2, #ARGV do
  if room > 0 then
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'm', ARGV[i])
    room = room - 1
  else
    ids[#ids + 1] = 0
  end
end
return ids
"""


#: Sets KEYS[1] to ARGV[1] (expiring in ARGV[2] ms) unless it holds another value; returns what
#: it holds then. A front end renews its model's fingerprint so, and never overwrites another's.
EXPECT_SCRIPT = """
local held = redis.call('GET', KEYS[1])
if (not held) or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return held
"""


@dataclass(frozen=True)
class Keys:
    """The Redis keys of one deployment, all under one prefix (``--broker_prefix``), for one
    of its models (its name in the repository): each model has its own work stream."""

    prefix: str = "qa"
    model: str = "qa"

    @property
    def work(self) -> str:
        """The model's stream of work entries, read by its workers' consumer group."""
        return f"{self.prefix}:work:{self.model}"

    @property
    def expected(self) -> str:
        """The model fingerprint the front ends serve under this name (they renew it; a
        worker whose model differs does not start)."""
        return f"{self.prefix}:model:{self.model}"

    def replies(self, front_end: str) -> str:
        """The stream one front end reads its replies from."""
        return f"{self.prefix}:replies:{front_end}"

    @property
    def workers(self) -> str:
        """The set of worker names that have announced themselves."""
        return f"{self.prefix}:workers"

    def heartbeat(self, worker: str) -> str:
        """A worker's figures, which expire unless it keeps renewing them."""
        return f"{self.prefix}:worker:{worker}"


def connect(url: str, block_s: float = 0.0) -> redis.Redis:
    """A client for ``url`` (no connection is made until first use). ``block_s``: the longest
    blocking read it will make, added to its reply timeout."""
    return redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S + block_s,
                                socket_connect_timeout=SOCKET_TIMEOUT_S, health_check_interval=0)


def first_connect(connect_now: Callable[[], None], url: str, meanwhile: str) -> None:
    """Connect at start (``connect_now``): Redis refusing us fails the start, an unreachable
    Redis is logged (with ``meanwhile``: what waits for it) and left to be retried.

    Raises:
        RuntimeError: Redis refused us (wrong password, not a Redis, no such database).
    """
    try:
        connect_now()
    except redis.AuthenticationError as exc:  # a ConnectionError to redis-py; not to us
        raise RuntimeError(f"broker {redact(url)} refused us: {exc}") from exc
    except BROKER_ERRORS as exc:
        log.warning("broker %s unreachable (%s); %s", redact(url), exc, meanwhile)
    except redis.RedisError as exc:
        raise RuntimeError(f"broker {redact(url)} refused us: {exc}") from exc


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Create the work stream and the workers' group unless they exist. The group starts at
    the stream's beginning: entries added before any worker came are not skipped (workers
    delete what they have answered, so the stream holds only outstanding work)."""
    try:
        client.xgroup_create(keys.work, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def require_expected(client: redis.Redis, keys: Keys, fingerprint: str, folder: str) -> None:
    """Refuse a worker's start where the front ends serve another model under its model's
    name (the fingerprint they renew at ``keys.expected``).

    Raises:
        RuntimeError: they do (the message is the one line a failed start logs).
    """
    held = client.get(keys.expected)
    theirs = held.decode(errors="replace") if held else None
    if theirs and theirs != fingerprint:
        raise RuntimeError(
            f"model {keys.model!r} of {folder} (fingerprint {fingerprint}) is not the one the "
            f"front ends under prefix {keys.prefix!r} serve by that name (fingerprint "
            f"{theirs}): give workers the front ends' prepared model folders")
