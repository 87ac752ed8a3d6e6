"""A session of the threaded driver: acknowledges, transactions and listener dispatch.

A session is a single-threaded context (as in JMS). Its acknowledge-mode rules and
transaction state live in the sessions core (``sessions.py``), which decides what a
failover does to them; this module carries out those decisions on the link and keeps the
session's buffers. Everything here runs under the connection's lock except calls that
wait for the broker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from hafailover._links import Link
from hafailover.ack_modes import (
    AckAction,
    AckDecision,
    AckMode,
    AckRules,
    ClientAckRules,
    FailoverOutcome,
    LinkReliability,
    TransactedAckRules,
    check_link_reliability,
)
from hafailover.destination import Destination, parse_destination
from hafailover.driver.browser import Browser
from hafailover.driver.completions import SendCompletion
from hafailover.driver.connection import error_for
from hafailover.driver.consumer import DEFAULT_PREFETCH, Consumer
from hafailover.driver.producer import Producer
from hafailover.errors import (
    AcknowledgeFailedError,
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
    RemoteError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.sessions import CallKind
from hafailover.tx.state import CommitAction, CommitDecision, TxPhase

if TYPE_CHECKING:
    from hafailover.driver.connection import Connection

__all__ = ["Session"]

log = logging.getLogger("hafailover")


class Session:
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
        self._consumers: dict[str, Consumer] = {}
        self._temporary: list[Destination] = []
        self._tx: object = None  # the broker's transaction handle, once work started
        self._tx_link = 0
        self._tag_subscriptions: dict[str, str] = {}
        self._closed = False
        self._dispatcher: threading.Thread | None = None
        self._browsers: list[Browser] = []
        self._auto_ack: SendCompletion | None = None  # AUTO: the last acknowledge, in flight
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
        persistent messages without waiting for the broker (still kept in the confirmation
        window and stamped with a duplicate id)."""
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
    ) -> Consumer:
        """A consumer of a queue, topic or temporary queue. ``reliability`` (Qpid's link
        reliability) must agree with the session's ack mode (F14)."""
        self._check_open()
        check_link_reliability(self.ack_mode, reliability)
        if selector is not None and not self.connection.policy.brokers[0].scheme.startswith(
            "stomp"
        ):
            raise ConfigurationError("message selectors are supported on STOMP connections only")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be a whole number >= 1, not {prefetch!r}")
        target = parse_destination(destination)
        connection = self.connection
        with connection._cond:
            subscription = f"sub-{next(connection._subscription_ids)}"
            consumer = Consumer(self, subscription, target, prefetch, selector)
            self._consumers[subscription] = consumer
        connection._subscribe(consumer)
        while True:
            completion = consumer._subscribed
            assert completion is not None
            try:
                completion.result()
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

    def create_browser(self, queue: str | Destination) -> Browser:
        """Iterate over the messages waiting on a queue without consuming them (F11)."""
        self._check_open()
        target = parse_destination(queue)
        if target.is_topic:
            raise ConfigurationError(f"only queues can be browsed, not {target}")
        browser = Browser(self, target)
        with self.connection._cond:
            self._browsers.append(browser)
        return browser

    def create_temporary_queue(self) -> Destination:
        """A queue that lives as long as the connection; recreated by name after failover."""
        self._check_open()
        connection = self.connection
        with connection._cond:
            link = connection._admit(connection._failover_deadline())
        destination = link.temporary_queue(None)
        with connection._cond:
            self._temporary.append(destination)
        return destination

    # --- acknowledge and transactions -------------------------------------------------------

    def acknowledge(self) -> None:
        """CLIENT modes: acknowledge every message this session delivered (F8)."""
        self._check_open()
        rules = self.rules
        if not isinstance(rules, ClientAckRules):
            raise IllegalStateError(
                f"acknowledge() is for CLIENT and CLIENT_INDIVIDUAL sessions, "
                f"not {self.ack_mode.value}"
            )
        self._acknowledge_delivery(None)

    def _acknowledge_message(self, message: Message) -> None:
        delivery = message.delivery
        if delivery is None:
            raise IllegalStateError("this message was not received by a session")
        self._check_open()
        self.rules.check_owner(delivery)
        if not isinstance(self.rules, ClientAckRules):
            return  # JMS: acknowledge() is ignored outside CLIENT modes
        self._acknowledge_delivery(delivery)

    def _acknowledge_delivery(self, delivery: Any | None) -> None:
        """Acknowledge ``delivery`` (None: everything this session delivered)."""
        connection = self.connection
        with connection._cond:
            # F1 first: wait out a failover, so that the rules decide with its outcome
            # applied (a session it made dirty raises) and no delivery id of the old link
            # is written on the new one, where it names another message.
            link = connection._admit(connection._failover_deadline())
            rules = self.rules
            if delivery is None:
                assert isinstance(rules, ClientAckRules)
                unacked = rules.unacknowledged
                if not unacked and not rules.dirty:
                    return
                # delivered() re-adds the last tag: harmless, it is already there.
                delivery = rules.delivered(unacked[-1]) if unacked else rules.delivered("")
            held = rules.unacknowledged if isinstance(rules, ClientAckRules) else ()
            decision = rules.acknowledge(delivery)
            if decision.action is AckAction.RAISE:
                # F8: recover implicitly: what was delivered since the failover goes back
                # to the broker too (what came before it went back with the old session).
                if decision.recover:
                    self._give_back(held)
                self._recover_locked(decision)
                assert decision.code is not None
                raise error_for(
                    decision.code,
                    "the session failed over holding unacknowledged messages; they will be "
                    "redelivered (the session recovered)",
                )
            if decision.action is not AckAction.SEND or not decision.tags:
                return
            completion = SendCompletion(connection, None)
            token = connection._call(CallKind.ACK, completion, self)
            try:
                for tag in decision.tags[:-1]:
                    link.acknowledge(self._tag_subscriptions.pop(tag, ""), tag, tx=None, token=None)
                last = decision.tags[-1]
                command_id = connection._window.next_id if link.windowed else -1
                link.acknowledge(self._tag_subscriptions.pop(last, ""), last, tx=None, token=token)
                connection._written(token, link, command_id, asked=True)
            except HaFailoverError as exc:
                connection._abandon(token, AcknowledgeFailedError(f"acknowledge failed: {exc}"))
                connection._io_failed(link, exc)
                # Given up: if a reattach brings them again, they are delivered again.
                self._forget_seen(decision.tags)
        completion.result()

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

    def _give_back(self, tags: tuple[str, ...]) -> None:
        """Under the lock: NACK deliveries so the broker redelivers them."""
        connection = self.connection
        link = connection._link
        if link is None or not connection._machine.is_up:
            return  # the broker redelivers them to the new session anyway
        for tag in tags:
            subscription = self._tag_subscriptions.pop(tag, "")
            if subscription:
                with contextlib.suppress(HaFailoverError):
                    link.redeliver(subscription, tag)

    def commit(self) -> None:
        """Commit the transaction; TransactionRolledBackError if failover made it
        rollback-only (F9), TransactionOutcomeUnknownError if the reply was lost (F3)."""
        self._check_open()
        tx_rules = self._transacted_rules("commit")
        transaction = tx_rules.transaction
        connection = self.connection
        with connection._cond:
            # One lock hold from the decision to reading the work it covers: a failover
            # applied in between would roll the work back behind the commit's back.
            decision = transaction.begin_commit()
            # The commit belongs to this link: if a failover replaces it before the commit
            # is written, the transaction rules decide its fate (it never moves links).
            self._commit_link = getattr(connection._link, "serial", 0)
            if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
                self._tx_sends = []
                received = tx_rules.received_in_transaction()
                tx_rules.transaction_ended()
                handle = self._take_tx()
            else:
                handle = self._tx
                received = tx_rules.received_in_transaction()
        if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
            self._end_on_broker(handle, commit=False, received=received, quiet=True)
            raise TransactionRolledBackError(
                "the transaction was rolled back: a failover made it rollback-only; "
                "replay its work and commit again"
            )
        with connection._cond:
            stale = handle is not None and self._tx_link != getattr(
                connection._link, "serial", None
            )
            caught = transaction.phase is not TxPhase.COMMITTING
        if caught:
            # A failover applied since the decision caught the commit: it decided.
            self._end_interrupted_commit(tx_rules, None, received)
        with connection._cond:
            if (handle is None and not received) or stale:
                transaction.commit_finished()
                tx_rules.transaction_ended()
                self._tx = None
                if stale:
                    # The transaction's link is gone and no failover rule caught it: never
                    # report a commit that did not happen.
                    raise TransactionRolledBackError(
                        "the transaction was lost with its connection; replay its work"
                    )
                return
        try:
            if handle is None:
                # Only received so far: the acknowledges go in a transaction of their own.
                handle = self._ensure_tx()
            self._settle_transfers()
            self._end_on_broker(handle, commit=True, received=received, quiet=False)
        except (
            UnblockedError,
            TransactionOutcomeUnknownError,
            CallTimeoutError,
            DisconnectedError,
        ) as exc:
            # No answer came: the connection was lost (failed over or not, yet or for good)
            # or the call timed out. Only whether the commit was written says what may have
            # happened; never report as rolled back a commit the broker may have done.
            self._end_interrupted_commit(tx_rules, exc, received)
        except TransactionRolledBackError:
            raise  # a refused send of the transaction: rolled back already
        except RemoteError as exc:
            with connection._cond:
                transaction.commit_finished()
                tx_rules.transaction_ended()
                self._tx = None
            raise TransactionRolledBackError(f"the broker refused the commit: {exc}") from exc
        with connection._cond:
            transaction.commit_finished()
            tx_rules.transaction_ended()
            self._tx = None

    def _end_interrupted_commit(
        self, tx_rules: TransactedAckRules, exc: BaseException | None, received: tuple[str, ...]
    ) -> NoReturn:
        """End a commit that got no answer and raise what may have happened. A commit never
        written on a link that lives on (it timed out, or a reattach kept the transaction)
        is rolled back on the broker too, or the broker keeps its batch."""
        transaction = tx_rules.transaction
        with self.connection._cond:
            timed_out = isinstance(exc, CallTimeoutError)
            unwritten = transaction.phase is TxPhase.COMMITTING
            fate = transaction.commit_interrupted()
            undo = (timed_out and unwritten) or fate.rollback_on_broker
            handle = self._take_tx() if undo else None
            error = self._interrupted_error(fate, exc)
            tx_rules.transaction_ended()
            self._tx = None
            if undo:
                # Given back below: the broker delivers them anew, under new ids. A copy a
                # reattach resent under the old ids is stale: never hand it out.
                self._drop_buffered(received)
        if undo:
            self._end_on_broker(handle, commit=False, received=received, quiet=True)
        raise error from None

    @staticmethod
    def _interrupted_error(fate: CommitDecision, exc: BaseException | None) -> HaFailoverError:
        """What an interrupted commit raises: rolled back (never written), outcome unknown,
        or, once the connection is lost for good, DisconnectedError (F2) saying which."""
        rolled_back = fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
        timed_out = isinstance(exc, CallTimeoutError)
        if isinstance(exc, DisconnectedError):
            outcome = (
                "the transaction was rolled back"
                if rolled_back
                else "the commit was sent and may or may not have happened"
            )
            return DisconnectedError(f"{exc}; {outcome}")
        if rolled_back:
            why = "timed out" if timed_out else "lost its connection"
            return TransactionRolledBackError(
                f"the commit {why} before it reached the broker; the transaction was rolled back"
            )
        why = "timed out" if timed_out else "its connection was lost"
        return TransactionOutcomeUnknownError(
            f"the commit was sent but {why} before the broker answered; it may or may "
            "not have happened (retry with the same duplicate ids to be safe)"
        )

    def rollback(self) -> None:
        """Roll the transaction back; always succeeds and cleans the session (F9)."""
        self._check_open()
        tx_rules = self._transacted_rules("rollback")
        connection = self.connection
        with connection._cond:
            decision = tx_rules.transaction.rollback()
            handle, received = self._end_transaction_locked(
                tx_rules, on_broker=decision.rollback_on_broker
            )
        self._end_on_broker(handle, commit=False, received=received, quiet=True)

    def _end_transaction_locked(
        self, tx_rules: TransactedAckRules, *, on_broker: bool
    ) -> tuple[object, tuple[str, ...]]:
        """Under the lock, for a rollback: forget the transaction's work and prefetched
        messages; return the broker's transaction to roll back (None: nothing to send)
        and the deliveries to give back."""
        self._tx_sends = []
        received = tx_rules.received_in_transaction()
        tx_rules.transaction_ended()
        handle = self._take_tx() if on_broker else None
        for consumer in self._consumers.values():
            consumer._drop_buffer(give_back=True)
        return handle, received

    def _settle_transfers(self) -> None:
        """AMQP: every transfer of the transaction settled by the broker before the
        discharge; a refused one fails the commit (the transaction is rolled back)."""
        sends, self._tx_sends = self._tx_sends, []
        for completion in sends:
            try:
                completion.result()
            except UnblockedError:
                raise
            except RemoteError as exc:
                # The commit is abandoned before its discharge: roll back, as rollback()
                # would (which refuses to run while a commit is running).
                tx_rules = self._transacted_rules("commit")
                with self.connection._cond:
                    tx_rules.transaction.commit_finished()
                    handle, received = self._end_transaction_locked(tx_rules, on_broker=True)
                self._end_on_broker(handle, commit=False, received=received, quiet=True)
                raise TransactionRolledBackError(
                    f"the broker refused a send of the transaction, which was rolled back: {exc}"
                ) from exc

    def _take_tx(self) -> object:
        handle, self._tx = self._tx, None
        if self._tx_link != getattr(self.connection._link, "serial", None):
            return None  # the transaction died with its link
        return handle

    def _end_on_broker(
        self, handle: object, *, commit: bool, received: tuple[str, ...], quiet: bool
    ) -> None:
        """Acknowledge what was received inside the transaction, then commit or roll back."""
        connection = self.connection
        if handle is None:
            if not commit:
                with connection._cond:
                    self._give_back(received)
            return
        completion = SendCompletion(connection, None)
        with connection._cond:
            link = connection._admit(connection._failover_deadline())
            if self._tx_link != link.serial or (commit and link.serial != self._commit_link):
                # The transaction died with its link while this call waited for the
                # failover: a commit learns its fate from the transaction rules (F3, F9).
                if commit:
                    raise UnblockedError("the transaction's connection failed over")
                self._give_back(received)
                return
            settled: list[SendCompletion] = []
            if commit:
                for tag in received:
                    ack_token = None
                    if link.settles_transacted_work:
                        # The discharge must not overtake these dispositions.
                        ack = SendCompletion(connection, None)
                        ack_token = connection._call(CallKind.ACK, ack, self)
                        settled.append(ack)
                    link.acknowledge(
                        self._tag_subscriptions.get(tag, ""), tag, tx=handle, token=ack_token
                    )
                    connection._written(ack_token, link, -1, asked=True)
            token = connection._call(CallKind.END, completion, self, commit=commit)
            blocking = link.calls_block
            if not blocking:
                command_id = connection._window.next_id if link.windowed else -1
                try:
                    link.end(handle, commit=commit, token=token)
                except HaFailoverError as exc:
                    # Never written: the failover's rules decide (a commit not written is
                    # rolled back, F3).
                    connection._io_failed(link, exc)
                else:
                    connection._written(token, link, command_id, asked=True)
                    if commit:
                        self.rules.transaction.commit_written()  # type: ignore[attr-defined]
        try:
            if blocking:
                for ack in settled:
                    ack.result()
                if commit:
                    with connection._cond:
                        self.rules.transaction.commit_written()  # type: ignore[attr-defined]
                link.end(handle, commit=commit, token=token)
                with connection._cond:
                    connection._written(token, link, -1, asked=True)
            completion.result()
        except HaFailoverError:
            if quiet:
                return
            raise
        finally:
            with connection._cond:
                if not commit:
                    self._give_back(received)
                else:
                    for tag in received:
                        self._tag_subscriptions.pop(tag, None)

    def _transacted_rules(self, what: str) -> TransactedAckRules:
        if not isinstance(self.rules, TransactedAckRules):
            raise IllegalStateError(
                f"{what}() needs a transacted session; this one is {self.ack_mode.value}"
            )
        return self.rules

    def _ensure_tx(self) -> object:
        """The broker transaction for the current work, begun on first use."""
        connection = self.connection
        deadline = connection._failover_deadline()
        while True:
            with connection._cond:
                link = connection._admit(deadline)
                if self._tx is not None and self._tx_link == link.serial:
                    return self._tx
                if not link.calls_block:
                    try:
                        self._tx = link.begin()
                    except (NotConnectedError, UnblockedError) as exc:
                        connection._io_failed(link, exc)
                        continue  # F1: wait for the failover; its rules decide the work's fate
                    self._tx_link = link.serial
                    return self._tx
            try:
                handle = link.begin()  # AMQP declare waits for the broker: outside the lock
            except (NotConnectedError, UnblockedError) as exc:
                connection._io_failed(link, exc)
                continue
            with connection._cond:
                if self._tx is None or self._tx_link != link.serial:
                    self._tx = handle
                    self._tx_link = link.serial
                return self._tx

    # --- failover ---------------------------------------------------------------------------

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
            self._tx = None
            self._tx_sends = []
            for browser in self._browsers:
                browser._invalidate()
        if outcome.discard_prefetched:
            for consumer in self._consumers.values():
                consumer._drop_buffer(give_back=False)
            self._tag_subscriptions.clear()

    def _wake_browsers(self) -> None:
        for browser in self._browsers:
            browser._invalidate()

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
                    if connection._started and connection._machine.is_up:
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
            consumer, message = item
            listener = consumer._listener
            assert message is not None
            assert listener is not None
            try:
                listener(message)
            except Exception:
                log.exception("a message listener raised; the message counts as delivered")
            try:
                consumer._after_delivery(message)
            except HaFailoverError as exc:
                connection._notify_all(None, exc)  # F6: a listener's ack failure is reported

    def _confirm_last_ack(self) -> None:
        """AUTO: the previous delivery's acknowledge must be confirmed before the next one."""
        completion, self._auto_ack = self._auto_ack, None
        if completion is None:
            return
        try:
            completion.result()
        except (UnblockedError, NotConnectedError, CallTimeoutError) as exc:
            raise AcknowledgeFailedError(
                f"the acknowledge of the previous message was not confirmed ({exc}); "
                "that message may be delivered again"
            ) from exc

    def _join(self) -> None:
        thread = self._dispatcher
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)

    def close(self) -> None:
        """Close the session: its consumers stop, an open transaction rolls back."""
        connection = self.connection
        with connection._cond:
            if self._closed:
                return
            transacted_work = isinstance(self.rules, TransactedAckRules) and self._tx is not None
        if transacted_work and not connection._closing:
            with contextlib.suppress(HaFailoverError):
                self.rollback()
        for consumer in list(self._consumers.values()):
            with contextlib.suppress(HaFailoverError):
                consumer.close()
        with connection._cond:
            self._closed = True
            connection._sessions.pop(self.session_id, None)
            connection._core.close_session(self.session_id)
            connection._cond.notify_all()
        self._join()
