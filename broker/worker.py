"""``--role worker --broker redis://...``: a worker that pulls requests from Redis and runs them.

One ``RedisWorker`` holds one model's engines (``--num_inference_sessions`` sessions on
``--device``; a worker process runs one per model it holds, broker/worker_main.py) and nothing
of the task's text work: front ends send each request's engine inputs and get its engine
outputs back (broker/wire.py), for a model of any task, as an executor's jobs do. A reader
thread takes entries from the model's work stream in its workers' consumer group, only as
many as its sessions' next batches will hold (one per session where batching does not pay, up to
``--max_batch_size`` where it does, by the cost model; at most ``2 x --max_batch_size`` held),
so work a busy worker cannot start yet stays in Redis for idle ones; sessions batch them
cost-aware as the in-process server does; replies go back, and the entries are acknowledged
and deleted, in one round trip per bulk (broker/outbox.py: by an idle session's own thread, else
by the outbox thread). Entries another worker took and did not settle within
``--claim_idle_ms`` (it died) are claimed (XPENDING, then XCLAIM; never a worker's own) and run
again: at-least-once delivery, and each front end answers a request once. An entry delivered
``MAX_DELIVERIES`` times (it kills workers) is answered ``worker_lost`` instead of being run
again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from broker.connect import (
    BLOCK_S,
    BROKER_ERRORS,
    GROUP,
    Keys,
    connect,
    ensure_group,
    first_connect,
    require_expected,
)
from broker.feeds_task import FeedsTask, cannot_run
from broker.outbox import ReplyOutbox
from broker.presence import HEARTBEAT_S, announce, leave
from broker.urls import redact
from broker.wire import FIELD, BadWork, Work, decode_work, encode_answer, encode_error
from engines.base import Engine
from engines.model_dir import ModelInfo, model_fingerprint
from engines.sharing import SharedEngines
from protocol.errors import InternalError, ServerError, WorkerLost
from scheduling.idle import IdleRelease
from scheduling.planner import worth_batching
from scheduling.pool import SessionPool
from scheduling.queue import DeadlineReaper, WorkItem, WorkQueue
from scheduling.waits import StartCancelled, backoff_s
from settings.server_config import ServerConfig
from tasks.qa import padded_lengths
from telemetry.memory import trim_heap
from telemetry.stats import ServerStats
from workers.local import (
    batch_policy,
    default_engine_factory,
    describe_serving,
    model_label,
    session_pool,
)

log = logging.getLogger("worker")

#: Deliveries after which an entry is answered ``worker_lost`` instead of run again.
MAX_DELIVERIES = 3
#: Recent timing samples a heartbeat carries, per timing (front ends take percentiles over them).
HEARTBEAT_SAMPLES = 512
#: Seconds a worker takes no work after it was given work of another model.
WRONG_MODEL_PAUSE_S = 5.0


class RedisWorker:
    """One worker process's sessions, fed from the work stream.

    Args:
        config: Serving settings (``broker``, ``broker_prefix``, ``claim_idle_ms``, sessions),
            ``model_dir`` this model's folder.
        info: The prepared model's metadata.
        name: The model's name in the repository (its work stream's).
        engine_factory: Builds each session's engine (default: per the config).
    """

    def __init__(self, config: ServerConfig, info: ModelInfo, name: str,
                 engine_factory: Callable[[], Engine] | None = None) -> None:
        assert config.broker is not None
        self.config, self.info = config, info
        self.keys = Keys(config.broker_prefix, name)
        self.name = f"{socket.gethostname()}-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
        self.stats = ServerStats()
        self.window = config.worker_window()
        self.queue = WorkQueue(self.window)
        self.policy = batch_policy(config)
        self.engines = SharedEngines(engine_factory or default_engine_factory(
            config, config.device, self.queue))
        self._idle = IdleRelease(self.queue, self._release_memory)
        self.client = connect(config.broker)
        self._reader = connect(config.broker, block_s=BLOCK_S)
        self.outbox = ReplyOutbox(self.client, self.keys, self._settled,
                                  idle=lambda: not len(self.queue))
        self.pool: SessionPool | None = None
        self.counts = {"claims": 0, "redeliveries": 0, "expired": 0, "unreadable": 0,
                       "wrong_model": 0}
        self.model = model_fingerprint(config.model_dir)
        self._paused_until = 0.0  # no taking before this time.monotonic() (another model's work)
        self._held = 0  # entries taken and not yet settled
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._up = False
        self._threads = [threading.Thread(target=self._read, name="broker-reader", daemon=True),
                         threading.Thread(target=self._beat, name="heartbeat", daemon=True)]

    # -- start ---------------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> None:
        """Load and warm up every session, then take work (waiting for Redis if need be).

        Args:
            cancel: Give up once this is set (a stop asked during start-up): the sessions are
                stopped, and no work was taken.

        Raises:
            RuntimeError: the front ends under this prefix serve another model by this name,
                a session could not load its engine, or Redis refused us.
            StartCancelled: ``cancel`` was set before every session was ready.
        """
        url = redact(self.config.broker or "")
        first_connect(self._connect, self.config.broker or "", "will take work once it is")
        self.check_expected()
        log.info("worker %s: loading %s into %d %s sessions, then taking work from %s on %s",
                 self.name, model_label(self.config), self.config.num_inference_sessions,
                 self.config.inference_engine_type, self.keys.work, url)
        longest = min(self.config.max_seq_len, self.info.max_seq_len)
        task = FeedsTask(self.info.input_names, self.info.output_names, self.info.task,
                         self._room_changed)
        self.pool = session_pool(self.config, self.engines, task, self.queue, self.policy,
                                 self.stats, padded_lengths(self.config.bucket_lengths(), longest),
                                 longest)
        try:
            self.pool.start(cancel)
        except StartCancelled:
            self.queue.close()  # nothing was taken: the sessions end once loaded
            raise
        DeadlineReaper(self.queue).start()
        self._release_memory()  # what warm-up's largest batch took
        self._idle.start()
        self.outbox.start()
        for thread in self._threads:
            thread.start()
        log.info("worker %s serving: work from %s on %s", self.name, self.keys.work, url)

    def check_expected(self) -> None:
        """Raise RuntimeError where the front ends serve another model by our model's name
        (where Redis can be reached now)."""
        try:
            require_expected(self.client, self.keys, self.model, self.config.model_dir)
        except BROKER_ERRORS:
            pass  # unreachable: start() waits for it

    def _connect(self) -> None:
        ensure_group(self.client, self.keys)
        self._up = True

    # -- taking work ---------------------------------------------------------------------------
    def _read(self) -> None:
        """Take new entries, and now and then claim abandoned ones, while there is room."""
        claim_every = min(5.0, max(0.1, self.config.claim_idle_ms / 2000))
        next_claim, failures = 0.0, 0
        while not self._stopping.is_set():
            try:
                room = self._wait_for_room()
                if room == 0:
                    continue
                if (pause := self._paused_until - time.monotonic()) > 0:  # another model's work
                    self._stopping.wait(pause)
                    continue
                if not self._up:
                    self._connect()
                    log.warning("broker reachable again; taking work")
                if time.monotonic() >= next_claim:  # again at once while it finds some
                    found = self._claim(room)
                    next_claim = time.monotonic() + (0.0 if found else claim_every)
                    continue
                read = self._reader.xreadgroup(GROUP, self.name, {self.keys.work: ">"},
                                               count=room, block=int(BLOCK_S * 1000))
                failures = 0
                for _, entries in read or []:
                    self._take(entries)
            except redis.RedisError as exc:
                if self._up:
                    log.error("lost the broker (%s: %s); retrying", type(exc).__name__, exc)
                self._up = False  # reconnecting recreates the group if Redis lost it (NOGROUP)
                failures = self._back_off(failures)
            except Exception:  # noqa: BLE001 - a bug of ours must not stop the taking of work
                log.exception("taking work failed; going on")
                failures = self._back_off(failures)

    def _back_off(self, failures: int) -> int:
        """Wait the back-off after ``failures`` failures in a row (less if stopping)."""
        self._stopping.wait(backoff_s(failures, least=0.1))
        return failures + 1

    def _wait_for_room(self) -> int:
        """Entries to take now: enough for the batches the sessions will run next (what the
        cost model says pays, per session), never more than ``window`` held in all, and none
        while a next batch already waits, so that work stays in Redis for idle workers."""
        pull = self.pull_size()
        want = pull * self.config.num_inference_sessions
        with self._cond:
            self._cond.wait_for(lambda: self._stopping.is_set() or (
                self._held < self.window and len(self.queue) < pull), BLOCK_S)
            if self._stopping.is_set():
                return 0
            return max(0, min(self.window - self._held, want - len(self.queue)))

    def pull_size(self) -> int:
        """Requests worth batching together at the longest length, by the cost model (1 where
        batching does not pay, as on most CPUs; up to ``--max_batch_size`` on a GPU)."""
        return worth_batching(self.policy, min(self.config.max_seq_len, self.info.max_seq_len))

    def _room_changed(self) -> None:
        """A session took a batch from the local queue (its collate): maybe take more."""
        with self._cond:
            self._cond.notify_all()

    def _claim(self, room: int) -> bool:
        """Take over entries idle for ``--claim_idle_ms`` in another worker's hands (never our
        own: a slow local queue is not a dead worker); True if any were (a dead worker's: the
        rest follow as fast as there is room)."""
        idle = int(self.config.claim_idle_ms)
        stale = self.client.xpending_range(self.keys.work, GROUP, min="-", max="+",
                                           count=room + self.window, idle=idle)
        theirs = [p for p in stale if _text(p["consumer"]) != self.name][:room]
        if not theirs:
            return False
        entries = self.client.xclaim(self.keys.work, GROUP, self.name, min_idle_time=idle,
                                     message_ids=[p["message_id"] for p in theirs])
        if not entries:  # another worker claimed them first
            return False
        self.counts["claims"] += len(entries)
        log.warning("claimed %d entries another worker left unanswered", len(entries))
        delivered = {p["message_id"]: p["times_delivered"] + 1 for p in theirs}  # + this claim
        runnable = []
        for entry in entries:
            if delivered.get(entry[0], 0) > MAX_DELIVERIES:
                self._give_up(entry)
            else:
                runnable.append(entry)
        self.counts["redeliveries"] += len(runnable)
        self._take(runnable)
        return True

    def _give_up(self, entry: tuple[bytes, dict[bytes, bytes]]) -> None:
        self._held_add(1)
        work = self._decode(entry)  # settled already where None
        if work is not None:
            self.outbox.put(entry[0], work.reply_to, encode_error(
                work.number, WorkerLost.code, f"workers died {MAX_DELIVERIES} times running "
                "this request; it is not run again"))

    def _take(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> None:
        """Queue each entry for the sessions; settle at once those that cannot run."""
        now = time.monotonic()
        self._held_add(len(entries))
        for entry_id, fields in entries:
            work = self._decode((entry_id, fields))  # settled already where None
            if work is None:
                continue
            if work.model is not None and work.model != self.model:
                self._wrong_model(entry_id, work)
            elif work.deadline is not None and work.deadline <= now:
                self.counts["expired"] += 1
                self.stats.count_event("deadline_exceeded")
                self.outbox.put(entry_id, work.reply_to, encode_error(
                    work.number, "deadline_exceeded", "deadline passed before a worker took it"))
            else:
                self.queue.put(WorkItem(features=work.feeds, respond=partial(self._answer,
                                                                             entry_id, work),
                                        rows=work.feeds.rows, length=work.feeds.max_len,
                                        enqueued_at=work.enqueued_at, deadline=work.deadline))

    def _wrong_model(self, entry_id: bytes, work: Work) -> None:
        """Answer ``internal`` work of another model than ours, and take nothing for a while:
        the workers of that model get the rest of its work."""
        if not self.counts["wrong_model"]:
            log.error("work of another model (%s) than ours (%s) on %s: answered 'internal'; "
                      "give front ends and workers the same prepared model folder", work.model,
                      self.model, self.keys.work)
        self.counts["wrong_model"] += 1
        self._paused_until = time.monotonic() + WRONG_MODEL_PAUSE_S
        self.outbox.put(entry_id, work.reply_to, encode_error(
            work.number, InternalError.code, f"worker {self.name} serves another model "
            f"({self.model}) than the front end ({work.model})"))

    def _decode(self, entry: tuple[bytes, dict[bytes, bytes] | None]) -> Work | None:
        """The entry's work; None where it cannot run, which is then settled: answered
        ``internal`` where its front end can be told, else dropped."""
        try:
            work = decode_work((entry[1] or {}).get(FIELD, b""))
            problem = cannot_run(self.info, work.feeds)
        except BadWork as exc:
            work, problem = None, str(exc)
            reply: tuple[str | None, bytes | None] = (exc.reply_to, encode_error(
                exc.number, InternalError.code, f"worker {self.name}: {exc}"))
        except Exception as exc:  # noqa: BLE001 - nobody to answer: dropped
            work, problem, reply = None, f"{type(exc).__name__}: {exc}", (None, None)
        else:
            if problem is None:
                return work
            reply = (work.reply_to, encode_error(work.number, InternalError.code,
                                                 f"worker {self.name}: {problem}"))
        self.counts["unreadable"] += 1
        log.error("work entry %s cannot run (%s): %s", entry[0],
                  "answered 'internal'" if reply[0] else "dropped", problem)
        self.outbox.put(entry[0], *reply)
        return None

    # -- answering -----------------------------------------------------------------------------
    def _answer(self, entry_id: bytes, work: Work, result: dict[str, Any] | None,
                error: ServerError | None) -> None:
        """A session's responder: queue the logits (or the error) for the outbox."""
        held = time.monotonic() - work.taken_at
        if error is not None:
            reply = encode_error(work.number, error.code, error.message, held)
        else:
            assert result is not None
            reply = encode_answer(work.number, result["outputs"], held)
        self.outbox.put(entry_id, work.reply_to, reply)

    def _held_add(self, n: int) -> None:
        with self._cond:
            self._held += n

    def _settled(self, n: int) -> None:
        with self._cond:
            self._held -= n
            self._cond.notify_all()

    # -- heartbeat -----------------------------------------------------------------------------
    def heartbeat(self) -> dict[str, Any]:
        """What front ends see of this worker: state, load, figures, engine, broker counts."""
        figures = self.stats.batch_figures()
        figures["queue_depth"] = len(self.queue)
        for timing in ("queue_time", "engine_time"):  # the newest samples, to the microsecond:
            recent = figures[timing]["recent"][-HEARTBEAT_SAMPLES:]  # a heartbeat stays small
            figures[timing]["recent"] = [round(sample, 6) for sample in recent]
        engine = self.pool.engine if self.pool is not None else None
        serving = self.pool is not None and self.pool.serving and not self._stopping.is_set() \
            and self._threads[0].is_alive()
        return {"worker": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "device": engine.device if engine is not None else self.config.device,
                "state": "serving" if serving else "draining" if self._stopping.is_set()
                else "starting", "in_flight": self._held,
                "restarts": figures["events"].get("session_restart", 0), "figures": figures,
                "describe": describe_serving(self.policy, engine), "model": self.model,
                "model_name": self.keys.model,
                **self.counts,
                "lost_replies": self.outbox.lost}

    def _beat(self) -> None:
        while True:
            self._send_heartbeat()
            if self._stopping.wait(HEARTBEAT_S):
                return

    def _send_heartbeat(self) -> None:
        announce(self.client, self.keys, self.name, self.heartbeat)

    @property
    def healthy(self) -> bool:
        """Its reader and heartbeat threads are running (or it is stopping)."""
        return self._stopping.is_set() or all(t.is_alive() for t in self._threads)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float) -> bool:
        """Take no more work, run and answer what was taken, say goodbye.

        Returns:
            True if everything taken was answered within ``timeout``.
        """
        until = time.monotonic() + timeout
        lost_before = self.outbox.lost  # replies lost in an outage long ago do not count
        self._stopping.set()
        self._send_heartbeat()  # "draining": front ends stop counting on us at once
        for thread in self._threads:
            thread.join(BLOCK_S + 3)
        self.queue.close()
        drained = self.pool.join(max(0.0, until - time.monotonic())) if self.pool else True
        self.outbox.close(max(1.0, until - time.monotonic()))
        self._idle.stop()
        with self._cond:
            drained = drained and self._held == 0 and self.outbox.lost == lost_before
        self._leave(drained)
        return drained

    def _release_memory(self) -> None:
        """Give back the working memory of past batches (the engines', the C heap's)."""
        if self.pool is not None:
            self.pool.release_memory()
        trim_heap()

    def _leave(self, drained: bool) -> None:
        leave(self.client, self.keys, self.name, drained)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
