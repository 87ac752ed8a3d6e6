"""A consumer of the threaded driver: its subscription, prefetch buffer and the automatic
acknowledges of AUTO and DUPS_OK sessions.

Which deliveries are stale after a failover, and what an acknowledge that cannot be sent
means, is the acknowledge-mode rules' decision (``ack_modes``); this module buffers,
hands out and writes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

from hafailover.ack_modes import AckAction
from hafailover.core.dedup import DuplicateWindow, Remembered, remembered_at, replay
from hafailover.core.failover import Admission
from hafailover.core.inflight import CallKind
from hafailover.core.subscriptions import NamedSubscription, RedeliveryLimit
from hafailover.destination import Destination
from hafailover.driver import tracing
from hafailover.driver.calls import WouldBlock, error_for
from hafailover.driver.completions import SendCompletion
from hafailover.driver.dedup_file import DedupFile
from hafailover.driver.waits import Steps, run_steps
from hafailover.errors import (
    AcknowledgeFailedError,
    ConfigurationError,
    ConnectionClosedError,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.base import Link

if TYPE_CHECKING:
    from hafailover.driver.session import Session

__all__ = ["DEFAULT_PREFETCH", "Consumer", "stable_id"]

DEFAULT_PREFETCH: Final = 100

log = logging.getLogger("hafailover")


class Consumer:
    """Receives from one destination, with receive() or a message listener."""

    def __init__(
        self,
        session: Session,
        subscription: str,
        destination: Destination,
        prefetch: int,
        selector: str | None = None,
        *,
        dedup: int = 0,
        dedup_file: DedupFile | None = None,
        named: NamedSubscription | None = None,
        max_redeliveries: int = -1,
    ) -> None:
        self.session = session
        # A durable or shared subscription: subscribed by this name on every link (F5).
        self.named = named
        # Poison messages: past this many failures a delivery is rejected, not handed out.
        self._redelivery = RedeliveryLimit(max_redeliveries)
        self.rejected = 0  # deliveries rejected to the dead-letter address
        self.selector = selector
        self.subscription = subscription
        self.destination = destination
        self.prefetch = prefetch
        self._buffer: collections.deque[tuple[int, str, Message]] = collections.deque()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Tags this consumer gave back (NACK) in the broker session a reattach keeps: the
        # reattach extension never reuses a tag within a session (docs/protocol-reattach.md).
        self._given_back: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._listener: Callable[[Message], None] | None = None
        self._closed = False
        self._on_link = 0  # serial of the link this consumer is subscribed on
        self._subscribed: SendCompletion | None = None  # the broker's answer to subscribing
        # Consumer-side duplicate suppression (dedup.py): None when off; kept in
        # ``dedup_file`` across restarts when one is given.
        self._dedup_file = dedup_file
        self._dedup: DuplicateWindow | None = None
        if dedup:
            kept: tuple[str, ...] = ()
            if dedup_file is not None:
                kept, skipped = replay(dedup_file.read(), dedup)
                if skipped:
                    log.warning(
                        "%s: skipped %d damaged record(s) (a torn write); kept %d id(s)",
                        dedup_file.path,
                        skipped,
                        len(kept),
                    )
            self._dedup = DuplicateWindow(dedup, journal=dedup_file, kept=kept)
        self._remembered_at = remembered_at(session.ack_mode)
        # Ids delivered and not yet acknowledged or committed: a copy of one is dropped too,
        # since the application holds the first (which the broker redelivers if its
        # acknowledge fails).
        self._held_ids: set[str | None] = set()
        self.duplicates_dropped = 0

    @property
    def _acknowledged(self) -> bool:
        return self.session.rules.acknowledges_deliveries

    def _subscribe_on(self, link: Link) -> None:
        """Subscribe on ``link``, once per link: a consumer created during a failover is
        subscribed by the recreation or by its own creation, whichever comes first.

        Called without the connection's lock: decided under it, and written under it too
        unless the link's calls wait for the broker."""
        token = self._subscribe_decided(link)
        if token is not None:
            self._write_subscription(link, token)

    def _subscribe_decided(self, link: Link) -> int | None:
        """Under the lock, ``_subscribe_on`` up to the write: the token to write the
        subscription with once the lock is let go (a link whose calls block), else None
        (written already, or subscribed on this link before)."""
        connection = self.session.connection
        with connection._cond:
            if self._on_link == link.serial:
                return None
            self._on_link = link.serial
            completion = SendCompletion(connection, None)
            token = connection._call(CallKind.SUBSCRIBE, completion, self.session, consumer=self)
            self._subscribed = completion
            if not link.calls_block:
                self._write_subscription(link, token)
                return None
        return token

    def _write_subscription(self, link: Link, token: int) -> None:
        connection = self.session.connection
        # Its place in the confirmation window: a reattach whose server got the SUBSCRIBE
        # completes it even when the receipt was lost with the connection.
        command_id = connection._window.next_id if link.windowed else -1
        try:
            link.subscribe(
                self.subscription,
                self.destination,
                acknowledged=self._acknowledged,
                prefetch=self.prefetch,
                selector=self.selector,
                token=token,
                named=self.named,
            )
        except BaseException as exc:
            with connection._cond:
                self._on_link = 0
                if isinstance(exc, HaFailoverError) and not isinstance(
                    exc, NotConnectedError | UnblockedError
                ):
                    # Refused or timed out: no answer will come. A lost link's calls are
                    # the failover's to settle, as every other call cut by the loss.
                    connection._abandon(token, exc)
            raise
        if not link.calls_block:
            connection._written(token, link, command_id, asked=True)

    def _arrived(self, tag: str, message: Message) -> None:
        """Under the lock, from the transport: buffer a delivery (dropping reattach repeats)."""
        if self._closed:
            return
        if tag in self._given_back:
            # Given back already: a reattached server sends it again under the same tag
            # until it has read the give-back, then delivers it anew under a new one.
            return
        seen = self._seen
        if tag in seen:
            return  # resent after a reattach while we still hold it
        seen[tag] = None
        if len(seen) > 4 * self.prefetch + 1000:
            seen.popitem(last=False)
        self._buffer.append((self.session.rules.generation, tag, message))
        connection = self.session.connection
        connection._cond.notify_all()

    def _given_back_on_session(self, tag: str) -> None:
        """Under the lock: ``tag`` went back to a broker that reattaches sessions."""
        given_back = self._given_back
        given_back[tag] = None
        if len(given_back) > 4 * self.prefetch + 1000:
            given_back.popitem(last=False)

    def _take(self) -> Message | None:
        """Under the lock: the next deliverable message, registered with the ack rules."""
        session = self.session
        rules = session.rules
        while self._buffer:
            generation, tag, message = self._buffer.popleft()
            if rules.prefetched_stale(generation):
                continue  # prefetched before a reconnect: the broker sends it again
            if message._sender_id and rules.redelivery_expected(
                self.subscription, message.message_id
            ):
                # F6: handed out before a reconnect lost its pipelined acknowledge.
                self._drop_duplicate(tag)
                continue
            if self._acknowledged and self._redelivery.exceeded(
                stable_id(message), message.delivery_count
            ):
                self._reject_poison(tag, message)
                continue
            dedup = self._dedup
            if dedup is not None:
                message_id = message.message_id
                if message_id is not None and (message_id in dedup or message_id in self._held_ids):
                    self._drop_duplicate(tag)
                    continue
                if self._remembered_at is Remembered.AT_DELIVERY:
                    dedup.remember((message_id,))
                else:
                    session._dedup_pending[tag] = (self, message_id)
                    self._held_ids.add(message_id)
            message.delivery = rules.delivered(tag)
            message._acknowledger = session._acknowledge_message
            message._releaser = self._release
            session._tag_subscriptions[tag] = self.subscription
            session.connection._received += 1
            return message
        return None

    def _reject_poison(self, tag: str, message: Message) -> None:
        """Under the lock: ``message`` failed more often than ``max_redeliveries`` allows;
        it goes to the broker's dead-letter address (NACK without requeue on STOMP, the
        rejected outcome on AMQP) and is reported. A reject that cannot be written now is
        not retried: the delivery comes again and is rejected again (its count is kept for
        that)."""
        connection = self.session.connection
        self.rejected += 1
        limit = self._redelivery
        log.warning(
            "consumer of %s rejected message %s to the dead-letter address after %d "
            "failed deliveries (max_redeliveries=%d)",
            self.destination,
            message.message_id,
            limit.failures(stable_id(message), message.delivery_count),
            limit.max_redeliveries,
        )
        link = connection._admitted_link()
        if link is None:
            return
        try:
            link.reject(self.subscription, tag)
        except HaFailoverError as exc:
            connection._io_failed(link, exc)

    def _drop_duplicate(self, tag: str) -> None:
        """Under the lock: a delivery whose id this consumer had delivered and acknowledged
        already: acknowledged on the wire, never handed out. An acknowledge that cannot be
        written now is not retried: the broker delivers it again, and it is dropped again."""
        connection = self.session.connection
        self.duplicates_dropped += 1
        connection._duplicates_dropped += 1
        link = connection._admitted_link()
        if not self._acknowledged or link is None:
            return
        try:
            link.acknowledge(self.subscription, tag, tx=None, token=None)
        except HaFailoverError as exc:
            connection._io_failed(link, exc)

    def _after_delivery(self, message: Message) -> None:
        """The automatic acknowledge of AUTO / DUPS_OK (F6, F7)."""
        session = self.session
        connection = session.connection
        with connection._cond:
            decision = session.rules.after_delivery(message.delivery)
            if decision.action is AckAction.SEND:
                link = connection._admitted_link()
                failure: HaFailoverError | None = None
                if link is not None:
                    failure = self._acknowledge_now(link, decision.tags, message)
                    if failure is None:
                        return
                # Given up: if a reattach brings it again, it is delivered again.
                session._forget_seen(decision.tags)
                session._auto_ack_superseded()
                decision = session.rules.acknowledge_not_sent()
                if decision.action is AckAction.RAISE:
                    why = f"({failure})" if failure is not None else "(failing over)"
                    raise AcknowledgeFailedError(
                        f"the acknowledge could not be sent {why}; the message may be "
                        "delivered again"
                    ) from failure
                return
            if decision.action is AckAction.RAISE:
                assert decision.code is not None
                session._auto_ack_superseded()
                raise error_for(
                    decision.code,
                    "the message was delivered before a failover and its acknowledge could "
                    "not be sent; it may be delivered again",
                )

    def _listener_failed(self, message: Message) -> None:
        """Under the lock: this consumer's listener raised on ``message``; the session's
        rules say whether it goes back to the broker (AUTO, DUPS_OK) or stays the
        application's to acknowledge, commit or recover."""
        session = self.session
        delivery = message.delivery
        if delivery is None:
            return
        decision = session.rules.listener_failed(delivery)
        if decision.action is not AckAction.REDELIVER:
            return
        self._failed_delivery(message, decision.tags)

    def _release(self, message: Message) -> None:
        """Message.release() of a message this consumer handed out."""
        run_steps(self.session.connection, self._release_steps(message))

    def _release_steps(self, message: Message) -> Steps[None]:
        """The same as steps, for a caller that serves the waits its own way (asyncio)."""
        return self.session._release_message_steps(message, self)

    def _failed_delivery(self, message: Message, tags: tuple[str, ...]) -> None:
        """Under the lock: ``message`` goes back as a failed delivery (a listener raised, or
        the application released it): the broker counts it, and so does max_redeliveries
        here (a give-back lost with the connection still counts)."""
        session = self.session
        self._redelivery.failed(stable_id(message), message.delivery_count)
        if self._dedup is not None and self._remembered_at is Remembered.AT_DELIVERY:
            self._dedup.forget(message.message_id)  # its redelivery is no duplicate
        session._forget_seen(tags)
        session._give_back(tags)

    def _acknowledge_now(
        self, link: Link, tags: tuple[str, ...], message: Message
    ) -> HaFailoverError | None:
        """Under the lock: write the automatic acknowledges; the write's error, if any.

        AUTO confirms each acknowledge, before the next delivery unless the rules let it be
        pipelined (F6: only the last delivered message may come again); DUPS_OK does not
        wait (F7)."""
        session = self.session
        connection = session.connection
        confirm = session.rules.confirms_acknowledges
        pipelined = confirm and session.rules.pipelines(
            sender_id=message._sender_id and message.message_id is not None,
            block_on_acknowledge=connection.policy.block_on_acknowledge,
        )
        for tag in tags:
            subscription = session._tag_subscriptions.pop(tag, self.subscription)
            token = None
            if confirm:
                completion = SendCompletion(connection, None)
                token = connection._call(
                    CallKind.ACK,
                    completion,
                    session,
                    tag=tag,
                    acked_id=(message.message_id or "") if pipelined else "",
                    subscription=subscription,
                )
                session._auto_ack_written(completion, pipelined=pipelined)
            command_id = connection._window.next_id if link.windowed else -1
            # With cumulative receipts a pipelined acknowledge asks for one only now and
            # then: a later receipt confirms it too.
            ask = connection._core.asks_receipt(
                token, windowed=link.windowed, waited_for=not pipelined
            )
            try:
                link.acknowledge(subscription, tag, tx=None, token=token if ask else None)
            except HaFailoverError as exc:
                if token is not None:
                    connection._abandon(token, exc)
                    session._auto_ack = None  # reported here, not again by the next receive
                connection._io_failed(link, exc)
                return exc
            # The tag stays in _seen: a reattached server sends again what it had not had
            # acknowledged, and the replayed acknowledge settles that copy.
            connection._written(token, link, command_id, asked=ask)
        return None

    def _drop_buffer(self, *, give_back: bool) -> None:
        """Under the lock: forget prefetched messages (and NACK them if the link lives)."""
        buffered = [tag for _, tag, _ in self._buffer]
        self._buffer.clear()
        if give_back and buffered:
            session = self.session
            for tag in buffered:
                session._tag_subscriptions[tag] = self.subscription
            session._give_back(tuple(buffered))
        self._seen.clear()

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: forever); None when
        none came, or when the previous AUTO acknowledge F6 needs confirmed first was not
        confirmed in that time. Waits through failover (F1)."""
        self._check_receive()
        session = self.session
        connection = session.connection
        started = tracing.started()
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = connection._cond
        pulls = self.prefetch == 0  # zero prefetch: credit only while this waits (core/pull.py)
        drain_from: Link | None = None
        while True:
            drain = False
            with cond:
                if session._ack_blocking() is None:
                    message = self._next()
                    if message is not None:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        if not pulls:
                            return None
                        drain, drain_from = True, connection._admitted_link()
                    else:
                        if pulls:
                            self._pull()
                        cond.wait(remaining if remaining is not None else 1.0)
                        continue
            if drain:
                # Outside the lock: take the credit back; a message the broker sent with it
                # arrives first, and this receive returns it.
                message = self._drain(drain_from)
                if message is None:
                    return None
                break
            # Outside the lock: it may wait for an acknowledge (F6), or raise its failure.
            if not session._confirm_last_ack(deadline):
                return None
        self._hand_out(message, started)
        return message

    def _pull(self) -> None:
        """Under the lock: a pull consumer's receive waits; one credit on the current link
        (again on a new one after a failover, whose recreation attached with none)."""
        link = self.session.connection._admitted_link()
        if link is None or self._closed or self._on_link != link.serial:
            return  # failing over: the receive waits, and pulls on the new link
        with contextlib.suppress(HaFailoverError):
            link.pull(self.subscription)  # a lost link: the failover comes, then a new pull

    def _drain(self, link: Link | None) -> Message | None:
        """Without the lock: the pull's credit back from ``link``; the message it brought,
        if one came meanwhile."""
        if link is not None and self._on_link == link.serial:
            with contextlib.suppress(HaFailoverError):
                link.drain(self.subscription)
        with self.session.connection._cond:
            return self._next()

    def _receive_now(self) -> Message | None:
        """The next message if one can be handed out without waiting, else None; raises
        WouldBlock, with it, while an AUTO acknowledge must be confirmed first (F6)."""
        self._check_receive()
        session = self.session
        cond = session.connection._cond
        started = tracing.started()
        with cond:
            blocking = session._ack_blocking()
            message = self._next() if blocking is None else None
        if blocking is not None:
            if not blocking.done():
                raise WouldBlock(
                    session.connection._completion_wait(blocking),
                    functools.partial(session._ack_timed_out, blocking),
                )
            session._confirm_last_ack()  # done: raises what it failed with, if it did
            with cond:
                if session._ack_blocking() is not None:
                    return None  # ended while we looked: the next call confirms it
                message = self._next()
        if message is not None:
            self._hand_out(message, started)
        return message

    def _pull_now(self) -> Message:
        """Zero prefetch, for a caller that must not block: the next message, or WouldBlock
        having asked the broker for one on the current link (one credit while the receive
        waits, core/pull.py); the caller asks again once the driver changed something."""
        message = self._receive_now()
        if message is not None:
            return message
        with self.session.connection._cond:
            if not self._buffer:
                self._pull()
        raise WouldBlock

    def _drain_now(self) -> Message | None:
        """Zero prefetch: the receive timed out; take the pull's credit back (blocking: the
        broker's answer) and return the message the broker sent with it, if one came."""
        started = tracing.started()
        with self.session.connection._cond:
            link = self.session.connection._admitted_link()
        message = self._drain(link)
        if message is not None:
            self._hand_out(message, started)
        return message

    def _hand_out(self, message: Message, started: int) -> None:
        """The automatic acknowledge of a message receive() is about to return. If it
        raises instead (F6), the application never had the message: its id leaves the
        duplicate window, so that its redelivery is delivered."""
        try:
            with tracing.receiving(self, message, started):
                self._after_delivery(message)
        except HaFailoverError:
            if self._dedup is not None and self._remembered_at is Remembered.AT_DELIVERY:
                with self.session.connection._cond:
                    self._dedup.forget(message.message_id)
            raise

    def _check_receive(self) -> None:
        self.session._check_open()
        if self._listener is not None:
            raise IllegalStateError(
                "this consumer has a message listener; receive() is not allowed"
            )

    def _next(self) -> Message | None:
        """Under the lock: the next message if one can be handed out now; raises once the
        consumer or the connection is done."""
        session = self.session
        connection = session.connection
        if self._closed or session._closed:
            raise ConnectionClosedError("the consumer is closed")
        admission, code = connection._machine.admit()
        if admission is Admission.RAISE and not self._buffer:
            assert code is not None
            raise error_for(code, f"the connection is {connection._machine.state.value}")
        if connection._started and self._buffer and connection._admits():
            return self._take()
        return None

    def receive_no_wait(self) -> Message | None:
        return self.receive(0)

    def set_message_listener(self, listener: Callable[[Message], None] | None) -> None:
        """Deliver messages to ``listener`` on the session's thread instead of receive()."""
        if listener is not None and self.prefetch == 0:
            raise ConfigurationError(
                "a message listener always waits for the next message, so prefetch=0 would "
                "hold one ahead like prefetch=1: use receive(), or a consumer with prefetch=1"
            )
        with self.session.connection._cond:
            self._listener = listener
            if listener is not None:
                self.session._start_dispatcher()

    def close(self) -> None:
        """Stop the subscription; prefetched messages go back to the broker."""
        session = self.session
        connection = session.connection
        with connection._cond:
            if self._closed:
                return
            self._closed = True
            self._drop_buffer(give_back=True)
            session._consumers.pop(self.subscription, None)
            if session.rules.acknowledged_by_application:
                # What it handed out and the application has not acknowledged goes back to
                # the broker with the subscription; an acknowledge naming the subscription
                # would be refused (STOMP): the rules forget those messages.
                held = tuple(
                    t for t, s in session._tag_subscriptions.items() if s == self.subscription
                )
                for tag in held:
                    del session._tag_subscriptions[tag]
                session.rules.subscription_ended(held)
                session._dedup_forget(held)  # they come again: no duplicates then
            link = connection._admitted_link()
            if link is not None:
                with contextlib.suppress(HaFailoverError):
                    link.unsubscribe(self.subscription)
            self._release_dedup_file()
            connection._cond.notify_all()

    def _release_dedup_file(self, *, closing_all: bool = False) -> None:
        """Under the lock: close the duplicate window's file (and let go of its lock), or
        hand it to a consumer that shares the window (a shared subscription's), which
        goes on writing it; ``closing_all``: the connection closes every consumer."""
        dedup_file, self._dedup_file = self._dedup_file, None
        if dedup_file is None:
            return
        if not closing_all:
            for session in self.session.connection._sessions.values():
                for other in session._consumers.values():
                    if other is not self and other._dedup is self._dedup and not other._closed:
                        other._dedup_file = dedup_file
                        return
        dedup_file.close()

    def __iter__(self) -> Iterator[Message]:
        """Messages as they come, forever (use receive() for a timeout)."""
        while True:
            message = self.receive()
            if message is not None:
                yield message


def stable_id(message: Message) -> str | None:
    """The id by which a consumer counts a message's failures itself: its sender's id,
    the same on every delivery by every broker. A broker's own message id may change from
    one delivery to the next (RabbitMQ's STOMP ids do): then only the broker's count
    counts."""
    return message.message_id if message._sender_id else None
