"""``--broker redis://...``: a model's front end whose work goes to Redis, for workers anywhere.

One ``RedisBackend`` serves one model of the repository (dispatch/models.py routes to it). It
tokenizes requests as the in-process server does, collates each alone into its engine inputs,
and puts one entry per request on the model's work stream (broker/wire.py): a read's requests
in one round trip, through a script that adds them only while the stream holds fewer than
``--max_queue`` entries (beyond it, ``overloaded`` at once). The model's workers (broker/
worker.py) batch, run the engine and put each request's outputs on this front end's reply
stream, which one thread reads, answering with the model's task; a request is answered once,
whatever comes back twice. No live worker holding the model: ``unavailable`` at once.

Redis unreachable: requests are refused with ``unavailable`` at once, the requests in flight
are answered ``unavailable`` (they may have run; safe to resend), ``ready`` is false, ``ping``
and ``stats`` still answer, and the reply thread reconnects with a growing back-off.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from broker.connect import (
    ADMIT_SCRIPT,
    BLOCK_S,
    BROKER_ERRORS,
    Keys,
    connect,
    ensure_group,
    first_connect,
)
from broker.in_flight import GivenUp, InFlight
from broker.monitor import BrokerMonitor
from broker.urls import redact
from broker.wire import FIELD, Reply, decode_reply, encode_work, feeds_problem
from engines.model_dir import ModelInfo, model_fingerprint
from protocol.errors import (
    DeadlineExceeded,
    InternalError,
    Overloaded,
    ServerError,
    ShuttingDown,
    Unavailable,
    error_for_code,
)
from scheduling.deadlines import ExpiryClock
from scheduling.queue import Responder, WorkItem
from scheduling.waits import backoff_s, raise_if_cancelled
from settings.server_config import ServerConfig
from tasks import load_task
from tasks.base import Task, answer_of
from telemetry.stats import ServerStats, Timing
from transport.coalesce import coalesced_sends

log = logging.getLogger(__name__)

#: A front end's reply stream expires this long after its last renewal (it renews each second).
REPLY_TTL_MS = 30_000
#: Most replies read at once.
READ_COUNT = 512


class RedisBackend:
    """The front end of a brokered deployment (workers/backend.py: Backend).

    Args:
        config: Serving settings (``broker``, ``broker_prefix``, ``max_queue``, the task's),
            ``model_dir`` this model's folder.
        info: The prepared model's metadata (the front end loads its task, not its engine).
        stats: This model's statistics at this front end.
        name: The model's name in the repository: its work stream's, and its workers'.
    """

    def __init__(self, config: ServerConfig, info: ModelInfo, stats: ServerStats,
                 name: str) -> None:
        assert config.broker is not None
        self.config, self.info, self.stats = config, info, stats
        self.url = config.broker
        self.keys = Keys(config.broker_prefix, name)
        self.name = uuid.uuid4().hex[:12]
        self.reply_key = self.keys.replies(self.name)
        self.client = connect(self.url)
        self._reader = connect(self.url, block_s=BLOCK_S)
        self._admit = self.client.register_script(ADMIT_SCRIPT)
        self.task: Task | None = None
        self._numbers = itertools.count()
        self._lock = threading.Condition()
        self._in_flight: dict[int, InFlight] = {}
        self._staged = threading.local()
        self._up = False
        self._refusing = False  # stop() began: no new work; replies are still read
        self._stopping = False  # the reply thread ends
        self._last_id = b"0-0"
        self.counts = {"duplicate_replies": 0, "late_replies": 0, "unavailable": 0,
                       "reconnects": 0}
        self._given_up = GivenUp()  # answered without their reply (guarded by _lock)
        #: Per answered request: from going to Redis until its reply was read, less the time a
        #: worker held it: what the hop through Redis costs, both ways (guarded by _lock).
        self.hop_time = Timing()
        self.monitor = BrokerMonitor(self.client, self.keys, self.reply_key, REPLY_TTL_MS,
                                     self._lost, lambda: self._up,
                                     model_fingerprint(config.model_dir))
        self._clock = ExpiryClock(self._expire)
        self._thread = threading.Thread(target=self._read_replies, name="broker-replies",
                                        daemon=True)

    # -- start ---------------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> None:
        """Load the tokenizer and connect; an unreachable Redis is waited for in the background.

        Raises:
            RuntimeError: Redis refused us (wrong password, not a Redis, no such database).
            StartCancelled: ``cancel`` was set while the tokenizer loaded.
        """
        self.task = load_task(self.config.model_dir, self.info, self.config)
        raise_if_cancelled(cancel)
        first_connect(self._connect, self.url, "not ready until it is")
        self.monitor.start()
        self._clock.start()
        self._thread.start()

    def _connect(self) -> None:
        """Make sure the work stream, its group and our reply stream exist; then we are up."""
        ensure_group(self.client, self.keys)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.reply_key, {FIELD: b""}, maxlen=1)  # creates it; workers never do
        pipe.pexpire(self.reply_key, REPLY_TTL_MS)
        pipe.execute()
        self._up = True
        self.monitor.look()  # also says which model we serve: workers of another do not start
        log.info("broker %s: work on %s, replies on %s", redact(self.url), self.keys.work,
                 self.reply_key)

    # -- the way in ----------------------------------------------------------------------------
    def submit(self, request: Any, respond: Responder, alive: Callable[[], bool],
               enqueued_at: float, deadline: float | None) -> None:
        """Tokenize one request and stage it; ``flush`` sends what a read staged.

        Raises:
            ShuttingDown: stopping.
            Unavailable: Redis unreachable, or no worker serving.
            BadRequest: text the model cannot take.
        """
        if self._refusing or self.task is None:
            raise ShuttingDown("server is shutting down; request not admitted")
        if not self._up:
            raise Unavailable("the broker cannot be reached; retry once the server is ready")
        if not self.monitor.serving_workers:
            raise Unavailable(f"no live worker holds model {self.keys.model!r}; retry once "
                              "one serves it (workers: --role worker --models ...)")
        task = self.task
        features = task.features(request)
        feeds = task.collate([features])
        if problem := feeds_problem(feeds):  # a plug-in's, say: a task, not a request, fault
            raise InternalError(f"model {self.keys.model!r}: its task's engine inputs cannot "
                                f"go through Redis: {problem}")
        length = next(iter(feeds.values())).shape[1]
        item = WorkItem(features=features, respond=respond, alive=alive, rows=features.rows,
                        length=length, enqueued_at=enqueued_at, deadline=deadline)
        number = next(self._numbers)
        payload = encode_work(self.reply_key, number, feeds, enqueued_at, deadline,
                              self.monitor.model)
        if not hasattr(self._staged, "items"):
            self._staged.items = []
        self._staged.items.append((InFlight(number, item), payload))

    def flush(self) -> None:
        """Add what this thread staged to the work stream, in one round trip."""
        staged: list[tuple[InFlight, bytes]] = getattr(self._staged, "items", None) or []
        if not staged:
            return
        self._staged.items = []
        with self._lock:
            for record, _ in staged:
                self._in_flight[record.number] = record
        for record, _ in staged:
            if record.item.deadline is not None:
                self._clock.add(record.item.deadline, record.number)
        numbers = [record.number for record, _ in staged]
        sent_at = time.monotonic()
        for record, _ in staged:
            record.sent_at = sent_at
        if not self._up:  # lost since submit: our reply stream may not exist in a new Redis
            self._fail(numbers, Unavailable("the broker cannot be reached; retry once the "
                                            "server is ready"))
            return
        try:
            ids = self._admit(keys=[self.keys.work],
                              args=[self.config.max_queue, *(p for _, p in staged)])
        except BROKER_ERRORS as exc:
            self._lost(f"{type(exc).__name__}: {exc}")  # answers these with the rest
            return
        except Exception as exc:  # noqa: BLE001 - refused (a full Redis, say): these fail alone
            log.error("the broker refused work entries: %s", exc)
            self._fail(numbers, InternalError(f"the broker refused: {exc}"))
            return
        self._admitted([record for record, _ in staged], ids)

    def _admitted(self, staged: list[InFlight], ids: list[Any]) -> None:
        refused = []
        with self._lock:
            for record, entry in zip(staged, ids):
                if entry:
                    record.entry = entry
                else:
                    refused.append(record.number)
        if refused:
            self._fail(refused, Overloaded(f"the work stream holds {self.config.max_queue} "
                                           "requests (--max_queue); retry later"))

    # -- the way back --------------------------------------------------------------------------
    def _read_replies(self) -> None:
        """Read this front end's reply stream until stopped; reconnect while Redis is away."""
        failures = 0
        while not self._stopping:
            if not self._up:
                time.sleep(backoff_s(failures, least=0.1))
                failures = self._reconnect(failures)
                continue
            try:
                read = self._reader.xread({self.reply_key: self._last_id}, count=READ_COUNT,
                                          block=int(BLOCK_S * 1000))
                if read:
                    self._take(read[0][1])
            except (redis.RedisError, OSError) as exc:  # lost it, or Redis lost its data
                self._lost(f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - a bug of ours must not stop the replies
                log.exception("reading replies failed; going on")

    def _reconnect(self, failures: int) -> int:
        try:
            self._connect()
        except redis.RedisError as exc:
            log.debug("broker still unreachable: %s", exc)
            return failures + 1
        self.counts["reconnects"] += 1
        self.stats.count_event("broker_reconnect")
        log.warning("broker %s reachable again; serving", redact(self.url))
        return 0

    def _take(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Answer the requests whose replies are in ``entries``, then delete the entries."""
        self._last_id = entries[-1][0]
        answers: list[tuple[InFlight, Reply]] = []
        now = time.monotonic()
        with self._lock:
            for _, fields in entries:
                payload = fields.get(FIELD, b"")
                try:
                    reply = decode_reply(payload) if payload else None
                except ValueError as exc:
                    log.error("unreadable reply entry: %s", exc)
                    continue
                if reply is None:
                    continue
                record = self._in_flight.pop(reply.number, None)
                if record is None:  # answered already: given up on, or delivered twice
                    late = self._given_up.take(reply.number)
                    self.counts["late_replies" if late else "duplicate_replies"] += 1
                else:
                    answers.append((record, reply))
                    self.hop_time.observe(max(0.0, now - record.sent_at - reply.held_s))
            self._lock.notify_all()
        with coalesced_sends():  # one write per connection for the whole read
            for record, reply in answers:
                self._answer(record.item, reply)
        # only now, when each is answered: if Redis is lost here, nothing taken goes unanswered
        self._reader.xdel(self.reply_key, *(entry_id for entry_id, _ in entries))

    def _answer(self, item: WorkItem, reply: Reply) -> None:
        if reply.code is not None:
            item.answer(None, error_for_code(reply.code, reply.message))
            return
        assert self.task is not None
        try:
            outputs = self.task.split_outputs([item.features],
                                              reply.outputs(item.features.rows))[0]
        except Exception as exc:  # noqa: BLE001 - one bad reply fails alone
            log.exception("a worker's reply does not fit its request")
            item.answer(None, InternalError(f"a worker's reply does not fit: {type(exc).__name__}"))
            return
        item.answer(*answer_of(self.task, item.features, outputs, "broker front end"))

    # -- failures ------------------------------------------------------------------------------
    def _lost(self, reason: str) -> None:
        """Redis cannot be reached: answer everything in flight ``unavailable``; reconnect."""
        with self._lock:
            if not self._up and not self._in_flight:
                return
            was_up, self._up = self._up, False
            numbers = list(self._in_flight)
        if was_up:
            self.stats.count_event("broker_lost")
            log.error("lost the broker %s (%s); %d requests in flight answered 'unavailable'",
                      redact(self.url), reason, len(numbers))
        self._fail(numbers, Unavailable("lost the connection to the broker; the request may or "
                                        "may not have run; safe to send again"))

    def _fail(self, numbers: list[int], error: ServerError) -> None:
        with self._lock:
            records = [r for n in numbers if (r := self._in_flight.pop(n, None)) is not None]
            self._given_up.add(r.number for r in records)
            if isinstance(error, Unavailable):
                self.counts["unavailable"] += len(records)
            self._lock.notify_all()
        for record in records:
            record.item.answer(None, error)

    def _expire(self, number: int) -> None:
        """A request's deadline passed (the clock's thread): unless answered, answer it now."""
        with self._lock:
            record = self._in_flight.get(number)
        if record is None:
            return
        waited = 1000 * (time.monotonic() - record.item.enqueued_at)
        self._fail([record.number], DeadlineExceeded(
            f"deadline passed after {waited:.0f} ms before a worker answered"))

    # -- what the server asks ------------------------------------------------------------------
    def purge(self, drop: Callable[[WorkItem], bool]) -> list[WorkItem]:
        """Forget in-flight requests for which ``drop`` is true (their client left) and delete
        their work entries, so that no worker runs what a worker has not taken yet."""
        with self._lock:
            gone = [r for r in self._in_flight.values() if drop(r.item)]
            for record in gone:
                del self._in_flight[record.number]
            self._given_up.add(r.number for r in gone)
            self._lock.notify_all()
        entries = [r.entry for r in gone if r.entry is not None]
        if entries and self._up:
            try:
                self.client.xdel(self.keys.work, *entries)
            except redis.RedisError:
                pass  # a worker runs them; their replies are dropped
        return [record.item for record in gone]

    @property
    def ready(self) -> bool:
        """Redis reachable and at least one worker serving."""
        return self._up and not self._refusing and self.monitor.serving_workers > 0

    @property
    def queue_depth(self) -> int:
        """Entries in the work stream at the last look: waiting, or taken and not answered."""
        return self.monitor.stream_length

    def describe(self) -> dict[str, Any]:
        """A serving worker's engine and batching figures, and the broker's."""
        out = dict(next((w["describe"] for w in self.monitor.workers if w.get("describe")), {}))
        out["broker"] = self.broker_figures()
        return out

    def broker_figures(self) -> dict[str, Any]:
        """The broker as this front end saw it at the last look, plus its own counts."""
        with self._lock:
            hops = self.hop_time.summary()
        return {"url": redact(self.url), "up": self._up, "front_end": self.name,
                "stream": self.keys.work, **self.monitor.figures(),
                "in_flight": len(self._in_flight), **self.counts, "hop_time": hops}

    def worker_figures(self) -> list[dict[str, Any]]:
        """Each live worker, in the shape the ``stats`` op lists workers."""
        return self.monitor.worker_entries()

    def summed(self, stats: ServerStats, figures: list[dict[str, Any]]) -> ServerStats:
        """This front end's ``stats`` plus the model's workers' newest batch figures."""
        return self.monitor.summed(stats)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float) -> bool:
        """Refuse new work, wait for the replies of what is in flight (the reply thread reads
        on meanwhile), then stop reading.

        Returns:
            True if every request in flight was answered within ``timeout``.
        """
        until = time.monotonic() + timeout
        self._refusing = True
        with self._lock:
            drained = self._lock.wait_for(lambda: not self._in_flight or not self._up,
                                          max(0.0, until - time.monotonic()))
            numbers = list(self._in_flight)
        self._fail(numbers, ShuttingDown("server stopped before this request was answered")
                   if self._up else Unavailable("the broker cannot be reached"))
        drained = drained and not numbers
        self._stopping = True
        self.monitor.stop()
        self._clock.stop()
        if self._thread.ident is not None:  # started
            self._thread.join(BLOCK_S + 3)
        try:
            self.client.delete(self.reply_key)
        except redis.RedisError:
            pass  # it expires by itself
        return drained

