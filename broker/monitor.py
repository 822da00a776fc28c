"""What a front end knows of the broker and the workers, refreshed once a second.

Requests never wait for these figures: ``stats`` and ``ping`` read the last ones, so they
answer at once even while Redis is unreachable. Workers announce themselves in a set and keep
a heartbeat key alive (broker/worker.py); a worker whose key has expired is dropped from the set.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from broker.connect import BROKER_ERRORS, EXPECT_SCRIPT, GROUP, Keys
from telemetry.stats import ServerStats

log = logging.getLogger(__name__)

#: Seconds between two looks.
INTERVAL_S = 1.0
#: Workers that left whose figures are kept by name (a worker back under its name is not
#: counted twice); older ones are folded into one sum.
GONE_KEPT = 256


class BrokerMonitor(threading.Thread):
    """Keeps the front end's reply stream alive and reads the broker's and workers' figures.

    Args:
        client: A Redis client (non-blocking calls only).
        keys: The deployment's keys.
        reply_key: This front end's reply stream, whose expiry is renewed at each look.
        reply_ttl_ms: The expiry given to it (a front end that dies leaves nothing for long).
        on_lost: Called with the reason when Redis cannot be reached, or the reply stream is
            gone (the front end then answers what is in flight and makes it again).
        is_up: Whether the front end believes Redis reachable (no look is made otherwise).
        model: The front end's model fingerprint: workers of another are not counted. It is
            renewed at ``keys.expected`` at each look, with the reply stream's expiry, unless
            another front end's is there (``conflict`` then names that one, logged once).
    """

    def __init__(self, client: redis.Redis, keys: Keys, reply_key: str, reply_ttl_ms: int,
                 on_lost: Callable[[str], None], is_up: Callable[[], bool],
                 model: str) -> None:
        super().__init__(name="broker-monitor", daemon=True)
        self.client, self.keys, self.reply_key = client, keys, reply_key
        self.reply_ttl_ms = reply_ttl_ms
        self.on_lost, self.is_up = on_lost, is_up
        self.stream_length = 0
        self.pending = 0
        self.workers: list[dict[str, Any]] = []  # live workers' heartbeats, newest look
        #: The live workers' newest batch figures, by name, and the gone ones' (their samples
        #: dropped; past GONE_KEPT the oldest are folded into ``folded``), so that sums over
        #: workers never go back when one leaves.
        self.live_figures: dict[str, dict[str, Any]] = {}
        self.gone_figures: dict[str, dict[str, Any]] = {}
        self.folded = ServerStats()
        self.model = model
        self.conflict: str | None = None  # another front end's fingerprint for this name
        self._expect = client.register_script(EXPECT_SCRIPT)
        self._told: set[str] = set()  # workers of another model already logged
        self._stop = threading.Event()

    def run(self) -> None:
        """Look once a second until stopped."""
        while not self._stop.is_set():
            if self.is_up():
                self.look()
            self._stop.wait(INTERVAL_S)

    def look(self) -> None:
        """Renew the reply stream's expiry and read the figures now."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.pexpire(self.reply_key, self.reply_ttl_ms)
            self._expect(keys=[self.keys.expected], args=[self.model, self.reply_ttl_ms],
                         client=pipe)
            pipe.xlen(self.keys.work)
            pipe.xpending(self.keys.work, GROUP)
            pipe.smembers(self.keys.workers)
            renewed, held, length, pending, names = pipe.execute(raise_on_error=False)
            names = sorted(n.decode() for n in names) if isinstance(names, set) else []
            beats = self.client.mget([self.keys.heartbeat(n) for n in names]) if names else []
        except BROKER_ERRORS as exc:
            self.on_lost(f"{type(exc).__name__}: {exc}")
            return
        if renewed is False or renewed == 0:  # it expired (a pause over its TTL) or was evicted:
            # replies to it are dropped (workers never create it), so what is in flight is lost
            self.on_lost(f"the reply stream {self.reply_key} vanished (expired or evicted)")
            return
        self._check_expected(held)
        gone = [name for name, beat in zip(names, beats) if beat is None]
        if gone:
            self._forget(gone)
        self.stream_length = length if isinstance(length, int) else 0
        self.pending = pending.get("pending", 0) if isinstance(pending, dict) else 0
        parsed = [_parse(beat) for beat in beats if beat is not None]
        self.workers = [w for w in parsed if w.get("model_name") == self.keys.model]
        for worker in parsed:  # our model by another name: its stream is not ours
            if worker.get("model") == self.model and worker.get("model_name") \
                    and worker["model_name"] != self.keys.model:
                self._tell(worker, f"holds this front end's model {self.keys.model!r} as "
                           f"{worker['model_name']!r}: it takes from another stream; give "
                           "front ends and workers folders of the same name")
        self._remember_figures()

    def _check_expected(self, held: Any) -> None:
        """Note (and log once) another front end's fingerprint for this model's name."""
        theirs = held.decode(errors="replace") if isinstance(held, bytes) else self.model
        conflict = None if theirs == self.model else theirs
        if conflict is not None and conflict != self.conflict:
            log.error("another front end under prefix %r serves another model (%s) as %r than "
                      "this one (%s): give every front end the same prepared model folders",
                      self.keys.prefix, conflict, self.keys.model, self.model)
        self.conflict = conflict

    def _remember_figures(self) -> None:
        """Swap in new figure maps (readers on other threads see the old ones or the new)."""
        live = {w.get("worker"): w["figures"] for w in self.workers
                if isinstance(w.get("figures"), dict)}
        gone = {name: f for name, f in self.gone_figures.items() if name not in live}
        gone.update({name: _without_samples(f) for name, f in self.live_figures.items()
                     if name not in live})  # gone, or away a while: back, it is live again
        while len(gone) > GONE_KEPT:  # restarts add names for ever: fold the oldest
            self.folded.absorb(gone.pop(next(iter(gone))), share=0)
        self.live_figures, self.gone_figures = live, gone

    def worker_sums(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the live workers' figures, every gone worker's figures, folded ones included)."""
        return list(self.live_figures.values()), \
            [*self.gone_figures.values(), self.folded.batch_figures()]

    def summed(self, stats: ServerStats) -> ServerStats:
        """``stats`` plus every worker's newest batch figures, gone workers' included (those
        count the work of every front end the workers serve)."""
        merged = stats.copy()
        live, gone = self.worker_sums()
        for source in live:
            merged.absorb(source, share=1 / len(live))  # percentiles: the live workers' samples
        for source in gone:
            merged.absorb(source, share=0)  # counts and totals only
        return merged

    def _forget(self, names: list[str]) -> None:
        try:
            self.client.srem(self.keys.workers, *names)
        except BROKER_ERRORS:
            pass  # the next look tries again
        log.info("worker(s) %s stopped renewing their heartbeat; dropped", ", ".join(names))

    @property
    def serving_workers(self) -> int:
        """Workers holding this front end's model (by name and fingerprint) whose last
        heartbeat said they take work."""
        return sum(1 for w in self.workers if w.get("state") == "serving" and self._ours(w))

    def _ours(self, worker: dict[str, Any]) -> bool:
        """Whether ``worker`` serves this front end's model (say once when it does not)."""
        theirs = worker.get("model")
        if theirs is None or self.model is None or theirs == self.model:
            return True
        self._tell(worker, f"serves another model ({theirs}) than this front end "
                   f"({self.model}): not counted, and what it takes is answered 'internal'; "
                   "give both the same prepared model folder")
        return False

    def _tell(self, worker: dict[str, Any], what: str) -> None:
        """Log once per worker that it ``what``."""
        name = str(worker.get("worker"))
        if name not in self._told:
            self._told.add(name)
            log.error("worker %s %s", name, what)

    def figures(self) -> dict[str, Any]:
        """The work stream and the workers at the last look (claims and redeliveries summed over
        the live workers)."""
        workers = self.workers
        return {"stream_length": self.stream_length, "pending": self.pending,
                "model_conflict": self.conflict,
                "workers": len(workers), "serving_workers": self.serving_workers,
                "claims": sum(w.get("claims", 0) for w in workers),
                "redeliveries": sum(w.get("redeliveries", 0) for w in workers)}

    def worker_entries(self) -> list[dict[str, Any]]:
        """Each live worker's heartbeat, in the shape the ``stats`` op lists workers
        (workers/figures.py)."""
        return [{"worker": w.get("worker"), "pid": w.get("pid"), "device": w.get("device"),
                 "state": w.get("state"), "in_flight": w.get("in_flight", 0),
                 "restarts": w.get("restarts", 0), "figures": w.get("figures"),
                 "known_figures": w.get("figures")} for w in self.workers]

    def stop(self) -> None:
        """Stop looking (returns at once; the thread ends within a second)."""
        self._stop.set()


def _without_samples(figures: dict[str, Any]) -> dict[str, Any]:
    """Batch figures with their counts and totals kept, their recent samples dropped."""
    return {**figures, **{key: {**figures[key], "recent": []}
                          for key in ("queue_time", "engine_time")
                          if isinstance(figures.get(key), dict)}}


def _parse(beat: bytes) -> dict[str, Any]:
    try:
        value = json.loads(beat)
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}
