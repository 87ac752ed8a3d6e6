"""hafailover for asyncio: the same connections, sessions, producers, consumers and
browsers, with the same failover (F1-F14), awaited instead of blocked on.

Each object here holds its threaded twin (``hafailover.driver``) and adds no rule of its own:
the sessions core decides, the threaded driver carries out, and this module only chooses
where to wait. Why not a second driver on asyncio streams: docs/aio.md (a bridge whose cost
is measured by benchmarks/aio.py).

- A call that can be answered at once runs on the event loop's thread: a send is written
  there (``block=False``: the driver raises WouldBlock, with the wait it needs, instead of
  waiting); a receive takes a buffered message there; a recover or a consumer's close is
  decided and queued there.
- A call that waits, for the broker's confirmation, for the connection to come back (F1),
  for room in the confirmation window, for the acknowledge F6 needs first, waits on the
  loop: the driver hands it the wait as a value (hafailover.core.waits) and the driver's
  one waiter serves it here as it serves a blocking call on a thread, with the same
  call_timeout and call_failover_timeout. Sessions and acknowledges are written as steps
  (each wait yielded) and run here the same way. The loop is woken by the one completion
  awaited, or by the driver's condition for any other change, through
  ``loop.call_soon_threadsafe``.
- Calls written as steps (committing, rolling back, a transacted send, subscribing,
  unsubscribing, browsing, a temporary queue, closing a session) run here the same way.
  The few steps that are socket I/O with no non-blocking form (an AMQP attach, declare or
  drain, joining a listener thread), and opening and closing the connection,
  are made on the loop's default executor: each is one request and its answer, bounded by
  the link, never a wait for a message or for a failover (those are waits on the loop).
  No thread of its own: nothing here holds a thread while the connection fails over.
- Cancelling a call that waits for the broker cancels the wait, never the call: a send
  whose confirmation had not come is reported in doubt (``SendCancelled`` in
  ``events()``, ``cancelled_in_doubt``), and sending the same Message object again reuses
  its duplicate id (F13), so a broker with duplicate detection stores it once. A
  cancelled commit, rollback, transaction end, unsubscribe or session close goes on in a
  task of the connection, so no session is left half-committed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Mapping
from typing import Any, ParamSpec, TypeVar

import attrs

from hafailover.ack_modes import AckMode, LinkReliability
from hafailover.core.report import FailoverReport
from hafailover.core.waits import CallBudget, Wait
from hafailover.destination import Destination
from hafailover.driver import (
    Browser,
    Connection,
    ConnectionEvent,
    ConnectionStatistics,
    Consumer,
    FailoverCompleted,
    Producer,
    SendCompletion,
    Session,
    nonblocking,
)
from hafailover.driver import connect as connect_threaded
from hafailover.driver.calls import WouldBlock
from hafailover.driver.consumer import DEFAULT_PREFETCH
from hafailover.driver.nonblocking import SendOptions
from hafailover.driver.producer import sent_id
from hafailover.driver.transactions import TransactionAttempt, TransactionBlock
from hafailover.driver.waits import Blocking, Steps, Waiter
from hafailover.errors import (
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    HaFailoverError,
)
from hafailover.message import Message, PropertyValue
from hafailover.protocols.base import LinkFactory
from hafailover.protocols.factory import make_link
from hafailover.url import FailoverPolicy

__all__ = [
    "AsyncBrowser",
    "AsyncConnection",
    "AsyncConsumer",
    "AsyncProducer",
    "AsyncSession",
    "AsyncTransactionAttempt",
    "AsyncTransactionBlock",
    "PendingSend",
    "SendCancelled",
    "connect",
]

log = logging.getLogger("hafailover")

P = ParamSpec("P")
R = TypeVar("R")

ExceptionListener = Callable[[HaFailoverError], Coroutine[Any, Any, None] | None]


@attrs.frozen
class SendCancelled:
    """A send's caller was cancelled before the broker confirmed it: the message may or
    may not be stored. Send the same Message object again to be safe with a broker that
    detects duplicates (F13)."""

    message_id: str | None  # None: cancelled before an id was given to a bare body
    destination: str | None


AsyncEvent = ConnectionEvent | SendCancelled


class _ReceiveTimeoutError(Exception):
    """A receive's own timeout passed with nothing to return (not an error: it returns
    None); kept apart from CallTimeoutError, which is a TimeoutError the caller must get."""


async def connect(
    url: str | FailoverPolicy,
    *,
    user: str | None = None,
    password: str | None = None,
    exception_listener: ExceptionListener | None = None,
    link_factory: LinkFactory = make_link,
) -> AsyncConnection:
    """Open a connection (``hafailover.connect``), without blocking the event loop.

    ``exception_listener`` is called on the loop, once per connection failure (F10); it may
    be a coroutine function. ``link_factory``: as for ``hafailover.connect``."""
    loop = asyncio.get_running_loop()
    # TCP/TLS connect and log in: blocking socket I/O, on the loop's default executor.
    connection = await loop.run_in_executor(
        None,
        functools.partial(
            connect_threaded, url, user=user, password=password, link_factory=link_factory
        ),
    )
    return AsyncConnection(connection, loop, exception_listener)


class AsyncConnection:
    """A connection that keeps working through failover; make one with ``await connect()``."""

    def __init__(
        self,
        connection: Connection,
        loop: asyncio.AbstractEventLoop,
        exception_listener: ExceptionListener | None,
    ) -> None:
        self.sync = connection  # the threaded connection underneath
        self.loop = loop
        self._on_exception = exception_listener
        self._streams: list[asyncio.Queue[AsyncEvent | None]] = []
        # Tasks between their first look at the driver and the end of their wait (read by
        # the driver's threads), and the futures of those waiting for the driver to change.
        self._watching = 0
        self._change_waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shut = False
        self._queued: collections.deque[tuple[Callable[..., object], tuple[object, ...]]] = (
            collections.deque()
        )
        self._queued_lock = threading.Lock()
        self._wake_pending = False
        self.cancelled_in_doubt: list[SendCancelled] = []
        connection.add_event_listener(self._event_from_driver)
        nonblocking.watch(connection, self._driver_changed)
        if exception_listener is not None:
            connection.set_exception_listener(self._exception_from_driver)

    # --- the bridge ---------------------------------------------------------------------------

    def _later(self, callback: Callable[..., object], *args: object) -> None:
        """From any thread: run ``callback`` on the loop, in order (dropped once the loop
        is closed). Calls queued while the loop has not run the last batch yet join it: a
        burst of confirmations or deliveries wakes the loop once, not once each."""
        with self._queued_lock:
            self._queued.append((callback, args))
            if self._wake_pending:
                return
            self._wake_pending = True
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._run_queued)

    def _run_queued(self) -> None:
        while True:
            with self._queued_lock:
                if not self._queued:
                    self._wake_pending = False
                    return
                batch = list(self._queued)
                self._queued.clear()
            for callback, args in batch:
                try:
                    callback(*args)
                except Exception:  # one failed callback must not lose the others
                    log.exception("hafailover.aio: a callback raised (ignored)")

    def _done_future(self, completion: SendCompletion) -> asyncio.Future[None]:
        """A future of the loop, done once ``completion`` is (its outcome stays the
        completion's to tell)."""
        future: asyncio.Future[None] = self.loop.create_future()
        if completion.done():
            future.set_result(None)
        else:
            completion.add_done_callback(lambda _: self._later(_wake, future))
        return future

    def _spawn(self, coroutine: Coroutine[Any, Any, R]) -> asyncio.Task[R]:
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _event_from_driver(self, event: ConnectionEvent) -> None:
        self._later(self._publish, event)

    def _exception_from_driver(self, error: HaFailoverError) -> None:
        self._later(self._tell_listener, error)

    def _publish(self, event: AsyncEvent) -> None:
        for stream in self._streams:
            stream.put_nowait(event)
        if isinstance(event, FailoverCompleted):
            # Confirmations awaited across the failover: ask the new link for them.
            self._ask_receipt()
        self._wake_waiters()  # the connection is back, or gone: waiting calls look again

    def _tell_listener(self, error: HaFailoverError) -> None:
        listener = self._on_exception
        if listener is None:
            return
        try:
            result = listener(error)
            if inspect.isawaitable(result):
                self._spawn(_logged(result, "an exception listener"))
        except Exception:
            log.exception("an exception listener raised (ignored)")

    def _ask_receipt(self) -> None:
        """Someone awaits a confirmation: ask the broker for one if no written frame has."""
        nonblocking.ask_for_receipt(self.sync)

    def _driver_changed(self) -> None:
        """On a driver thread, under its lock: something a waiting call may wait for."""
        if self._watching:
            self._later(self._wake_waiters)

    def _wake_waiters(self) -> None:
        waiters, self._change_waiters = self._change_waiters, []
        for waiter in waiters:
            _wake(waiter)

    async def _next_change(self, pause: float | None) -> None:
        """Until the driver changes something, or ``pause`` seconds (None: no limit)."""
        changed: asyncio.Future[None] = self.loop.create_future()
        self._change_waiters.append(changed)
        # No wait_for: it would make a task for every wait.
        expiry = None if pause is None else self.loop.call_later(pause, _wake, changed)
        try:
            await changed
        finally:
            if expiry is not None:
                expiry.cancel()

    async def _on_loop(self, wait: Wait[SendCompletion], deadline: float | None = None) -> None:
        """Serve ``wait`` on the loop with the driver's one waiter (its call_timeout and
        call_failover_timeout, as a blocking call waits). A ``deadline`` (loop time: the
        caller's own timeout) replaces both, and ends the wait with TimeoutError."""
        if deadline is not None:
            wait = attrs.evolve(wait, budget=CallBudget(math.inf))
        completion = wait.completion
        # Waiting for one call's answer: woken by that completion, not by every change.
        future = None if completion is None else self._done_future(completion)

        async def changed(pause: float) -> None:
            if deadline is not None:
                left = deadline - self.loop.time()
                if left <= 0:
                    raise TimeoutError
                pause = min(pause, left)
            if future is None:
                await self._next_change(pause)
            else:
                await asyncio.wait({future}, timeout=pause)

        # Told of every change only when not woken by a completion (so a burst of
        # confirmations does not wake the loop for each waiting send): counted before the
        # first look, so a change the driver makes after it is told.
        watching = 1 if future is None else 0
        self._watching += watching
        try:
            await Waiter(self.sync, wait).until(changed)
        finally:
            self._watching -= watching
            if future is not None:
                future.cancel()  # no longer waited for (a no-op once done)

    async def _completed(self, completion: SendCompletion) -> Message:
        """The message ``completion`` sent, once the broker confirmed it, waiting as
        ``completion.result()`` does; raises what it failed with."""
        if not completion.done():
            await self._on_loop(nonblocking.completion_wait(self.sync, completion))
        return _outcome(completion)

    async def _steps(self, steps: Steps[R]) -> R:
        """Run a call written as steps on the loop: each wait it yields served by the
        driver's waiter, a CallTimeoutError thrown back in where it was yielded; each
        blocking call made on the loop's default executor, its result sent back in."""
        sent: Any = None
        raised: BaseException | None = None
        making: asyncio.Future[Any] | None = None
        try:
            while True:
                try:
                    step = steps.send(sent) if raised is None else steps.throw(raised)
                except StopIteration as finished:
                    result: R = finished.value
                    return result
                sent = raised = None
                if isinstance(step, Blocking):
                    making = self.loop.run_in_executor(None, step.call)
                    try:
                        sent = await asyncio.shield(making)
                    except Exception as exc:  # noqa: BLE001 - the steps handle what it raised
                        raised = exc
                    making = None
                    continue
                try:
                    await self._on_loop(step)
                except CallTimeoutError as exc:
                    raised = exc
        finally:
            if making is None:
                steps.close()  # cancelled: the call stops where it waited
            else:
                # Cancelled while its thread makes a blocking call, which cannot be
                # stopped: the steps stop once it is over, so what they undo is done.
                making.add_done_callback(functools.partial(_close_after, steps))

    async def _steps_to_the_end(self, steps: Steps[R], what: str) -> R:
        """Run steps that change what the broker holds (a commit, a rollback, closing a
        session) to their end: cancelling the caller cancels its wait, never the call,
        which goes on (its failure then logged), so the driver's state stays whole."""
        running = self._spawn(self._steps(steps))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            if not running.done():
                running.add_done_callback(functools.partial(_log_failure, what))
            raise

    async def _until(self, attempt: Callable[[], R], timeout: float | None) -> R:
        """``attempt()`` until it does not raise WouldBlock, serving the wait it names
        (never blocking the loop); _ReceiveTimeoutError after ``timeout`` seconds (None: no limit)
        without an answer. A CallTimeoutError (call_timeout, call_failover_timeout) is the
        call's own failure and passes through."""
        deadline = None if timeout is None else self.loop.time() + timeout
        # Counted before the first look: a change the driver makes after it is told.
        self._watching += 1
        try:
            while True:
                try:
                    return attempt()
                except WouldBlock as blocked:
                    remaining = None if deadline is None else deadline - self.loop.time()
                    if remaining is not None and remaining <= 0:
                        raise _ReceiveTimeoutError from None
                    if blocked.wait is None:
                        await self._next_change(remaining)
                        continue
                    try:
                        await self._on_loop(blocked.wait, deadline)
                    except CallTimeoutError as exc:
                        if blocked.timed_out is None:
                            raise
                        blocked.timed_out(exc)  # raises what a blocking call would
        finally:
            self._watching -= 1

    def _cancelled(self, message: Message | bytes | str, destination: str | None) -> None:
        notice = SendCancelled(
            sent_id(message) if isinstance(message, Message) else None, destination
        )
        self.cancelled_in_doubt.append(notice)
        log.warning("a send was cancelled before the broker confirmed it: in doubt (%s)", notice)
        self._publish(notice)

    # --- public -------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def broker(self) -> str | None:
        return self.sync.broker

    @property
    def broker_detects_duplicates(self) -> bool:
        return self.sync.broker_detects_duplicates

    @property
    def state(self) -> str:
        return self.sync.state

    @property
    def reports(self) -> tuple[FailoverReport, ...]:
        return self.sync.reports

    def statistics(self) -> ConnectionStatistics:
        return self.sync.statistics()

    def events(self) -> AsyncIterator[AsyncEvent]:
        """The connection's events from now on (failure detected, failover completed or
        failed, sends cancelled in doubt), until it is closed."""
        stream: asyncio.Queue[AsyncEvent | None] = asyncio.Queue()
        self._streams.append(stream)
        return self._stream_events(stream)

    async def _stream_events(
        self, stream: asyncio.Queue[AsyncEvent | None]
    ) -> AsyncIterator[AsyncEvent]:
        try:
            while (event := await stream.get()) is not None:
                yield event
        finally:
            with contextlib.suppress(ValueError):
                self._streams.remove(stream)

    async def create_session(self, ack_mode: AckMode = AckMode.AUTO) -> AsyncSession:
        """A session (waits while the connection fails over, F1)."""
        session = await self._steps(nonblocking.create_session(self.sync, ack_mode))
        return AsyncSession(session, self)

    def start(self) -> None:
        """Start (or resume) delivery to consumers."""
        self.sync.start()

    def stop(self) -> None:
        self.sync.stop()

    async def close(self) -> None:
        """Close every session and the connection; waiting calls are released at once."""
        if self._shut:
            return
        self._shut = True
        try:
            # It joins the driver's threads and waits briefly for the broker's goodbye.
            await self.loop.run_in_executor(None, self.sync.close)
        finally:
            for stream in self._streams:
                stream.put_nowait(None)
            self._wake_waiters()


class AsyncSession:
    """A session: its producers, consumers, browsers, acknowledges and transactions."""

    def __init__(self, session: Session, connection: AsyncConnection) -> None:
        self.sync = session
        self.connection = connection

    @property
    def session_id(self) -> int:
        return self.sync.session_id

    @property
    def ack_mode(self) -> AckMode:
        return self.sync.ack_mode

    @property
    def transacted(self) -> bool:
        return self.sync.transacted

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def create_producer(
        self, destination: str | Destination | None = None, *, confirm: bool = True
    ) -> AsyncProducer:
        return AsyncProducer(self.sync.create_producer(destination, confirm=confirm), self)

    async def create_consumer(
        self,
        destination: str | Destination,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        reliability: LinkReliability | None = None,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
        dedup_file: str | None = None,
    ) -> AsyncConsumer:
        consumer = await self.connection._steps(
            nonblocking.create_consumer(
                self.sync,
                destination,
                selector=selector,
                prefetch=prefetch,
                reliability=reliability,
                dedup=dedup,
                max_redeliveries=max_redeliveries,
                dedup_file=dedup_file,
            )
        )
        return AsyncConsumer(consumer, self)

    async def create_durable_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_durable_consumer`` without blocking the loop (same options)."""
        consumer = await self.connection._steps(
            nonblocking.create_durable_consumer(self.sync, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def create_shared_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_shared_consumer`` without blocking the loop (same options)."""
        consumer = await self.connection._steps(
            nonblocking.create_shared_consumer(self.sync, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def create_shared_durable_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_shared_durable_consumer`` without blocking the loop."""
        consumer = await self.connection._steps(
            nonblocking.create_shared_durable_consumer(self.sync, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def unsubscribe(self, name: str) -> None:
        await self.connection._steps_to_the_end(
            nonblocking.unsubscribe(self.sync, name), "an unsubscribe"
        )

    def create_browser(self, queue: str | Destination) -> AsyncBrowser:
        return AsyncBrowser(self.sync.create_browser(queue), self.connection)

    async def create_temporary_queue(self) -> Destination:
        return await self.connection._steps(nonblocking.temporary_queue(self.sync))

    async def acknowledge(self, message: Message | None = None, *, confirm: bool = True) -> None:
        """CLIENT modes: acknowledge ``message`` (and, in CLIENT mode, every message this
        session delivered before it), or every message delivered when none is named (F8).
        ``confirm=False`` (a message only) as in ``Message.acknowledge``: not waited for."""
        if message is None and not confirm:
            raise ConfigurationError("confirm=False acknowledges one message: name it")
        await self.connection._steps(nonblocking.acknowledge(self.sync, message, confirm))

    async def release(self, message: Message) -> None:
        """CLIENT_INDIVIDUAL: give ``message`` back alone, as a failed delivery (as
        ``message.release()``, whose wait for a failover would block the loop)."""
        await self.connection._steps(nonblocking.release(message))

    async def recover(self) -> None:
        self.sync.recover()  # decided and queued under the lock: never waits

    async def commit(self) -> None:
        """Commit (as ``Session.commit``). Cancelled, the commit goes on without its caller."""
        await self.connection._steps_to_the_end(nonblocking.commit(self.sync), "a commit")

    async def rollback(self) -> None:
        """Roll back (as ``Session.rollback``). Cancelled, it goes on without its caller."""
        await self.connection._steps_to_the_end(nonblocking.rollback(self.sync), "a rollback")

    def transaction(self, *, retries: int = 3) -> AsyncTransactionBlock:
        """``session.transaction(retries=N)`` awaited: see AsyncTransactionBlock."""
        return AsyncTransactionBlock(self.sync.transaction(retries=retries), self.connection)

    async def close(self) -> None:
        await self.connection._steps_to_the_end(
            nonblocking.close_session(self.sync), "closing a session"
        )


class AsyncProducer:
    """Sends messages; ``send`` waits for the broker's confirmation without blocking."""

    def __init__(self, producer: Producer, session: AsyncSession) -> None:
        self.sync = producer
        self.session = session
        self._aio = session.connection
        # Sends that could not be written at once (failing over, the window full) wait in
        # order, and a send made while any waits joins them, each with its own deadline for
        # the connection to come back (call_failover_timeout from its own send call).
        self._backlog: collections.deque[
            tuple[
                Message | bytes | str,
                SendOptions,
                bool,
                asyncio.Future[SendCompletion],
                float | None,
            ]
        ] = collections.deque()
        self._writer: asyncio.Task[None] | None = None

    def send_nowait(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> PendingSend:
        """Send, and return an awaitable of the message as sent once the broker has it (at
        once for what it does not confirm). The message is written before this returns
        unless the connection is failing over or the confirmation window is full; then the
        producer's task writes it, in order, as soon as it can be (in a transacted session,
        also once its transaction is begun). Awaited, it waits as the threaded ``result()``
        does (the call timeouts). Sends not awaited are confirmed together, as
        ``send_async`` sends are."""
        options = (destination, headers, persistent, priority, time_to_live)
        return PendingSend(self._submit(message, options, receipt=False), self._aio)

    async def send(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> Message:
        """Send and wait until the broker has it (F1, F3); returns the message as sent.
        Cancelled before that, the send goes on and is reported in doubt (SendCancelled)."""
        options = (destination, headers, persistent, priority, time_to_live)
        submitted = self._submit(message, options, receipt=True)
        try:
            if not isinstance(submitted, SendCompletion):
                submitted = await submitted  # queued: written later
            return await self._aio._completed(submitted)
        except asyncio.CancelledError:
            # Only the wait is cancelled: the send itself goes on.
            target = destination if destination is not None else self.sync.destination
            self._aio._cancelled(message, None if target is None else str(target))
            raise

    def _submit(
        self, message: Message | bytes | str, options: SendOptions, *, receipt: bool
    ) -> SendCompletion | asyncio.Future[SendCompletion]:
        """Written now (its completion), or queued behind the sends that wait (a future
        of its completion, once written)."""
        connection = self._aio
        if not self._backlog:
            try:
                return nonblocking.send_now(
                    self.sync, message, options, receipt=receipt, failover_deadline=None
                )
            except WouldBlock:
                pass
        # It must wait (failing over, the window full): so must every send after it, to
        # keep this producer's order. One task writes them as soon as they can go.
        written: asyncio.Future[SendCompletion] = connection.loop.create_future()
        deadline = nonblocking.failover_deadline(connection.sync)
        self._backlog.append((message, options, receipt, written, deadline))
        if self._writer is None:
            self._writer = connection._spawn(self._write_backlog())
        return written

    async def _write_backlog(self) -> None:
        connection = self._aio
        sync = self.sync
        try:
            while self._backlog:
                message, options, receipt, written, failover_deadline = self._backlog[0]
                try:
                    if sync.session.transacted:
                        # Its transaction may have to be begun first.
                        completion = await connection._steps(
                            nonblocking.send(sync, message, options, receipt=receipt)
                        )
                    else:
                        # Written at once while it can be: a burst waits once, not once each.
                        completion = await connection._until(
                            functools.partial(
                                nonblocking.send_now,
                                sync,
                                message,
                                options,
                                receipt=receipt,
                                failover_deadline=failover_deadline,
                            ),
                            None,
                        )
                except HaFailoverError as exc:
                    self._backlog.popleft()
                    if not written.done():
                        written.set_exception(exc)
                    continue
                self._backlog.popleft()
                if not written.done():
                    written.set_result(completion)
            # Whoever awaits these awaited before they were written: ask for them now.
            connection._ask_receipt()
        finally:
            self._writer = None

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every send of this producer has completed."""
        while (writer := self._writer) is not None:
            await asyncio.shield(writer)  # the sends still queued are written first
        wait = nonblocking.flush_wait(self.sync, timeout)
        if wait is not None:
            await self._aio._on_loop(wait)

    async def close(self) -> None:
        await self.flush()


class PendingSend:
    """A send of ``send_nowait``: await it for the message as sent, once the broker has it
    (waiting as the threaded completion's ``result()`` does)."""

    __slots__ = ("_aio", "_completion", "_queued_write")

    def __init__(
        self, sent: SendCompletion | asyncio.Future[SendCompletion], connection: AsyncConnection
    ) -> None:
        # A send written at once keeps the driver's completion, bridged to the loop only if
        # it is awaited before it is done: most of a pipelined burst never needs to be.
        self._completion = sent if isinstance(sent, SendCompletion) else None
        self._queued_write = None if isinstance(sent, SendCompletion) else sent
        self._aio = connection

    def __await__(self) -> Generator[Any, None, Message]:
        return self._awaited().__await__()

    async def _awaited(self) -> Message:
        completion = self._written_completion()
        if completion is None:
            assert self._queued_write is not None
            completion = self._completion = await self._queued_write
        return await self._aio._completed(completion)

    def _written_completion(self) -> SendCompletion | None:
        """Its completion, once written (raises what stopped it being written)."""
        if self._completion is None:
            written = self._queued_write
            assert written is not None
            if written.done():
                self._completion = written.result()
        return self._completion

    @property
    def message(self) -> Message | None:
        """The message as sent (with its id), once it was written; None before."""
        with contextlib.suppress(HaFailoverError):
            completion = self._written_completion()
            return None if completion is None else completion.message
        return None

    def done(self) -> bool:
        try:
            completion = self._written_completion()
        except HaFailoverError:
            return True
        return completion is not None and completion.done()

    def result(self) -> Message:
        """The message as sent, once done; raises what the send failed with."""
        completion = self._written_completion()
        if completion is None or not completion.done():
            raise asyncio.InvalidStateError("the send is not confirmed yet")
        return _outcome(completion)


def _outcome(completion: SendCompletion) -> Message:
    error = completion.exception()
    if error is not None:
        raise error
    assert completion.message is not None
    return completion.message


class AsyncConsumer:
    """Receives from one destination: ``await receive()`` or ``async for``."""

    def __init__(self, consumer: Consumer, session: AsyncSession) -> None:
        self.sync = consumer
        self.session = session
        self._aio = session.connection
        # Zero prefetch: messages a cancelled receive's thread took after its caller left.
        self._unclaimed: collections.deque[Message] = collections.deque()

    @property
    def destination(self) -> Destination:
        return self.sync.destination

    @property
    def duplicates_dropped(self) -> int:
        return self.sync.duplicates_dropped

    @property
    def rejected(self) -> int:
        """Poison messages this consumer rejected to the dead-letter address."""
        return self.sync.rejected

    async def _pull_one(self, timeout: float | None) -> Message | None:
        """Zero prefetch: credit only while a receive waits, asked for on the loop and
        waited for there. Timed out, the credit is taken back (a drain, blocking I/O on the
        default executor) and a message the broker sent with it is returned. Cancelled
        while waiting, a message that comes stays buffered for the next receive; cancelled
        while draining, one the drain brings is kept for it (in AUTO it is already
        acknowledged), never dropped."""
        if self._unclaimed:
            return self._unclaimed.popleft()
        try:
            return await self._aio._until(
                functools.partial(nonblocking.pull_now, self.sync), timeout
            )
        except _ReceiveTimeoutError:
            pass
        draining = self._aio.loop.run_in_executor(
            None, functools.partial(nonblocking.drain, self.sync)
        )
        try:
            return await asyncio.shield(draining)
        except asyncio.CancelledError:
            draining.add_done_callback(self._keep_unclaimed)
            raise

    def _keep_unclaimed(self, pulled: asyncio.Future[Message | None]) -> None:
        if not pulled.cancelled() and pulled.exception() is None:
            message = pulled.result()
            if message is not None:
                self._unclaimed.append(message)

    def _take_now(self) -> Message:
        message = nonblocking.receive_now(self.sync)
        if message is None:
            raise WouldBlock
        return message

    async def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: forever) without
        blocking the loop; None when none came. Waits through failover (F1); in AUTO,
        for the previous message's acknowledge when F6 needs it confirmed first."""
        if self.sync.prefetch == 0:
            return await self._pull_one(timeout)
        try:
            message = nonblocking.receive_now(self.sync)  # the common case: one is buffered
        except WouldBlock:
            pass
        else:
            if message is not None:
                return message
        try:
            return await self._aio._until(self._take_now, timeout)
        except _ReceiveTimeoutError:
            return None

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> Message:
        while True:
            try:
                message = await self.receive()
            except ConnectionClosedError:
                raise StopAsyncIteration from None
            if message is not None:
                return message

    async def close(self) -> None:
        """Stop the subscription; prefetched messages go back to the broker."""
        self.sync.close()  # decided and queued under the lock: never waits


class AsyncBrowser:
    """The messages waiting on a queue, without consuming them (F11): ``async for``."""

    def __init__(self, browser: Browser, connection: AsyncConnection) -> None:
        self.sync = browser
        self._aio = connection

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        connection = self._aio
        subscription = await connection._steps(nonblocking.browse_open(self.sync))
        try:
            while (
                message := await connection._steps(nonblocking.browse_next(self.sync, subscription))
            ) is not None:
                yield message
        finally:
            nonblocking.browse_end(self.sync, subscription)

    async def messages(self) -> list[Message]:
        return [message async for message in self]

    async def close(self) -> None:
        self.sync.close()  # never waits


class AsyncTransactionBlock:
    """``session.transaction(retries=N)`` for asyncio: the threaded block's attempts, its
    rules unchanged (retry a rolled-back commit, refuse an unknown outcome without duplicate
    detection), with the commit awaited::

        async for attempt in session.transaction(retries=3):
            async with attempt:
                for message in batch:
                    await producer.send(message)

    or decorate a coroutine function, which is then awaited once per attempt."""

    def __init__(self, block: TransactionBlock, connection: AsyncConnection) -> None:
        self._block = block
        self._aio = connection

    def __aiter__(self) -> AsyncIterator[AsyncTransactionAttempt]:
        return self._each_attempt()

    async def _each_attempt(self) -> AsyncIterator[AsyncTransactionAttempt]:
        for attempt in self._block:  # decides when to stop: no I/O of its own
            yield AsyncTransactionAttempt(attempt, self._aio)

    def __call__(self, function: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(function)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            async for attempt in self:
                async with attempt:
                    result = await function(*args, **kwargs)
                if attempt.committed:
                    return result
            raise AssertionError("unreachable: the attempts end by committing or raising")

        return run


class AsyncTransactionAttempt:
    """One run of the block: commits when it ends, rolls back when it raises."""

    def __init__(self, attempt: TransactionAttempt, connection: AsyncConnection) -> None:
        self.sync = attempt
        self._aio = connection

    @property
    def number(self) -> int:
        return self.sync.number

    @property
    def committed(self) -> bool:
        return self.sync.committed

    async def __aenter__(self) -> AsyncTransactionAttempt:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> bool:
        return await self._aio._steps_to_the_end(
            nonblocking.end_attempt(self.sync, error), "the end of a transaction attempt"
        )


def _close_after(steps: Steps[Any], making: asyncio.Future[Any]) -> None:
    """The blocking call of cancelled steps is over. What it made is handed to them, so
    that they record it (a transaction begun on the broker, a temporary queue made) up to
    their next wait; there they stop (their cleanup runs)."""
    try:
        if not making.cancelled() and making.exception() is None:
            with contextlib.suppress(StopIteration):
                steps.send(making.result())
        steps.close()
    except Exception:  # the caller is gone: nobody to raise to
        log.exception("hafailover.aio: cleaning up a cancelled call raised (ignored)")


def _log_failure(what: str, task: asyncio.Task[Any]) -> None:
    """A call whose caller was cancelled ended: nobody hears how, so a failure is logged."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("%s whose caller was cancelled failed: %s", what, error)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _logged(awaitable: Awaitable[object], what: str) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("%s raised (ignored)", what)
