"""Group commit for network stores: calls made while earlier ones are on the wire go out together.

Every request's claim and completion used to be one round trip of its own: a pool checkout, a statement (or a
script call), a ``send`` and a wake-up on both ends. Under load that per-call cost dominated a first request. A
:class:`Batcher` queues calls instead: the first call of a loop turn schedules a flush after that turn, so every
call made in the same turn joins it, and while ``max_in_flight`` batches are on the wire new calls wait and
leave together with the next one. At low load a batch is one call sent at once (no added wait); under load
batches grow by themselves, which is group commit.

The backend's ``send`` runs one batch and returns one outcome per call, in order: a value or the exception that
call alone raised. An exception from ``send`` itself fails every call of the batch (each caller gets a copy).

A caller that is cancelled stops waiting. If its call was not sent yet, it never is; if it was, the batch runs
on, and its outcome goes to ``abandoned`` (a store releases a claim that came back owned), since nobody else will
act on it. With a ``timeout``, a call that has no outcome that long after it was made fails with
:class:`CallTimeout` and is treated the same way: its wait behind batches still on the wire counts, so a stalled
store cannot hold it for their timeouts and then its own. One timer serves every call (a timer each cost about
1 % of a first request's instructions): calls are made in order and share the timeout, so their deadlines come
in order, and the timer waits for the earliest of those still pending.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

log = logging.getLogger("idemproxy.store")

Item = TypeVar("Item")
Result = TypeVar("Result")


class CallTimeout(TimeoutError):
    """A call with no outcome within its timeout; ``sent``: its batch had left (the call may still be applied)."""

    def __init__(self, sent: bool) -> None:
        super().__init__("no outcome within the timeout" + ("" if sent else "; never sent"))
        self.sent = sent


class Batcher(Generic[Item, Result]):
    """Sends queued items together; at most ``max_in_flight`` batches at a time, each of at most ``max_batch``
    items and (past its first item) ``max_weight`` by ``weigh``: one failure fails a batch, so batches stay small
    enough that a statement timeout or a cut costs few requests."""

    def __init__(
        self, send: Callable[[list[Item]], Awaitable[list[Result | BaseException]]], *,
        max_batch: int = 64, max_in_flight: int = 2, weigh: Callable[[Item], int] | None = None,
        max_weight: int = 0, abandoned: Callable[[Item, Result | BaseException], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        self._send = send
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self._weigh = weigh
        self.max_weight = max_weight
        self._abandoned = abandoned
        self.timeout = timeout
        self._deadlines: deque[tuple[float, asyncio.Future[Result]]] = deque()  # (when it fails, its future)
        self._expiry: asyncio.TimerHandle | None = None
        self._queue: list[tuple[Item, asyncio.Future[Result]]] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        # The loop of the first call, which every later call shares (as a connection does). Not asked for again:
        # on CPython 3.11 asyncio.get_running_loop() makes a getpid() system call each time (a fork check), and
        # those were 5 % of a first request's CPU, four calls a request.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0  # batches sent, for diagnostics and tests
        self.items = 0  # items sent

    async def call(self, item: Item) -> Result:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._queue.append((item, future))
        if not self._scheduled and self._in_flight < self.max_in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)  # after this loop turn: the other calls it makes join the batch
        if self.timeout is not None:
            deadlines = self._deadlines
            while deadlines and deadlines[0][1].done():  # (answered in order, mostly: the deque stays short)
                deadlines.popleft()
            deadlines.append((loop.time() + self.timeout, future))
            if self._expiry is None:
                self._expiry = loop.call_at(deadlines[0][0], self._expire)
        return await future

    def _expire(self) -> None:
        """Fail the calls past their deadline (``CallTimeout``): one still queued is never sent; one sent has its
        outcome go to ``abandoned``. Then wait for the next deadline of a call still pending."""
        self._expiry = None
        loop = self._loop
        assert loop is not None  # (set by the call that armed the timer)
        now = loop.time()
        deadlines = self._deadlines
        queued: set[int] | None = None
        while deadlines:
            at, future = deadlines[0]
            if not future.done():
                if at > now:
                    self._expiry = loop.call_at(at, self._expire)
                    return
                if queued is None:
                    queued = {id(waiting) for _, waiting in self._queue}
                future.set_exception(CallTimeout(sent=id(future) not in queued))
            deadlines.popleft()

    def _flush(self) -> None:
        self._scheduled = False
        # A caller cancelled before its call left: the call never goes.
        self._queue = [entry for entry in self._queue if not entry[1].done()]
        while self._queue and self._in_flight < self.max_in_flight:
            size = self._batch_size()
            batch, self._queue = self._queue[:size], self._queue[size:]
            self._in_flight += 1
            assert self._loop is not None  # (set by the call that scheduled this flush)
            task = self._loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _batch_size(self) -> int:
        if self._weigh is None:
            return min(self.max_batch, len(self._queue))
        weight, size = 0, 0
        for item, _ in self._queue[: self.max_batch]:
            weight += self._weigh(item)
            if size and weight > self.max_weight:
                break
            size += 1
        return size

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        self.batches += 1
        self.items += len(batch)
        outcomes: list[Result | BaseException]
        try:
            outcomes = await self._send([item for item, _ in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} came back with {len(outcomes)} outcomes")
        except asyncio.CancelledError:  # the loop is going away: so are its callers
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the whole batch failed (the connection, the statement): every call did
            outcomes = [_copy(exc) for _ in batch]
        finally:
            self._in_flight -= 1
            if self._queue and not self._scheduled:  # calls that queued while this batch was on the wire
                self._scheduled = True
                assert self._loop is not None
                self._loop.call_soon(self._flush)
        for (item, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # its caller stopped waiting (cancelled) while the call was on the wire
                if self._abandoned is not None:
                    self._abandoned(item, outcome)
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def close(self, timeout: float) -> None:
        """Let the batches on the wire finish (their callers are waiting for them), within ``timeout``."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


def follow_up(tasks: set[asyncio.Task[Any]], work: Coroutine[Any, Any, Any], what: str) -> None:
    """Run ``work`` in the background (an abandoned call's undo), keeping it referenced in ``tasks`` until done; a
    failure is logged as ``what`` failing, never left unretrieved."""
    task = asyncio.ensure_future(work)
    tasks.add(task)

    def done(finished: asyncio.Task[Any]) -> None:
        tasks.discard(finished)
        if not finished.cancelled() and finished.exception() is not None:
            log.warning("%s failed (%s)", what, type(finished.exception()).__name__)

    task.add_done_callback(done)


def _copy(exc: Exception) -> Exception:
    """The batch's failure for one caller: its own instance, so raising it in many tasks does not grow one
    traceback across all of them."""
    try:
        one = copy.copy(exc)
    except Exception:  # an exception type that cannot be rebuilt from its arguments
        return exc
    one.__cause__, one.__context__ = exc.__cause__, exc.__context__
    return one
