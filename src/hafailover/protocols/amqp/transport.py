"""The socket, the reader thread and the lock of one AMQP connection.

``engine.AmqpEngine`` is proton with no I/O; this module is the I/O. One lock
serializes the engine: a request is made under it and the bytes proton produced are taken
under it into the connection's ``Outbox`` (``protocols/outbox.py``), so they leave in the
order proton produced them; they are written after the engine lock is released, under the
outbox's write lock, and, for a request made under the driver's lock, only once that is
released too (``flush_later``). So a write the broker does not take never holds the engine
lock: the reader goes on reading, ticking proton's heart-beats and noticing the broker's
silence. One reader thread waits for the socket or for proton's next deadline (heart-beats,
the broker's silence), pushes what it read and writes what proton answers. No thread waits
in a write: each writes what the socket takes now; the rest stays first in the outbox, and
the reader (woken through an eventfd) polls for room while bytes are pending and no other
thread is writing, and writes them as room comes. The
events the engine queues are called with the lock released, by one thread at a time and in
the order they were queued: whichever thread queued them calls them, unless another is
calling events already, which then calls them too.

A call that waits for the broker (open, subscribe, declare, a temporary queue) blocks its
caller on the engine's ``Pending``, bounded by a timeout (a discharge may too, or be
answered as an event, ``discharge_later``); waiting on the reader
thread itself would deadlock, and raises IllegalStateError instead. A write that fails (or,
on close, does not finish within the socket's timeout) is a loss noticed by the writer: the
engine reports it once (``on_lost``), whatever thread noticed first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from hafailover.destination import Destination
from hafailover.errors import (
    CallTimeoutError,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
)
from hafailover.message import Message
from hafailover.protocols.amqp.codec import encode_message
from hafailover.protocols.amqp.engine import (
    AmqpEngine,
    AmqpEvents,
    AmqpTransaction,
    Outcome,
    Pending,
)
from hafailover.protocols.amqp.errors import map_errors
from hafailover.protocols.base import Opened, TlsOptions
from hafailover.protocols.outbox import Chunk, Outbox
from hafailover.url import BrokerAddress

__all__ = ["AmqpTransport"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a clean close waits for the broker's Close before dropping the socket.
_CLOSE_GRACE: Final = 2.0
_READ_SIZE: Final = 256 * 1024


class AmqpTransport:
    """A single AMQP 1.0 connection; ``open`` blocks until the broker's Open or failure."""

    def __init__(
        self,
        events: AmqpEvents,
        *,
        heartbeat: float = 1.0,
        connect_timeout: float = 5.0,
        call_timeout: float = 30.0,
        tls: TlsOptions | None = None,
        flush_later: Callable[[Callable[[], None]], None] | None = None,
        container_id: str | None = None,
    ) -> None:
        """``heartbeat``: the broker is declared dead after twice this many seconds of
        silence; the Open asks it to send something at least every ``heartbeat`` seconds
        (0 turns both off). ``connect_timeout`` bounds ``open``, ``call_timeout`` the other
        blocking calls unless they are given a timeout. ``tls``: how amqps checks the broker
        (the system's CAs and its host name by default) and shows itself. ``flush_later``:
        given the outbox's flush after a request queued bytes, to call once the caller's
        own locks are released (the driver's lock); None: flushed at once.
        ``container_id``: the Open's container id (a fresh one when None)."""
        self.events = events
        self.heartbeat = heartbeat
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.broker: BrokerAddress | None = None
        self._broker_redacted = "broker"  # named in every error: rendered once
        self._engine = AmqpEngine(events, heartbeat=heartbeat, tls=tls, container_id=container_id)
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._dispatching = False
        self._ended = threading.Event()  # the reader has left: the socket is closed
        self._outbox = Outbox(self._send_bytes, self._write_failed, self._send_some)
        # Wakes the reader when a thread left bytes the socket had no room for: the reader
        # writes them once there is (no application thread ever waits in a write).
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()  # closed under it: never written once closed
        self._flush_later = flush_later

    @property
    def serial(self) -> int:
        """Names this connection in the transactions it declares."""
        return self._engine.serial

    # --- opening ------------------------------------------------------------------------------

    def open(self, broker: BrokerAddress) -> Opened:
        """Connect, log in and open; raise NotConnectedError or SecurityError if that fails.

        A transport opens once: the driver makes a new one for every connection."""
        deadline = time.monotonic() + self.connect_timeout
        with self._lock:
            opening = self._engine.start(broker)
        self.broker = broker
        self._broker_redacted = broker.redacted()
        try:
            sock = socket.create_connection(
                (broker.host, broker.port), timeout=self.connect_timeout
            )
        except OSError as exc:
            with self._lock:
                self._engine.abort()
            self._close_wake()
            self._ended.set()
            raise NotConnectedError(f"cannot connect to {broker.redacted()}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bounds a write the broker does not take (its buffers full: a broker stopped, or
        # a network gone quiet); reads wait in poll() and never block on the timeout.
        sock.settimeout(2 * self.heartbeat if self.heartbeat > 0 else self.call_timeout)
        self._socket = sock
        reader = threading.Thread(
            target=self._read_loop, name=f"hafailover-amqp {broker.host}:{broker.port}", daemon=True
        )
        self._reader = reader
        try:
            return self._wait(
                lambda: opening, max(0.0, deadline - time.monotonic()), start=reader.start
            )
        except CallTimeoutError:
            self.abort()
            raise NotConnectedError(
                f"{broker.redacted()} did not open within {self.connect_timeout:g}s"
            ) from None
        except HaFailoverError:
            self.abort()
            raise

    # --- sending ------------------------------------------------------------------------------

    def send(
        self,
        token: int | None,
        destination: Destination,
        message: Message,
        *,
        duplicate_detection: bool,
        tx: AmqpTransaction | None = None,
    ) -> int:
        """Send without waiting; the broker's outcome arrives as ``on_settled(token, ...)``
        (None: nobody waits for it, ``AmqpEngine.transfer``; any outcome comes as token 0).

        Returns the size of the encoded message in bytes."""
        engine = self._engine
        with self._lock:
            engine.check_transaction(tx)
            address = engine.address(destination)
            durable = engine.durable_node(destination)
            reply_to = None if message.reply_to is None else engine.address(message.reply_to)
        # Encoded outside the lock: the reader goes on meanwhile.
        with map_errors(self._broker_text()):
            payload = encode_message(
                message, address, reply_to=reply_to, duplicate_detection=duplicate_detection
            )
        self._request(lambda: engine.transfer(token, address, durable, payload, tx))
        return len(payload)

    # --- receiving ----------------------------------------------------------------------------

    def subscribe(
        self,
        subscription_id: str,
        destination: Destination,
        *,
        credit: int,
        settle_on_delivery: bool,
        durable_name: str | None = None,
        timeout: float | None = None,
        browse: bool = False,
        shared_name: str | None = None,
    ) -> None:
        """Attach a receiver and wait until the broker has (``AmqpEngine.subscribe``)."""
        self._wait(
            lambda: self._engine.subscribe(
                subscription_id,
                destination,
                credit=credit,
                settle_on_delivery=settle_on_delivery,
                durable_name=durable_name,
                browse=browse,
                shared_name=shared_name,
            ),
            timeout,
        )

    def pull(self, subscription_id: str) -> None:
        """A pull subscription's receive waits: one credit (``AmqpEngine.pull``)."""
        self._request(lambda: self._engine.pull(subscription_id))

    def drain(self, subscription_id: str, *, timeout: float | None = None) -> None:
        """Take a pull's credit back and wait until the broker has used or returned it."""
        self._wait(lambda: self._engine.drain(subscription_id), timeout)

    def remove_subscription(
        self, subscription_id: str, name: str, *, timeout: float | None = None
    ) -> None:
        """Delete the durable subscription ``name``: attach to it by name alone and wait,
        then close the link (``AmqpEngine.attach_subscription``)."""
        self._wait(lambda: self._engine.attach_subscription(subscription_id, name), timeout)
        self.unsubscribe(subscription_id, remove_durable=True)

    def settle(
        self,
        delivery: int,
        outcome: Outcome,
        *,
        tx: AmqpTransaction | None = None,
        token: int | None = None,
    ) -> None:
        """Settle a received message without waiting (``AmqpEngine.settle``)."""
        self._request(lambda: self._engine.settle(delivery, outcome, tx=tx, token=token))

    def unsubscribe(self, subscription_id: str, *, remove_durable: bool = False) -> None:
        """Stop a subscription without waiting; its unsettled messages go back to the broker.
        A durable subscription is kept on the broker unless ``remove_durable``."""
        self._request(
            lambda: self._engine.unsubscribe(subscription_id, remove_durable=remove_durable)
        )

    def create_temporary_queue(self, *, timeout: float | None = None) -> Destination:
        """A queue that lives as long as this connection (or ``delete_temporary_queue``)."""
        return self._wait(self._engine.create_temporary_queue, timeout)

    def alias_temporary_queue(self, alias: Destination, created: Destination) -> None:
        """Let ``alias`` (a temporary queue of an earlier connection) name ``created``."""
        with self._lock:
            self._engine.alias_temporary_queue(alias, created)

    def delete_temporary_queue(self, destination: Destination) -> None:
        self._request(lambda: self._engine.delete_temporary_queue(destination))

    # --- transactions -------------------------------------------------------------------------

    def declare(self, *, timeout: float | None = None) -> AmqpTransaction:
        """Declare a local transaction and wait for its id."""
        return self._wait(self._engine.declare, timeout)

    def discharge(self, tx: AmqpTransaction, *, fail: bool, timeout: float | None = None) -> None:
        """Commit (``fail=False``) or roll back, and wait until the broker has settled it.

        Raises ProtocolError if the broker refuses; a commit cut by the loss of the
        connection raises TransactionOutcomeUnknownError."""
        self._wait(lambda: self._engine.discharge(tx, fail=fail), timeout)

    def discharge_later(self, tx: AmqpTransaction, *, fail: bool, token: int) -> None:
        """Commit or roll back without waiting: the broker's answer (or the loss that cut
        it) arrives as ``on_settled(token, error)``, as a send's outcome does."""
        self._request(lambda: self._discharge(tx, fail=fail, token=token))

    def _discharge(self, tx: AmqpTransaction, *, fail: bool, token: int) -> None:
        self._engine.discharge(tx, fail=fail, token=token)

    # --- ending -------------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye (Close) and wait briefly for the broker's; never hangs."""
        self._finish(clean=True)

    def abort(self) -> None:
        """Drop the socket without a Close."""
        self._finish(clean=False)

    def _finish(self, *, clean: bool) -> None:
        with self._lock:
            if clean:
                self._engine.close()
            else:
                self._engine.abort()
            self._flush()
        self._dispatch()
        self._outbox.flush()
        reader = self._reader
        here = threading.current_thread()
        if reader is None or reader.ident is None:  # never started: nobody else closes it
            self._close_socket()
            self._close_wake()
            self._ended.set()
            return
        if reader is not here:
            self._ended.wait(min(_CLOSE_GRACE, self.connect_timeout) if clean else 0.0)
        with self._lock:
            if not self._engine.ended:
                self._engine.abort()  # the broker did not answer the Close in time
        self._dispatch()
        self._wake_reader()
        if reader is not here:
            reader.join(_CLOSE_GRACE + 2.0)

    # --- under the lock -----------------------------------------------------------------------

    def _request(self, request: Callable[[], None]) -> None:
        """Make a request that does not wait, write what it produced, call its events."""
        with self._lock:
            request()
            events = self._flush()
        if events:
            self._dispatch()
        if self._outbox.pending:
            if self._flush_later is None:
                self._write_now()
            else:
                self._flush_later(self._write_now)

    def _wait(
        self,
        request: Callable[[], Pending[T]],
        timeout: float | None,
        *,
        start: Callable[[], None] | None = None,
    ) -> T:
        if threading.current_thread() is self._reader:
            raise IllegalStateError(
                "a call that waits for the broker, made on the thread that reads its answers, "
                "would never end: make it from another thread"
            )
        answered = threading.Event()
        with self._lock:
            pending = request()
            pending.notify = answered.set
            if pending.done:
                answered.set()
            events = self._flush()
        if start is not None:
            start()
        if events:
            self._dispatch()
        self._write_now()  # a call that waits is made without the driver's lock
        limit = self.call_timeout if timeout is None else timeout
        if not answered.wait(limit):
            with self._lock:
                if not pending.done:
                    pending.abandoned = True
                    raise CallTimeoutError(f"{pending.what}: no answer within {limit:g}s")
        return pending.result()

    def _flush(self) -> bool:
        """Under the lock: queue what proton has to say in the outbox (written once the
        lock is released); return whether events are queued."""
        engine = self._engine
        data = engine.output()
        if data and self._socket is not None:
            self._outbox.put(data)
        return engine.has_events

    def _write_now(self) -> None:
        """Write what the socket takes now; leave the rest to the reader (woken for it)."""
        outbox = self._outbox
        outbox.flush(wait=False)
        if outbox.pending:
            with self._wake_lock:
                if self._wake >= 0:
                    os.eventfd_write(self._wake, 1)

    def _close_wake(self) -> None:
        with self._wake_lock:
            wake, self._wake = self._wake, -1
        if wake >= 0:
            os.close(wake)

    def _send_bytes(self, data: Chunk) -> None:
        """The outbox's write (under its write lock only). The socket's timeout bounds a
        write the broker does not take."""
        sock = self._socket
        if sock is None:
            raise NotConnectedError(f"{self._broker_text()}: the connection is not open")
        sock.sendall(data)

    def _send_some(self, data: Chunk) -> int:
        """The reader's write: what the socket takes now, never waiting. Straight to the
        descriptor, which a socket with a timeout keeps non-blocking (its ``send`` would
        wait for room first)."""
        sock = self._socket
        if sock is None:
            raise NotConnectedError(f"{self._broker_text()}: the connection is not open")
        try:
            return os.write(sock.fileno(), data)
        except BlockingIOError:
            return 0

    def _write_failed(self, error: Exception) -> None:
        """A write failed or did not finish within the idle timeout: the connection's loss,
        noticed by the writer (reported once, whichever thread noticed first)."""
        reason = "no write within the idle timeout" if isinstance(error, TimeoutError) else error
        with self._lock:
            self._engine.input_closed(f"writing failed: {reason}", time.monotonic())
        self._wake_reader()
        self._dispatch()

    # --- the reader thread --------------------------------------------------------------------

    def _read_loop(self) -> None:
        sock = self._socket
        assert sock is not None
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        wake = self._wake  # closed by this thread only, as it leaves
        poller.register(wake, select.POLLIN)
        engine = self._engine
        outbox = self._outbox
        ready: list[tuple[int, int]] = []
        deadline = 0.0
        try:
            while True:
                now = time.monotonic()
                if deadline and now >= deadline and not _readable(ready, wake):
                    # Proton's deadline has passed. What the broker sent while this thread
                    # waited for a processor, or called events, is read before proton
                    # judges it silent; and ``now``, taken before this look, leaves out
                    # the wait for the lock below.
                    ready = poller.poll(0)
                if any(fd == wake for fd, _ in ready):
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(wake)
                if _readable(ready, wake):
                    try:
                        data = sock.recv(_READ_SIZE)
                        reason = "" if data else "closed by the broker"
                    except OSError as exc:
                        data, reason = b"", f"reading failed: {exc}"
                    with self._lock:
                        if data:
                            engine.received(data, time.monotonic())
                        else:
                            engine.input_closed(reason, time.monotonic())
                        # Flushed before the tick, as the loop always did: without it the
                        # amqps opening stalled (test_amqps_verifies_the_broker_...).
                        self._flush()
                    now = time.monotonic()
                with self._lock:
                    deadline = engine.tick(now)
                    self._flush()
                    ended = engine.ended
                self._dispatch()
                # Never blocking: what the socket does not take now stays queued, and is
                # written when it is writable again (or by a writer meanwhile).
                outbox.flush(wait=False)
                if ended:
                    return
                wait = None if not deadline else max(0.0, deadline - time.monotonic())
                writable = outbox.pending and not outbox.writing
                poller.modify(sock, select.POLLIN | select.POLLOUT if writable else select.POLLIN)
                ready = poller.poll(None if wait is None else wait * 1000.0)
        except Exception:  # a bug here must end the connection, not leave it hanging
            log.exception("amqp %s: the reader failed", self._broker_text())
            with self._lock:
                engine.input_closed("the reader failed", time.monotonic())
            self._dispatch()
        finally:
            self._close_socket()
            self._close_wake()
            self._ended.set()

    def _dispatch(self) -> None:
        """Call the queued events, in order, one thread at a time, without the lock."""
        while True:
            with self._lock:
                if self._dispatching:
                    return  # the thread calling events now calls these too
                events = self._engine.take_events()
                if not events:
                    return
                self._dispatching = True
            try:
                for callback, args in events:
                    self._call(callback, args)
            finally:
                with self._lock:
                    self._dispatching = False

    def _call(self, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            callback(*args)
        except Exception:  # a driver callback that raises must not end the connection
            log.exception("amqp %s: event callback %r failed", self._broker_text(), callback)

    def _wake_reader(self) -> None:
        sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _close_socket(self) -> None:
        sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _broker_text(self) -> str:
        return self._broker_redacted


def _readable(ready: list[tuple[int, int]], wake: int) -> bool:
    """Whether ``poll`` found the socket readable (or closed, or failed): anything but the
    wake-up descriptor and room to write."""
    return any(fd != wake and mask & ~select.POLLOUT for fd, mask in ready)
