"""A session of the threaded driver: acknowledges, transactions and listener dispatch.

A session is a single-threaded context (as in JMS). Its acknowledge-mode rules and
transaction state live in the sessions core (``core/inflight.py``), which decides what a
failover does to them; this module carries out those decisions on the link and keeps the
session's buffers. Everything here runs under the connection's lock except calls that
wait for the broker.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hafailover.ack_modes import (
    AckAction,
    AckDecision,
    AckMode,
    AckRules,
    ConfirmFirst,
    FailoverOutcome,
    LinkReliability,
    check_link_reliability,
)
from hafailover.core.inflight import CallKind
from hafailover.core.pull import prefetch_refusal
from hafailover.core.subscriptions import (
    NamedSubscription,
    RedeliveryLimit,
    SubscriptionKind,
    broker_subscription_name,
    check_can_open,
    check_can_unsubscribe,
    named_subscription,
)
from hafailover.destination import Destination, parse_destination
from hafailover.driver import tracing
from hafailover.driver.browser import Browser
from hafailover.driver.calls import error_for
from hafailover.driver.completions import SendCompletion
from hafailover.driver.consumer import DEFAULT_PREFETCH, Consumer, stable_id
from hafailover.driver.dedup_file import DedupFile
from hafailover.driver.producer import Producer
from hafailover.driver.transactions import Transactions
from hafailover.driver.waits import Steps, attempts, blocking, run_steps
from hafailover.errors import (
    AcknowledgeFailedError,
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    ErrorCode,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.base import Link

if TYPE_CHECKING:
    from hafailover.driver.connection import Connection

__all__ = ["Session"]

log = logging.getLogger("hafailover")


class Session(Transactions):
    """A single-threaded context for producing and consuming (as in JMS)."""

    def __init__(
        self,
        connection: Connection,
        session_id: int,
        ack_mode: AckMode,
        open_rules: Callable[[int, AckMode], AckRules],
    ) -> None:
        self.connection = connection
        self.session_id = session_id
        self.ack_mode = ack_mode
        # The rules live in the sessions core, which applies them at every failover.
        self.rules: AckRules = open_rules(session_id, ack_mode)
        # Rules whose acknowledges the broker confirms also decide what waits for them (F6).
        self._auto_rules = self.rules if self.rules.confirms_acknowledges else None
        self._consumers: dict[str, Consumer] = {}
        self._temporary: list[Destination] = []
        self._tx: object = None  # the broker's transaction handle, once work started
        self._tx_link = 0
        self._tag_subscriptions: dict[str, str] = {}
        # Deliveries of consumers with a duplicate window, until they are acknowledged or
        # committed (their ids join the window) or given back (they do not): tag -> both.
        self._dedup_pending: dict[str, tuple[Consumer, str | None]] = {}
        self._closed = False
        self._dispatcher: threading.Thread | None = None
        # AUTO (F6): the last message's acknowledge, in flight, and whether the next message
        # may be handed out before it is confirmed; earlier pipelined ones still in flight.
        self._auto_ack: SendCompletion | None = None
        self._auto_ack_pipelined = False
        self._auto_acks: collections.deque[SendCompletion] = collections.deque()
        self._tx_sends: list[SendCompletion] = []  # AMQP: transactional transfers unsettled
        self._commit_link = 0  # serial of the link a running commit() belongs to

    @property
    def transacted(self) -> bool:
        return self.ack_mode is AckMode.SESSION_TRANSACTED

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError(f"session {self.session_id} is closed")
        self.connection._check_open()

    # --- factories --------------------------------------------------------------------------

    def create_producer(
        self, destination: str | Destination | None = None, *, confirm: bool = True
    ) -> Producer:
        """A producer; without a destination every send names one. ``confirm=False`` sends
        persistent messages without waiting for the broker, stamped with a duplicate id. Over
        STOMP to a broker with the reattach extension (the bundled pair) they are still kept
        in the confirmation window (replayed after a failover); elsewhere (other STOMP
        brokers, AMQP) nothing is kept: a failover leaves them in doubt (docs/client.md)."""
        self._check_open()
        return Producer(
            self, None if destination is None else parse_destination(destination), confirm
        )

    def create_consumer(
        self,
        destination: str | Destination,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        reliability: LinkReliability | None = None,
        dedup: int | None = None,
        dedup_file: str | None = None,
        max_redeliveries: int | None = None,
    ) -> Consumer:
        """A consumer of a queue, topic or temporary queue. ``reliability`` (Qpid's link
        reliability) must agree with the session's ack mode (F14). ``dedup``: how many
        acknowledged message ids it remembers to drop duplicates (0 off; None: the URL's
        ``consumer_dedup``). ``dedup_file``: the file that keeps those ids across restarts
        (None: the URL's ``consumer_dedup_file``), one per consumer. ``max_redeliveries``:
        failed deliveries after which a message is rejected to the dead-letter address (-1
        no limit; None: the URL's)."""
        return run_steps(
            self.connection,
            self._consumer_steps(
                destination,
                selector=selector,
                prefetch=prefetch,
                reliability=reliability,
                dedup=dedup,
                dedup_file=dedup_file,
                max_redeliveries=max_redeliveries,
            ),
        )

    def _consumer_steps(
        self,
        destination: str | Destination,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        reliability: LinkReliability | None = None,
        dedup: int | None = None,
        dedup_file: str | None = None,
        max_redeliveries: int | None = None,
        named: NamedSubscription | None = None,
    ) -> Steps[Consumer]:
        """``create_consumer`` as steps: it waits out a failover (F1), then for the broker
        to have the subscription."""
        self._check_open()
        if max_redeliveries is None:
            max_redeliveries = self.connection.policy.max_redeliveries
        redelivery = RedeliveryLimit(max_redeliveries)  # checks the value
        if dedup is None:
            dedup = self.connection.policy.consumer_dedup
        if isinstance(dedup, bool) or not isinstance(dedup, int) or dedup < 0:
            raise ConfigurationError(f"dedup must be a whole number >= 0, not {dedup!r}")
        check_link_reliability(self.ack_mode, reliability)
        if selector is not None and not self.connection.policy.brokers[0].scheme.startswith(
            "stomp"
        ):
            raise ConfigurationError("message selectors are supported on STOMP connections only")
        refusal = prefetch_refusal(prefetch, self.connection.policy.protocol)
        if refusal is not None:
            raise ConfigurationError(refusal)
        target = parse_destination(destination)
        if dedup_file is not None and not dedup:
            raise ConfigurationError("dedup_file keeps the duplicate window, and dedup=0 has none")
        path = dedup_file if dedup_file is not None else self.connection.policy.consumer_dedup_file
        with self.connection._cond:
            # A consumer of a shared subscription that shares a sibling's window shares
            # its file too (``_share_duplicate_window``): it opens none of its own.
            shares = named is not None and self._shared_window(named) is not None
        # Opened with the lock let go (it reads the file); checked again under it below.
        journal = DedupFile(path) if path is not None and dedup and not shares else None
        connection = self.connection
        try:
            with connection._cond:
                if named is not None:
                    check_can_open(named, target, selector, self._named_open())
                    if journal is not None and self._shared_window(named) is not None:
                        # A sibling of the shared subscription got its window in meanwhile:
                        # this consumer shares that one, file included.
                        journal.close()
                        journal = None
                subscription = f"sub-{next(connection._subscription_ids)}"
                consumer = Consumer(
                    self,
                    subscription,
                    target,
                    prefetch,
                    selector,
                    dedup=dedup,
                    dedup_file=journal,
                    named=named,
                    max_redeliveries=redelivery.max_redeliveries,
                )
                if named is not None:
                    self._share_duplicate_window(consumer)
                self._consumers[subscription] = consumer
        except BaseException:
            if journal is not None:
                journal.close()  # its lock would hold the file for the rest of the process
            raise
        try:
            yield from connection._subscribe_steps(consumer)
        except HaFailoverError:
            raise  # taken back there
        except BaseException:
            # Cancelled (hafailover.aio): nobody gets this consumer.
            with contextlib.suppress(HaFailoverError):
                consumer.close()
            raise
        while True:
            completion = consumer._subscribed
            assert completion is not None
            try:
                yield from connection._completion_steps(completion)
            except UnblockedError:
                # A failover caught the subscription; the recreation subscribed it again.
                with connection._cond:
                    given_up = consumer._closed or consumer._subscribed is completion
                if not given_up:
                    continue
                consumer.close()
                raise
            except BaseException:
                # Nobody gets this consumer: its subscription must not hold messages.
                consumer.close()
                raise
            return consumer

    def create_durable_consumer(
        self,
        topic: str | Destination,
        name: str,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
    ) -> Consumer:
        """A consumer of the durable subscription ``name`` to ``topic``: the broker keeps
        what is published while no consumer is attached, and a failover resumes it (F5).
        Needs the URL's ``client_id``; one active consumer at a time (JMS)."""
        return run_steps(
            self.connection,
            self._durable_consumer_steps(
                topic,
                name,
                selector=selector,
                prefetch=prefetch,
                dedup=dedup,
                max_redeliveries=max_redeliveries,
            ),
        )

    def _durable_consumer_steps(
        self,
        topic: str | Destination,
        name: str,
        *,
        selector: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
    ) -> Steps[Consumer]:
        """``create_durable_consumer`` as steps; its keywords are the options it takes."""
        return self._named_consumer(
            SubscriptionKind.DURABLE, topic, name, selector, prefetch, dedup, max_redeliveries
        )

    def create_shared_consumer(
        self,
        topic: str | Destination,
        name: str,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
    ) -> Consumer:
        """A consumer of the shared subscription ``name`` to ``topic``: its consumers, on
        this connection or others, share its messages; it ends with its last consumer."""
        return run_steps(
            self.connection,
            self._shared_consumer_steps(
                SubscriptionKind.SHARED,
                topic,
                name,
                prefetch=prefetch,
                dedup=dedup,
                max_redeliveries=max_redeliveries,
            ),
        )

    def create_shared_durable_consumer(
        self,
        topic: str | Destination,
        name: str,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
    ) -> Consumer:
        """A consumer of the shared durable subscription ``name`` to ``topic``: shared by
        its consumers and kept by the broker while it has none."""
        return run_steps(
            self.connection,
            self._shared_consumer_steps(
                SubscriptionKind.SHARED_DURABLE,
                topic,
                name,
                prefetch=prefetch,
                dedup=dedup,
                max_redeliveries=max_redeliveries,
            ),
        )

    def _shared_consumer_steps(
        self,
        kind: SubscriptionKind,
        topic: str | Destination,
        name: str,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        dedup: int | None = None,
        max_redeliveries: int | None = None,
    ) -> Steps[Consumer]:
        """``create_shared_consumer`` or ``create_shared_durable_consumer`` as steps; no
        selector: JMS gives a shared subscription none of its own."""
        return self._named_consumer(kind, topic, name, None, prefetch, dedup, max_redeliveries)

    def _named_consumer(
        self,
        kind: SubscriptionKind,
        topic: str | Destination,
        name: str,
        selector: str | None,
        prefetch: int,
        dedup: int | None,
        max_redeliveries: int | None,
    ) -> Steps[Consumer]:
        """A consumer of a durable or shared subscription, as steps."""
        target = parse_destination(topic)
        named = named_subscription(kind, target, name, self.connection.policy.client_id)
        return (
            yield from self._consumer_steps(
                target,
                selector=selector,
                prefetch=prefetch,
                dedup=dedup,
                max_redeliveries=max_redeliveries,
                named=named,
            )
        )

    def _named_open(self) -> list[tuple[NamedSubscription, Destination, str | None]]:
        """Under the lock: the named subscriptions this connection has consumers on."""
        return [
            (consumer.named, consumer.destination, consumer.selector)
            for session in self.connection._sessions.values()
            for consumer in session._consumers.values()
            if consumer.named is not None and not consumer._closed
        ]

    def _shared_window(self, named: NamedSubscription) -> Consumer | None:
        """Under the lock: an open consumer of the shared subscription ``named`` on this
        connection that has a duplicate window, if any."""
        if not named.shared:
            return None
        for session in self.connection._sessions.values():
            for other in session._consumers.values():
                if other.named == named and other._dedup is not None and not other._closed:
                    return other
        return None

    def _share_duplicate_window(self, consumer: Consumer) -> None:
        """Under the lock: consumers of one shared subscription on this connection share
        one duplicate window: a message whose acknowledge a failover lost may come again
        to another of them, which must drop it too."""
        named = consumer.named
        if named is None or not named.shared or consumer._dedup is None:
            return
        for session in self.connection._sessions.values():
            for other in session._consumers.values():
                if other.named == named and other._dedup is not None and not other._closed:
                    consumer._dedup = other._dedup
                    return

    def unsubscribe(self, name: str) -> None:
        """Delete the durable subscription ``name`` (shared or not) and what it holds; JMS
        forbids it while this connection has a consumer on it."""
        run_steps(self.connection, self._unsubscribe_steps(name))

    def _unsubscribe_steps(self, name: str) -> Steps[None]:
        """``unsubscribe`` as steps: it waits out a failover (F1), then for the broker."""
        self._check_open()
        connection = self.connection
        link, token, completion, broker_name = yield from attempts(
            functools.partial(self._unsubscribe_written, name, connection._failover_deadline())
        )
        if link.calls_block:
            try:
                yield from blocking(
                    functools.partial(link.remove_subscription, broker_name, token=token)
                )
            except HaFailoverError as exc:
                with connection._cond:
                    if not isinstance(exc, NotConnectedError | UnblockedError):
                        connection._abandon(token, exc)
                raise
        yield from connection._completion_steps(completion)

    def _unsubscribe_written(
        self, name: str, deadline: float | None
    ) -> tuple[Link, int, SendCompletion, str]:
        """Under the lock, once the connection admits calls (WouldBlock, nothing done,
        while it fails over): register the unsubscribe and write it unless the link's
        calls block. The link, its token, completion and the broker's name for it."""
        connection = self.connection
        with connection._cond:
            check_can_unsubscribe(name, (named for named, _, _ in self._named_open()))
            link = connection._admit(deadline, block=False)
            completion = SendCompletion(connection, None)
            token = connection._call(
                CallKind.SUBSCRIBE, completion, self, subscription=f"unsubscribe:{name}"
            )
            broker_name = broker_subscription_name(name, connection.policy.client_id)
            if not link.calls_block:
                command_id = connection._window.next_id if link.windowed else -1
                link.remove_subscription(broker_name, token=token)
                connection._written(token, link, command_id, asked=True)
        return link, token, completion, broker_name

    def create_browser(self, queue: str | Destination) -> Browser:
        """Iterate over the messages waiting on a queue without consuming them (F11)."""
        self._check_open()
        target = parse_destination(queue)
        if target.is_topic:
            raise ConfigurationError(f"only queues can be browsed, not {target}")
        return Browser(self, target)

    def create_temporary_queue(self) -> Destination:
        """A queue that lives as long as the connection; recreated by name after failover."""
        return run_steps(self.connection, self._temporary_queue_steps())

    def _temporary_queue_steps(self) -> Steps[Destination]:
        """``create_temporary_queue`` as steps: it waits out a failover (F1)."""
        self._check_open()
        connection = self.connection
        link = yield from attempts(
            functools.partial(connection._admit_locked, connection._failover_deadline())
        )
        if link.calls_block:
            destination = yield from blocking(functools.partial(link.temporary_queue, None))
        else:
            destination = link.temporary_queue(None)
        with connection._cond:
            self._temporary.append(destination)
        return destination

    # --- acknowledge and transactions -------------------------------------------------------

    def acknowledge(self) -> None:
        """CLIENT modes: acknowledge every message this session delivered (F8)."""
        run_steps(self.connection, self._acknowledge_all_steps())

    def _acknowledge_all_steps(self) -> Steps[None]:
        self._check_open()
        if not self.rules.acknowledged_by_application:
            self.rules.acknowledge_all()  # raises: not this mode's call
        yield from self._acknowledge_steps(None)

    def _acknowledge_message(self, message: Message, confirm: bool = True) -> None:
        run_steps(self.connection, self._acknowledge_message_steps(message, confirm))

    def _acknowledge_message_steps(self, message: Message, confirm: bool = True) -> Steps[None]:
        delivery = message.delivery
        if delivery is None:
            raise IllegalStateError("this message was not received by a session")
        self._check_open()
        self.rules.check_owner(delivery)
        if not self.rules.acknowledged_by_application:
            return  # JMS: acknowledge() is ignored outside CLIENT modes
        yield from self._acknowledge_steps(delivery, confirm)

    def _acknowledge_steps(self, delivery: Any | None, confirm: bool = True) -> Steps[None]:
        """Acknowledge ``delivery`` (None: everything this session delivered): wait out a
        failover, write, wait for the broker's confirmation (``confirm``; else the
        acknowledge stays in flight, and a failover that loses it makes the broker deliver
        the message again, which the consumer's duplicate window then drops)."""
        connection = self.connection
        deadline = connection._failover_deadline()
        written = yield from attempts(
            functools.partial(self._acknowledge_written, delivery, deadline, confirm)
        )
        if written is None:
            return
        completion, tags = written
        if completion is None:
            return  # not confirmed: its ids joined the duplicate windows as it was written
        yield from connection._completion_steps(completion)
        if self._dedup_pending:
            with connection._cond:
                self._dedup_settled(tags)

    def _acknowledge_written(
        self, delivery: Any | None, deadline: float | None, confirm: bool = True
    ) -> tuple[SendCompletion | None, tuple[str, ...]] | None:
        """Write the acknowledge of ``delivery``: its completion (None without ``confirm``:
        no call is made of it then, as of a DUPS_OK acknowledge, it asks for no receipt,
        and its ids join the consumers' duplicate windows here, in the same hold of the
        lock) and the tags it covers, or None when there is nothing to write.
        WouldBlock, having done nothing, while the connection fails over; a write that
        fails raises AcknowledgeFailedError, confirmed or not."""
        connection = self.connection
        with connection._cond:
            # F1 first: wait out a failover, so that the rules decide with its outcome
            # applied (a session it made dirty raises) and no delivery id of the old link
            # is written on the new one, where it names another message.
            link = connection._admit(deadline, block=False)
            rules = self.rules
            decision = rules.acknowledge_all() if delivery is None else rules.acknowledge(delivery)
            if decision.action is AckAction.RAISE:
                raise self._recovered(decision)
            if decision.action is not AckAction.SEND or not decision.tags:
                return None
            completion = SendCompletion(connection, None) if confirm else None
            token = None if completion is None else connection._call(CallKind.ACK, completion, self)
            try:
                for tag in decision.tags[:-1]:
                    link.acknowledge(self._tag_subscriptions.pop(tag, ""), tag, tx=None, token=None)
                last = decision.tags[-1]
                command_id = connection._window.next_id if link.windowed else -1
                link.acknowledge(self._tag_subscriptions.pop(last, ""), last, tx=None, token=token)
                connection._written(token, link, command_id, asked=True)
            except HaFailoverError as exc:
                error = AcknowledgeFailedError(f"acknowledge failed: {exc}")
                if token is not None:
                    connection._abandon(token, error)
                connection._io_failed(link, exc)
                # Given up: if a reattach brings them again, they are delivered again.
                self._forget_seen(decision.tags)
                self._dedup_forget(decision.tags)
                if token is None:
                    raise error from exc  # nobody waits for a completion to report it
            else:
                if token is None and self._dedup_pending:
                    self._dedup_settled(decision.tags)
        return completion, decision.tags

    def _release_message_steps(self, message: Message, consumer: Consumer) -> Steps[None]:
        """Message.release(): wait out a failover (F1), then give the message back as the
        rules decide. Nothing to wait for after: a NACK the connection loses is the
        failover's, and the broker delivers the message again then anyway."""
        delivery = message.delivery
        if delivery is None:
            raise IllegalStateError("this message was not received by a session")
        self._check_open()
        connection = self.connection
        deadline = connection._failover_deadline()
        yield from attempts(functools.partial(self._release_written, message, consumer, deadline))

    def _release_written(
        self, message: Message, consumer: Consumer, deadline: float | None
    ) -> None:
        """Write the release of ``message``; WouldBlock, having done nothing, while the
        connection fails over (so the rules decide with its outcome applied)."""
        connection = self.connection
        with connection._cond:
            connection._admit(deadline, block=False)
            decision = self.rules.release(message.delivery)
            if decision.action is AckAction.RAISE:
                # F8, as an acknowledge. The failure is the application's verdict all the
                # same: max_redeliveries counts it.
                consumer._redelivery.failed(stable_id(message), message.delivery_count)
                raise self._recovered(decision)
            if decision.action is AckAction.REDELIVER:
                consumer._failed_delivery(message, decision.tags)

    def recover(self) -> None:
        """Redeliver every unacknowledged message; after a failover this cleans the session."""
        self._check_open()
        if self.transacted:
            raise IllegalStateError("recover() is not for transacted sessions; use rollback()")
        connection = self.connection
        with connection._cond:
            decision = self.rules.recover()
            self._give_back(decision.redeliver)
            for consumer in self._consumers.values():
                consumer._drop_buffer(give_back=True)

    def _recovered(self, decision: AckDecision) -> HaFailoverError:
        """Under the lock, F8: an acknowledge or release in a session a failover made dirty
        recovers it implicitly (what was delivered since the failover goes back to the
        broker too; what came before it went back with the old session); the error to raise."""
        self._give_back(decision.redeliver)
        self._recover_locked(decision)
        assert decision.code is not None
        return error_for(
            decision.code,
            "the session failed over holding unacknowledged messages; they will be "
            "redelivered (the session recovered)",
        )

    def _recover_locked(self, decision: AckDecision) -> None:
        for consumer in self._consumers.values():
            consumer._drop_buffer(give_back=True)

    def _forget_seen(self, tags: tuple[str, ...]) -> None:
        """Under the lock: deliveries whose acknowledge was given up may come again after a
        reattach (the broker still holds them); let them through when they do."""
        for consumer in self._consumers.values():
            for tag in tags:
                consumer._seen.pop(tag, None)

    def _drop_buffered(self, tags: tuple[str, ...]) -> None:
        """Under the lock: forget buffered copies of these deliveries; they stay seen, so a
        copy still on its way is dropped too."""
        dropped = set(tags)
        for consumer in self._consumers.values():
            kept = [entry for entry in consumer._buffer if entry[1] not in dropped]
            if len(kept) != len(consumer._buffer):
                consumer._buffer.clear()
                consumer._buffer.extend(kept)

    def _dedup_settled(self, tags: tuple[str, ...]) -> None:
        """Under the lock: these deliveries are acknowledged or committed; their ids join
        their consumers' duplicate windows."""
        pending = self._dedup_pending
        for tag in tags:
            entry = pending.pop(tag, None)
            if entry is not None:
                consumer, message_id = entry
                consumer._held_ids.discard(message_id)
                if consumer._dedup is not None:
                    consumer._dedup.remember((message_id,))

    def _dedup_forget(self, tags: tuple[str, ...]) -> None:
        """Under the lock: these deliveries go back; their redelivery is not a duplicate."""
        for tag in tags:
            entry = self._dedup_pending.pop(tag, None)
            if entry is not None:
                entry[0]._held_ids.discard(entry[1])

    def _give_back(self, tags: tuple[str, ...]) -> None:
        """Under the lock: NACK deliveries so the broker redelivers them."""
        self._dedup_forget(tags)
        connection = self.connection
        link = connection._admitted_link()
        if link is None:
            return  # the broker redelivers them to the new session anyway
        for tag in tags:
            consumer = self._consumers.get(self._tag_subscriptions.pop(tag, ""))
            if consumer is None:
                # Its consumer closed, and the broker took back what the subscription held
                # as it ended; a NACK naming that subscription would be refused (STOMP).
                continue
            try:
                link.redeliver(consumer.subscription, tag)
            except HaFailoverError as exc:
                # Not given back: the failover's rules decide what becomes of it.
                connection._io_failed(link, exc)
                continue
            if link.windowed:
                consumer._given_back_on_session(tag)

    def _failed_over(self, outcome: FailoverOutcome, link: Link, *, reattached: bool) -> None:
        """Under the lock: carry out what this session's rules decided at a failover."""
        if reattached:
            # The server kept the session: its subscriptions and transaction live on.
            for consumer in self._consumers.values():
                if consumer._on_link:
                    consumer._on_link = link.serial
            if self._tx is not None:
                self._tx_link = link.serial
        else:
            for consumer in self._consumers.values():
                consumer._given_back.clear()  # tags of a session the broker has ended
            self._tx = None
            self._tx_sends = []
            # Pipelined acknowledges the reconnect lost: their messages' redeliveries are
            # the rules' to drop (outcome.expect_again); nothing waits for them any more.
            self._auto_acks.clear()
            self._dedup_pending.clear()  # deliveries of the old session: never acknowledged
            for consumer in self._consumers.values():
                consumer._held_ids.clear()
        if outcome.discard_prefetched:
            for consumer in self._consumers.values():
                consumer._drop_buffer(give_back=False)
            self._tag_subscriptions.clear()

    # --- listener dispatch ------------------------------------------------------------------

    def _start_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop,
                name=f"hafailover-session-{self.session_id}",
                daemon=True,
            )
            self._dispatcher.start()

    def _dispatch_loop(self) -> None:
        connection = self.connection
        while True:
            with connection._cond:
                item = None
                while item is None:
                    if self._closed:
                        return
                    if self._ack_blocking() is not None:
                        break  # an acknowledge to confirm first (F6), outside the lock
                    if connection._started and connection._admits():
                        for consumer in self._consumers.values():
                            if consumer._listener is not None and consumer._buffer:
                                item = (consumer, consumer._take())
                                if item[1] is not None:
                                    break
                                item = None
                    if item is None:
                        connection._cond.wait(0.5)
            try:
                self._confirm_last_ack()
            except HaFailoverError as exc:
                connection._notify_all(None, exc)
            if item is None:
                continue
            consumer, message = item
            listener = consumer._listener
            assert message is not None
            assert listener is not None
            try:
                with tracing.processing(consumer, message):
                    listener(message)
            except Exception:
                log.exception("a message listener raised; the rules decide the message's fate")
                with connection._cond:
                    consumer._listener_failed(message)
                continue
            try:
                consumer._after_delivery(message)
            except HaFailoverError as exc:
                connection._notify_all(None, exc)  # F6: a listener's ack failure is reported

    def _auto_ack_written(self, completion: SendCompletion, *, pipelined: bool) -> None:
        """Under the lock: the acknowledge of the message being handed out is written."""
        self._auto_ack_superseded()
        self._auto_ack = completion
        self._auto_ack_pipelined = pipelined

    def _auto_ack_superseded(self) -> None:
        """Under the lock: another message was taken, so the last acknowledge is no longer
        the last message's; in flight, it waits among the earlier ones."""
        previous, self._auto_ack = self._auto_ack, None
        if previous is not None and not previous.done():
            self._auto_acks.append(previous)

    def _ack_blocking(self) -> SendCompletion | None:
        """Under the lock, AUTO (F6): the acknowledge to confirm, or whose failure to report,
        before the next message is handed out; the rules say which."""
        rules = self._auto_rules
        if rules is None:
            return None
        pending = self._auto_acks
        while pending and pending[0].done():
            error = pending[0].exception()
            if error is not None:
                decision = rules.ack_failed(error.code, last=False)
                if decision.action is AckAction.RAISE:
                    return pending[0]
            pending.popleft()
        last = self._auto_ack
        if last is not None and last.done() and last.exception() is None:
            self._auto_ack = last = None  # confirmed: nothing to wait for or report
        which = rules.confirm_first(
            last_pipelined=self._auto_ack_pipelined,
            last_done=last is not None and last.done(),
            in_flight=len(pending),
        )
        if which is ConfirmFirst.OLDEST:
            return pending[0]
        if which is ConfirmFirst.LAST:
            return last
        return None

    def _confirm_last_ack(self, deadline: float | None = None) -> bool:
        """AUTO: wait for the acknowledges F6 needs confirmed before the next delivery,
        and report a failure as the rules say (AcknowledgeFailed: a message may come
        again). With a ``deadline`` (a receive's timeout), False if one is still
        unconfirmed then; without one, each waits up to the call timeout."""
        connection = self.connection
        rules = self._auto_rules
        if rules is None:
            return True
        while True:
            with connection._cond:
                completion = self._ack_blocking()
                if completion is None:
                    return True
                while deadline is not None and not completion.done():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    connection._ask_for_receipt()  # a pipelined one may not have asked
                    connection._cond.wait(remaining)
                last = self._claim_ack(completion)
            try:
                completion.result()
            except HaFailoverError as exc:
                self._ack_failed(completion, exc, last=last)

    def _ack_timed_out(self, completion: SendCompletion, exc: CallTimeoutError) -> None:
        """A caller that does not block waited for ``completion``, the acknowledge F6
        needed confirmed first, until its budget ran out (``exc``): what a blocking receive
        does then (nothing if that acknowledge is no longer the one to wait for)."""
        with self.connection._cond:
            if self._ack_blocking() is not completion or completion.done():
                return
            last = self._claim_ack(completion)
        self._ack_failed(completion, exc, last=last)

    def _claim_ack(self, completion: SendCompletion) -> bool:
        """Under the lock: ``completion`` is about to be waited on and its outcome reported
        here; whether it is the last message's (which then no longer waits to be)."""
        last = completion is self._auto_ack
        if last:
            self._auto_ack = None
        return last

    def _ack_failed(self, completion: SendCompletion, exc: HaFailoverError, *, last: bool) -> None:
        """An acknowledge F6 waited for ended with ``exc``: raise what the rules say the
        application hears, if anything."""
        rules = self._auto_rules
        assert rules is not None
        with self.connection._cond, contextlib.suppress(ValueError):
            self._auto_acks.remove(completion)
        decision = rules.ack_failed(exc.code, last=last)
        if decision.action is not AckAction.RAISE:
            return
        if decision.code is not ErrorCode.ACKNOWLEDGE_FAILED:
            raise exc
        which = "the previous message" if last else "an earlier message"
        raise AcknowledgeFailedError(
            f"the acknowledge of {which} was not confirmed ({exc}); that message "
            "may be delivered again"
        ) from exc

    def _join(self) -> None:
        thread = self._dispatcher
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)

    def close(self) -> None:
        """Close the session: its consumers stop, an open transaction rolls back."""
        run_steps(self.connection, self._close_steps())

    def _close_steps(self) -> Steps[None]:
        """``close`` as steps: the rollback waits for the broker; the end joins the
        listener thread, if the session has one."""
        connection = self.connection
        with connection._cond:
            if self._closed:
                return
            transacted_work = self.rules.transaction is not None and self._tx is not None
        if transacted_work and not connection._closing:
            with contextlib.suppress(HaFailoverError):
                yield from self._rollback_steps()
        for consumer in list(self._consumers.values()):
            with contextlib.suppress(HaFailoverError):
                consumer.close()
        with connection._cond:
            self._closed = True
            connection._sessions.pop(self.session_id, None)
            connection._core.close_session(self.session_id)
            connection._cond.notify_all()
        if self._dispatcher is not None:
            yield from blocking(self._join)
