"""The transactions of a transacted session (F9, F3): commit, rollback and the broker's
transaction handle, begun on first use.

What a commit caught by a failover raises is decided by the transaction state
(``tx/state.py``), which the sessions core tells what the failover showed; this module
writes the commit or rollback, waits for the broker and says what happened. A mixin of
``Session``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TypeVar

from hafailover.ack_modes import AckMode, AckRules, TransactedAckRules
from hafailover.driver.completions import SendCompletion
from hafailover.driver.consumer import Consumer
from hafailover.errors import (
    CallTimeoutError,
    ConfigurationError,
    DisconnectedError,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
    RemoteError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.sessions import CallKind
from hafailover.tx.state import CommitAction, TxPhase

if TYPE_CHECKING:
    from hafailover.driver.connection import Connection

__all__ = ["TransactionAttempt", "TransactionBlock", "Transactions"]

P = ParamSpec("P")
R = TypeVar("R")


class Transactions:
    """commit() and rollback(); mixed into ``Session``, whose state it uses."""

    connection: Connection
    rules: AckRules
    session_id: int
    ack_mode: AckMode
    _consumers: dict[str, Consumer]
    _tag_subscriptions: dict[str, str]
    _tx: object
    _tx_link: int
    _tx_sends: list[SendCompletion]
    _commit_link: int

    if TYPE_CHECKING:

        def _check_open(self) -> None: ...

        def _give_back(self, tags: tuple[str, ...]) -> None: ...

        def _drop_buffered(self, tags: tuple[str, ...]) -> None: ...

        def _dedup_settled(self, tags: tuple[str, ...]) -> None: ...

        def _dedup_forget(self, tags: tuple[str, ...]) -> None: ...

    def transaction(self, *, retries: int = 3) -> TransactionBlock:
        """A block of transacted work committed at its end and run again, up to
        ``retries`` more times, when a failover rolled it back (see TransactionBlock)."""
        self._transacted_rules("transaction")
        return TransactionBlock(self, retries)

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
            self._dedup_settled(received)

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
            error = fate.interrupted_error(exc)
            tx_rules.transaction_ended()
            self._tx = None
            if undo:
                # Given back below: the broker delivers them anew, under new ids. A copy a
                # reattach resent under the old ids is stale: never hand it out.
                self._drop_buffered(received)
        if undo:
            self._end_on_broker(handle, commit=False, received=received, quiet=True)
        raise error from None

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
        self._dedup_forget(received)
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


class TransactionAttempt:
    """One run of a transaction block: a context manager that commits when its block
    ends, rolls back when the block raises, and notes a commit that may be retried."""

    def __init__(self, session: Transactions, number: int, retry_unknown: bool) -> None:
        self.session = session
        self.number = number  # 1 for the first run
        self._retry_unknown = retry_unknown
        self.committed = False
        self.retry_because: HaFailoverError | None = None

    def __enter__(self) -> TransactionAttempt:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> bool:
        if error is not None:
            if isinstance(error, TransactionRolledBackError):
                self.retry_because = error  # the block's own commit() was rolled back
                return True
            self.session.rollback()  # the block failed: nothing of it is kept
            return False
        try:
            self.session.commit()
        except TransactionRolledBackError as exc:
            self.retry_because = exc  # F9: a failover made it rollback-only
            return True
        except TransactionOutcomeUnknownError as exc:
            if not self._retry_unknown:
                raise TransactionOutcomeUnknownError(
                    f"{exc}; not retried: the broker has no duplicate detection (or the "
                    "connection stamps no duplicate ids), so running the block again could "
                    "store its messages twice"
                ) from exc
            self.retry_because = exc  # the same messages, the same ids: stored once (F13)
            return True
        self.committed = True
        return False


class TransactionBlock:
    """``session.transaction(retries=N)``: run a block of transacted work, commit it, and
    run it again when a failover rolled it back (F9), as long as retries are left.

    Iterate for attempts, each a context manager::

        for attempt in session.transaction(retries=3):
            with attempt:
                for message in batch:          # the same Message objects every time:
                    producer.send(message)     # the same duplicate ids (F13)

    or decorate a function, which is then called once per attempt::

        @session.transaction(retries=3)
        def move() -> None: ...

    A commit whose outcome is unknown is retried only when the broker detects duplicates
    (``Connection.broker_detects_duplicates``); otherwise TransactionOutcomeUnknownError is
    raised, since a retry could store twice. An exception from the block rolls the
    transaction back and propagates; no retry."""

    def __init__(self, session: Transactions, retries: int) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"retries must be a whole number >= 0, not {retries!r}")
        self.session = session
        self.retries = retries

    def __iter__(self) -> Iterator[TransactionAttempt]:
        connection = self.session.connection
        for number in range(1, self.retries + 2):
            attempt = TransactionAttempt(
                self.session, number, retry_unknown=connection.broker_detects_duplicates
            )
            yield attempt
            if attempt.committed:
                return
            if attempt.retry_because is None:
                raise IllegalStateError(
                    "a transaction attempt was not used: run the block in 'with attempt:'"
                )
            last = attempt.retry_because
        raise TransactionRolledBackError(
            f"the transaction was rolled back {self.retries + 1} time(s); last: {last}"
        ) from last

    def __call__(self, function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            for attempt in self:
                with attempt:
                    result = function(*args, **kwargs)
                if attempt.committed:
                    return result
            raise AssertionError("unreachable: the attempts end by committing or raising")

        return run
