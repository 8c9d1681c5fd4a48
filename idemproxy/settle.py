"""Settling a record after the forward while the store may be failing (CONTRACT "When the store fails after
the forward").

The engine decides *what* happens to a record once the upstream answered (complete it, or release it); this
module makes it happen through a store outage:

- a **completion** is retried, fenced by the lease token, with jittered backoff (first retry within 100 ms,
  then at most 500 ms apart). The caller waits up to ``settle_timeout`` for the verdict: landed, refused (the
  key was taken over or released meanwhile), or still pending — then the retries go on in the background
  until the completion lands or is refused, so a retry after the store returns is a replay, not a second
  execution;
- a **release** is tried at once; the answer waits for it at most ``RELEASE_WAIT`` (a hung store must not hold
  an answer the outcome table gives at once), and if the store failed, or is still on it, the release is retried
  in the background until the lease would run out anyway.

A completion's first attempt runs in line, so a hung store (rather than one that refuses) can hold
:meth:`Settler.complete` past ``settle_timeout``, up to the store's own operation timeout: the engine keeps its
own timer and answers the client on time, while the attempt and the retries go on.

Background work is bounded by count and bytes (the oldest is dropped beyond either bound, with an error log
and a metric), survives no crash (a crash is a lease takeover), and is flushed on graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any

from idemproxy.config import PendingSettlesConfig
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreUnavailable

log = logging.getLogger("idemproxy.settle")

FIRST_RETRY = 0.1  # seconds: the first retry comes within this
MAX_RETRY_GAP = 0.5  # seconds: retries are never further apart than this
RELEASE_WAIT = 0.5  # seconds an answer waits for its release before it goes out (the release goes on)

Operation = Callable[[], Coroutine[Any, Any, bool]]


def retry_delay(attempt: int) -> float:
    """Jittered exponential backoff: attempt 1 waits 50-100 ms, the gap doubles up to 250-500 ms."""
    ceiling = min(MAX_RETRY_GAP, FIRST_RETRY * 2 ** (attempt - 1))
    return random.uniform(ceiling / 2, ceiling)  # jitter, not a secret


@dataclass(eq=False)
class _Job:
    operation: str  # complete | release
    run: Operation
    size: int  # bytes held (the stored answer), for the bound
    deadline: float  # time.monotonic() after which the retries stop
    first: asyncio.Task[bool] | None = field(default=None, repr=False)  # an attempt still on its way, awaited first
    dropped: bool = False
    task: asyncio.Task[bool | None] | None = field(default=None, repr=False)
    name: Hashable | None = None  # what the completion is for ((tenant, key)): a request for it hurries it
    nudge: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set: the next attempt goes now
    tried: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set as each attempt ends


class Settler:
    """Retries store writes that must land after the upstream answered."""

    def __init__(self, metrics: Metrics, bounds: PendingSettlesConfig) -> None:
        self.metrics = metrics
        self.bounds = bounds
        # One insertion-ordered set per operation (the oldest first), bounded apart: releases (cheap, and
        # possibly many during an outage) must never push out a completion, whose loss is a second execution.
        self._jobs: dict[str, dict[_Job, None]] = {"complete": {}, "release": {}}
        self._bytes = 0
        self._tasks: set[asyncio.Task[bool | None]] = set()  # every job's, dropped ones too, until it ends
        # Pending completions by what they are for: a request for that key on this replica must not claim it
        # (and take it over, its lease run out during the outage) while the executed answer waits here between
        # two attempts: it hurries the completion first (``hurry``). Empty, as it nearly always is: no work.
        self.named: dict[Hashable, _Job] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # (asked once: on 3.11 asking costs a system call)
        self._closed = False  # set by ``flush`` once its time is up

    def _keep_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    @property
    def pending(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())

    async def complete(self, run: Operation, *, size: int, wait: float, give_up_after: float,
                       name: Hashable | None = None) -> bool | None:
        """Run a fenced completion: True landed, False refused, None still failing ``wait`` seconds after this
        call began (the retries then go on in the background for up to ``give_up_after`` seconds).

        The first attempt runs in line (the common case costs no task), so this call can end later than
        ``wait`` when that attempt hangs on the store, up to the store's own operation timeout: a caller that
        must answer on time keeps a timer of its own (the engine does)."""
        started = time.monotonic()
        try:
            return await run()
        except StoreUnavailable:
            log.warning("store unavailable during complete; retrying for up to %gs", wait)
        job = self._start("complete", run, size, time.monotonic() + give_up_after, name=name)
        assert job.task is not None
        left = started + wait - time.monotonic()
        if left <= 0:
            return None
        done, _ = await asyncio.wait({job.task}, timeout=left)
        return job.task.result() if done else None

    async def release(self, run: Operation, *, until: float) -> None:
        """Release now; the answer waits for it at most ``RELEASE_WAIT``. If the store failed, or is still on
        it, the release goes on in the background until ``until`` (monotonic)."""
        loop = self._loop or self._keep_loop()
        attempt = loop.create_task(run())
        try:
            done, _ = await asyncio.wait({attempt}, timeout=RELEASE_WAIT)
        except asyncio.CancelledError:  # the caller is gone; the release is not
            self._start("release", run, 0, until, first=attempt)
            raise
        if not done:
            log.warning("store slow to release; answering now, the release goes on in the background")
            self._start("release", run, 0, until, first=attempt)
            return
        error = attempt.exception()
        if isinstance(error, StoreUnavailable):
            log.warning("store unavailable during release; retrying in the background")
            self._start("release", run, 0, until)
        elif error is not None:
            raise error

    async def hurry(self, name: Hashable, timeout: float) -> None:
        """Before a request claims ``name``: if a completion for it is pending here, try it now (not after the
        rest of its backoff) and wait for that attempt, at most ``timeout`` seconds. Landed, the claim finds the
        record completed (a replay); refused, what the record says now; failed again, the store is still away
        (the claim fails too, or the lease is alive: 409)."""
        job = self.named.get(name)
        if job is None or job.dropped or job.task is None or job.task.done():
            return
        job.tried.clear()
        job.nudge.set()
        waiting = asyncio.ensure_future(job.tried.wait())
        try:
            await asyncio.wait({job.task, waiting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()

    def release_later(self, run: Operation, *, until: float) -> _Job:
        """Release in the background only (the store just failed: trying now would wait on it again)."""
        return self._start("release", run, 0, until)

    def release_again_at(self, run: Operation, *, at: float, until: float, after: _Job) -> None:
        """Release once more at ``at`` (monotonic), if that is before ``until``: a claim that may have landed after
        ``after``, the release that followed its failure. Nothing waits for it before then, a shutdown's flush
        included (a shutdown drops it, quietly). Then, unless ``after`` is still retrying (the store away: its
        release comes later anyway), one attempt: what it released is said, nothing released is the common case and
        says nothing, a store away makes it a background release as any other."""
        loop = self._loop or self._keep_loop()
        if at >= until:
            return

        def start() -> None:
            if self._closed or (after.task is not None and not after.task.done()):
                return
            task = loop.create_task(self._release_again(run, until), name="idemproxy-settle-release-again")
            self._tasks.add(task)
            task.add_done_callback(self._ended)

        loop.call_at(loop.time() + max(at - time.monotonic(), 0.0), start)

    async def _release_again(self, run: Operation, until: float) -> bool | None:
        try:
            released = await run()
        except StoreUnavailable:
            self._start("release", run, 0, until)
            return None
        except Exception:
            log.exception("releasing a claim once more failed")
            raise
        if released:
            log.warning("released, once more, a claim whose reply was lost (it landed after the release that followed "
                        "its failure, or that release never got through)")
        return released

    async def flush(self, timeout: float, grace: float) -> None:
        """At shutdown: let pending work land for up to ``timeout`` seconds (work started meanwhile too: a
        caller's first attempt that failed in the meantime), then drop what is left, cancel the attempts still
        on the store and give them ``grace`` seconds to unwind. From then on a job is dropped as it starts:
        nothing retries past the shutdown's budget."""
        deadline = time.monotonic() + timeout
        said = False
        while self._tasks and (left := deadline - time.monotonic()) > 0:
            if not said:
                log.info("flushing %d pending settles (up to %gs)", len(self._tasks), timeout)
                said = True
            await asyncio.wait(set(self._tasks), timeout=left)
        self._closed = True
        for jobs in self._jobs.values():
            for job in list(jobs):
                self._drop(job, "shutdown")
        late = set(self._tasks)
        for task in late:
            task.cancel()  # an attempt on a store that does not answer (it would wait out its own timeout)
        if late:
            await asyncio.wait(late, timeout=grace)

    # ------------------------------------------------------------------ background jobs

    def _start(
        self, operation: str, run: Operation, size: int, deadline: float, first: asyncio.Task[bool] | None = None,
        name: Hashable | None = None,
    ) -> _Job:
        job = _Job(operation, run, size, deadline, first, name=name)
        jobs = self._jobs[operation]
        jobs[job] = None
        if name is not None:
            self.named[name] = job
        self._bytes += size
        loop = self._loop or self._keep_loop()
        job.task = loop.create_task(self._retry(job), name=f"idemproxy-settle-{operation}")
        self._tasks.add(job.task)
        job.task.add_done_callback(self._ended)
        self.metrics.pending_settles.set(self.pending)
        if self._closed:  # (its first attempt failed after the shutdown's flush: no time is left to retry)
            self._drop(job, "shutdown")
        while jobs and (len(jobs) > self.bounds.max_count
                        or (operation == "complete" and self._bytes > self.bounds.max_bytes)):
            self._drop(next(iter(jobs)), "bound")
        return job

    def _ended(self, task: asyncio.Task[bool | None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # (retrieved: an error was logged where it happened, and a waiter still gets it)

    def _drop(self, job: _Job, why: str) -> None:
        if job.dropped:
            return
        job.dropped = True
        self._forget(job)
        self.metrics.settles_dropped.inc()
        log.error(
            "dropped a pending %s (%s: %d pending, %d bytes; bounds %d, %d bytes)%s", job.operation, why,
            self.pending, self._bytes, self.bounds.max_count, self.bounds.max_bytes,
            ": unless it lands first, the record keeps its lease and a retry takes the key over after it"
            if job.operation == "complete" else "",
        )

    def _forget(self, job: _Job) -> None:
        if job.name is not None and self.named.get(job.name) is job:
            del self.named[job.name]
        if self._jobs[job.operation].pop(job, False) is None:
            self._bytes -= job.size
            self.metrics.pending_settles.set(self.pending)

    async def _retry(self, job: _Job) -> bool | None:
        attempt = 0
        try:
            if job.first is not None:  # the caller's attempt, still waiting on the store: its verdict first
                try:
                    return await job.first
                except StoreUnavailable:
                    pass
                except Exception:  # said here: a background job may have nobody waiting for its result
                    log.exception("pending %s failed", job.operation)
                    raise
            while not job.dropped:
                attempt += 1
                if not job.nudge.is_set():  # (a request for the key may cut the wait short: ``hurry``)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(job.nudge.wait(), retry_delay(attempt))
                job.nudge.clear()
                if job.dropped or time.monotonic() > job.deadline:
                    return None
                self.metrics.settle_retries.labels(job.operation).inc()
                try:
                    result = await job.run()
                except StoreUnavailable:
                    job.tried.set()
                    continue
                except Exception:
                    log.exception("pending %s failed after %d retries", job.operation, attempt)
                    raise
                log.warning("pending %s %s after %d retries", job.operation,
                            "landed" if result else "refused (the key was taken over or released)", attempt)
                return result
            return None  # (dropped)
        finally:
            self._forget(job)
