"""hafailover for asyncio: the same connections, sessions, producers, consumers and
browsers, with the same failover (F1-F14), awaited instead of blocked on.

Each object here holds its threaded twin (``hafailover.driver``) and adds no rule of its own:
the sessions core decides, the threaded driver carries out, and this module only chooses
where to wait. Why not a second driver on asyncio streams: docs/aio.md (a bridge whose cost
is measured by benchmarks/aio.py).

- A call that can be answered at once runs on the event loop's thread: a send is written
  there (``block=False``: the driver raises WouldBlock instead of waiting), and its
  confirmation is a future, completed through ``loop.call_soon_threadsafe`` by the thread
  that hears the broker; a receive takes a buffered message there, and waits for the next
  on an ``asyncio.Event`` the driver sets when a delivery arrives.
- A call that would wait, for the connection to come back (F1), for room in the
  confirmation window, for a subscription, a commit or a close, runs on one of the
  connection's worker threads, so the loop never waits for the broker, not even while the
  connection fails over.
- Cancelling a call that waits for the broker cancels the wait, never the call: a send
  whose confirmation had not come is reported in doubt (``SendCancelled`` in
  ``events()``, ``cancelled_in_doubt``), and sending the same Message object again reuses
  its duplicate id (F13), so a broker with duplicate detection stores it once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, ParamSpec, TypeVar

import attrs

from hafailover.ack_modes import AckMode, LinkReliability
from hafailover.core.report import FailoverReport
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
)
from hafailover.driver import connect as connect_threaded
from hafailover.driver.calls import CallClock, WouldBlock
from hafailover.driver.consumer import DEFAULT_PREFETCH
from hafailover.driver.producer import sent_id
from hafailover.driver.transactions import TransactionAttempt, TransactionBlock
from hafailover.errors import ConnectionClosedError, HaFailoverError
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

# Worker threads per connection: each holds one call waiting for the broker or for the end
# of a failover, so as many calls as this may wait at once before the next queues.
_WORKERS: Final = 32

ExceptionListener = Callable[[HaFailoverError], Coroutine[Any, Any, None] | None]


@attrs.frozen
class SendCancelled:
    """A send's caller was cancelled before the broker confirmed it: the message may or
    may not be stored. Send the same Message object again to be safe with a broker that
    detects duplicates (F13)."""

    message_id: str | None  # None: cancelled before an id was given to a bare body
    destination: str | None


AsyncEvent = ConnectionEvent | SendCancelled
_SendOptions = tuple[
    str | Destination | None,
    Mapping[str, PropertyValue] | None,
    bool | None,
    int | None,
    float | None,
]


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
    workers = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="hafailover-aio")
    try:
        connection = await loop.run_in_executor(
            workers,
            functools.partial(
                connect_threaded, url, user=user, password=password, link_factory=link_factory
            ),
        )
    except BaseException:
        workers.shutdown(wait=False)
        raise
    return AsyncConnection(connection, loop, workers, exception_listener)


class AsyncConnection:
    """A connection that keeps working through failover; make one with ``await connect()``."""

    def __init__(
        self,
        connection: Connection,
        loop: asyncio.AbstractEventLoop,
        workers: ThreadPoolExecutor,
        exception_listener: ExceptionListener | None,
    ) -> None:
        self.sync = connection  # the threaded connection underneath
        self.loop = loop
        self._workers = workers
        self._exception_listener = exception_listener
        self._streams: list[asyncio.Queue[AsyncEvent | None]] = []
        # Tasks between their first look at the driver and the end of their wait (read by
        # the driver's threads), and the futures of those waiting for the driver to change.
        self._watching = 0
        self._change_waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._queued: collections.deque[tuple[Callable[..., object], tuple[object, ...]]] = (
            collections.deque()
        )
        self._queued_lock = threading.Lock()
        self._wake_pending = False
        self.cancelled_in_doubt: list[SendCancelled] = []
        connection.add_event_listener(self._event_from_driver)
        connection._cond.watcher = self._driver_changed
        if exception_listener is not None:
            connection.set_exception_listener(self._exception_from_driver)

    # --- the bridge ---------------------------------------------------------------------------

    async def _run(self, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a call that may wait on one of the connection's worker threads."""
        return await self.loop.run_in_executor(
            self._workers, functools.partial(function, *args, **kwargs)
        )

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

    def _future_of(
        self, completion: SendCompletion, future: asyncio.Future[Message | None] | None = None
    ) -> asyncio.Future[Message | None]:
        """A future (``future``, or a new one) finished like ``completion``, with the
        message it sent, if any."""
        if future is None:
            future = self.loop.create_future()
        if completion.done():
            _settle(future, completion)
        else:
            completion.add_done_callback(lambda done: self._later(_settle, future, done))
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
            self._ask_for_receipt()
        self._wake_waiters()  # the connection is back, or gone: waiting calls look again

    def _tell_listener(self, error: HaFailoverError) -> None:
        listener = self._exception_listener
        if listener is None:
            return
        try:
            result = listener(error)
            if inspect.isawaitable(result):
                self._spawn(_logged(result, "an exception listener"))
        except Exception:
            log.exception("an exception listener raised (ignored)")

    def _ask_for_receipt(self) -> None:
        """Someone awaits a confirmation: ask the broker for one if no written frame has."""
        sync = self.sync
        with sync._cond:
            sync._ask_for_receipt()

    def _driver_changed(self) -> None:
        """On a driver thread, under its lock: something a waiting call may wait for."""
        if self._watching:
            self._later(self._wake_waiters)

    def _wake_waiters(self) -> None:
        waiters, self._change_waiters = self._change_waiters, []
        for waiter in waiters:
            _wake(waiter)

    async def _within_call_timeout(self, future: asyncio.Future[Any]) -> bool:
        """Wait for ``future`` up to the call timeout, counting only time the connection is
        up (F1) and asking the broker for a receipt where a call waits for one, as a
        blocking call's wait does; whether it finished."""
        connection = self.sync
        clock = CallClock(connection.policy.call_timeout, connection._machine)
        while not future.done():
            if clock.expired:
                return False
            with connection._cond:
                connection._ask_for_receipt()
            await asyncio.wait({future}, timeout=clock.slice)
            clock.tick()
        return True

    async def _until(self, attempt: Callable[[], R], timeout: float | None) -> R:
        """``attempt()`` until it does not raise WouldBlock, looking again each time the
        driver changes (never blocking the loop); TimeoutError after ``timeout`` seconds
        (None: no limit) without an answer."""
        deadline = None if timeout is None else self.loop.time() + timeout
        # Counted before the first look: a change the driver makes after it is told.
        self._watching += 1
        try:
            while True:
                try:
                    return attempt()
                except WouldBlock as blocked:
                    if blocked.completion is not None:
                        # What it waits for is one call, up to the deadline: how that ended
                        # is for the next attempt to say.
                        future = self._future_of(blocked.completion)
                        left = None if deadline is None else deadline - self.loop.time()
                        if left is not None and left <= 0:
                            raise TimeoutError from None
                        if left is None and blocked.timed_out is not None:
                            # No timeout of the caller's: the call timeout, as a blocking
                            # call would wait (failing over does not count, F1).
                            if not await self._within_call_timeout(future):
                                blocked.timed_out()  # raises what a blocking call would
                            continue
                        finished, _ = await asyncio.wait({future}, timeout=left)
                        if not finished:
                            raise TimeoutError from None
                        with contextlib.suppress(HaFailoverError):
                            future.result()
                        continue
                remaining = None if deadline is None else deadline - self.loop.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                changed: asyncio.Future[None] = self.loop.create_future()
                self._change_waiters.append(changed)
                # Woken by a change, or at the deadline for one last look (no wait_for: it
                # would make a task for every wait).
                expiry = (
                    None if remaining is None else self.loop.call_later(remaining, _wake, changed)
                )
                try:
                    await changed
                finally:
                    if expiry is not None:
                        expiry.cancel()
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
        return self._drain(stream)

    async def _drain(self, stream: asyncio.Queue[AsyncEvent | None]) -> AsyncIterator[AsyncEvent]:
        try:
            while (event := await stream.get()) is not None:
                yield event
        finally:
            with contextlib.suppress(ValueError):
                self._streams.remove(stream)

    async def create_session(self, ack_mode: AckMode = AckMode.AUTO) -> AsyncSession:
        """A session (waits while the connection fails over, F1)."""
        return AsyncSession(await self._run(self.sync.create_session, ack_mode), self)

    def start(self) -> None:
        """Start (or resume) delivery to consumers."""
        self.sync.start()

    def stop(self) -> None:
        self.sync.stop()

    async def close(self) -> None:
        """Close every session and the connection; waiting calls are released at once."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._run(self.sync.close)
        finally:
            for stream in self._streams:
                stream.put_nowait(None)
            self._wake_waiters()
            self._workers.shutdown(wait=False)


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
        consumer = await self.connection._run(
            self.sync.create_consumer,
            destination,
            selector=selector,
            prefetch=prefetch,
            reliability=reliability,
            dedup=dedup,
            max_redeliveries=max_redeliveries,
            dedup_file=dedup_file,
        )
        return AsyncConsumer(consumer, self)

    async def create_durable_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_durable_consumer`` without blocking the loop (same options)."""
        consumer = await self.connection._run(
            functools.partial(self.sync.create_durable_consumer, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def create_shared_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_shared_consumer`` without blocking the loop (same options)."""
        consumer = await self.connection._run(
            functools.partial(self.sync.create_shared_consumer, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def create_shared_durable_consumer(
        self, topic: str | Destination, name: str, **options: Any
    ) -> AsyncConsumer:
        """``Session.create_shared_durable_consumer`` without blocking the loop."""
        consumer = await self.connection._run(
            functools.partial(self.sync.create_shared_durable_consumer, topic, name, **options)
        )
        return AsyncConsumer(consumer, self)

    async def unsubscribe(self, name: str) -> None:
        await self.connection._run(self.sync.unsubscribe, name)

    def create_browser(self, queue: str | Destination) -> AsyncBrowser:
        return AsyncBrowser(self.sync.create_browser(queue), self.connection)

    async def create_temporary_queue(self) -> Destination:
        return await self.connection._run(self.sync.create_temporary_queue)

    async def acknowledge(self, message: Message | None = None) -> None:
        """CLIENT modes: acknowledge ``message`` (and, in CLIENT mode, every message this
        session delivered before it), or every message delivered when none is named (F8)."""
        if message is None:
            await self.connection._run(self.sync.acknowledge)
        else:
            await self.connection._run(message.acknowledge)

    async def recover(self) -> None:
        await self.connection._run(self.sync.recover)

    async def commit(self) -> None:
        await self.connection._run(self.sync.commit)

    async def rollback(self) -> None:
        await self.connection._run(self.sync.rollback)

    def transaction(self, *, retries: int = 3) -> AsyncTransactionBlock:
        """``session.transaction(retries=N)`` awaited: see AsyncTransactionBlock."""
        return AsyncTransactionBlock(self.sync.transaction(retries=retries), self.connection)

    async def close(self) -> None:
        await self.connection._run(self.sync.close)


class AsyncProducer:
    """Sends messages; ``send`` waits for the broker's confirmation without blocking."""

    def __init__(self, producer: Producer, session: AsyncSession) -> None:
        self.sync = producer
        self.session = session
        self._connection = session.connection
        # Sends that could not be written at once (failing over, the window full) wait in
        # order, and a send made while any waits joins them.
        self._backlog: collections.deque[
            tuple[Message | bytes | str, _SendOptions, bool, asyncio.Future[Message]]
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
        unless the connection is failing over or the confirmation window is full; then it
        is sent from a worker thread as soon as it can be. Sends not awaited are confirmed
        together, as the threaded ``send_async`` is."""
        options = (destination, headers, persistent, priority, time_to_live)
        return PendingSend(self._submit(message, options, receipt=False), self._connection)

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
        sending: asyncio.Future[Message]
        if isinstance(submitted, SendCompletion):
            sending = self._connection._future_of(submitted)  # type: ignore[assignment]
        else:
            sending = submitted
        try:
            return await sending
        except asyncio.CancelledError:
            # Cancelling the wait cancelled ``sending`` too; the send itself goes on.
            target = destination if destination is not None else self.sync.destination
            self._connection._cancelled(message, None if target is None else str(target))
            raise

    def _submit(
        self, message: Message | bytes | str, options: _SendOptions, *, receipt: bool
    ) -> SendCompletion | asyncio.Future[Message]:
        """Written now (its completion), or queued behind the sends that wait (a future)."""
        connection = self._connection
        if not self._backlog:
            try:
                return self.sync._send(message, *options, receipt=receipt, block=False)
            except WouldBlock:
                pass
        # It must wait (failing over, the window full): so must every send after it, to
        # keep this producer's order. One task writes them as soon as they can go.
        sent: asyncio.Future[Message] = connection.loop.create_future()
        self._backlog.append((message, options, receipt, sent))
        if self._writer is None:
            self._writer = connection._spawn(self._write_backlog())
        return sent

    async def _write_backlog(self) -> None:
        connection = self._connection
        sync = self.sync
        failover_deadline = connection.sync._failover_deadline()
        try:
            while self._backlog:
                message, options, receipt, sent = self._backlog[0]
                try:
                    if sync.session.transacted:
                        # Its transaction may have to be begun, which can wait for the
                        # broker: written from a worker thread.
                        completion = await connection._run(
                            functools.partial(sync._send, message, *options, receipt=receipt)
                        )
                        self._backlog.popleft()
                        connection._future_of(completion, sent)  # type: ignore[arg-type]
                        continue
                    # Written at once while it can be: a burst waits once, not once each.
                    completion = await connection._until(
                        functools.partial(
                            sync._send,
                            message,
                            *options,
                            receipt=receipt,
                            block=False,
                            failover_deadline=failover_deadline,
                        ),
                        None,
                    )
                except HaFailoverError as exc:
                    self._backlog.popleft()
                    if not sent.done():
                        sent.set_exception(exc)
                    continue
                self._backlog.popleft()
                connection._future_of(completion, sent)  # type: ignore[arg-type]
            # Whoever awaits these awaited before they were written: ask for them now.
            connection._ask_for_receipt()
        finally:
            self._writer = None

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every send of this producer has completed."""
        while (writer := self._writer) is not None:
            await asyncio.shield(writer)  # the sends still queued are written first
        if self.sync._outstanding > 0:
            await self._connection._run(self.sync.flush, timeout)

    async def close(self) -> None:
        await self.flush()


class PendingSend:
    """A send of ``send_nowait``: await it for the message as sent, once the broker has it."""

    __slots__ = ("_completion", "_connection", "_future")

    def __init__(
        self, sent: SendCompletion | asyncio.Future[Message], connection: AsyncConnection
    ) -> None:
        # A send written at once keeps the driver's completion, bridged to the loop only if
        # it is awaited before it is done: most of a pipelined burst never needs to be.
        self._completion = sent if isinstance(sent, SendCompletion) else None
        self._future = None if isinstance(sent, SendCompletion) else sent
        self._connection = connection

    def __await__(self) -> Generator[Any, None, Message]:
        if self._future is None:
            completion = self._completion
            assert completion is not None
            if completion.done():
                return _outcome(completion)
            self._future = self._connection._future_of(completion)  # type: ignore[assignment]
        assert self._future is not None
        if not self._future.done():
            # Someone waits now: the broker is asked to confirm what has not asked yet.
            self._connection._ask_for_receipt()
        return (yield from self._future.__await__())

    @property
    def message(self) -> Message | None:
        """The message as sent (with its id), once it was written; None before."""
        if self._completion is not None:
            return self._completion.message
        assert self._future is not None
        if self._future.done() and not self._future.cancelled():
            return None if self._future.exception() else self._future.result()
        return None

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        assert self._completion is not None
        return self._completion.done()

    def result(self) -> Message:
        """The message as sent, once done; raises what the send failed with."""
        if self._future is not None:
            return self._future.result()
        assert self._completion is not None
        if not self._completion.done():
            raise asyncio.InvalidStateError("the send is not confirmed yet")
        return _outcome(self._completion)


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
        self._connection = session.connection

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

    def _take(self) -> Message:
        message = self.sync._receive_now()
        if message is None:
            raise WouldBlock
        return message

    async def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: forever) without
        blocking the loop; None when none came. Waits through failover (F1); in AUTO,
        for the previous message's acknowledge when F6 needs it confirmed first."""
        if self.sync.prefetch == 0:
            # Zero prefetch: credit only while a receive waits, so one waits in a thread.
            return await self._connection._run(self.sync.receive, timeout)
        try:
            message = self.sync._receive_now()  # the common case: one is buffered
        except WouldBlock:
            pass
        else:
            if message is not None:
                return message
        try:
            return await self._connection._until(self._take, timeout)
        except TimeoutError:
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
        await self._connection._run(self.sync.close)


class AsyncBrowser:
    """The messages waiting on a queue, without consuming them (F11): ``async for``."""

    def __init__(self, browser: Browser, connection: AsyncConnection) -> None:
        self.sync = browser
        self._connection = connection

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        iterator = iter(self.sync)
        done = object()
        while (message := await self._connection._run(next, iterator, done)) is not done:
            assert isinstance(message, Message)
            yield message

    async def messages(self) -> list[Message]:
        return await self._connection._run(self.sync.messages)

    async def close(self) -> None:
        await self._connection._run(self.sync.close)


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
        self._connection = connection

    def __aiter__(self) -> AsyncIterator[AsyncTransactionAttempt]:
        return self._attempts()

    async def _attempts(self) -> AsyncIterator[AsyncTransactionAttempt]:
        for attempt in self._block:  # decides when to stop: no I/O of its own
            yield AsyncTransactionAttempt(attempt, self._connection)

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
        self._connection = connection

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
        return await self._connection._run(self.sync.__exit__, kind, error, trace)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _settle(future: asyncio.Future[Message | None], completion: SendCompletion) -> None:
    if future.done():
        return  # its waiter was cancelled
    error = completion.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(completion.message)


async def _logged(awaitable: Awaitable[object], what: str) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("%s raised (ignored)", what)
