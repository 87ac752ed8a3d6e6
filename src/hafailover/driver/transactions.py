"""The transactions of a transacted session (F9, F3): commit, rollback and the broker's
transaction handle, begun on first use.

What a commit caught by a failover raises is decided by the transaction state
(``tx/state.py``), which the sessions core tells what the failover showed; this module
writes the commit or rollback, waits for the broker and says what happened. A mixin of
``Session``.

Each call that waits is written as steps (``driver/waits.py``): ``commit()`` and
``rollback()`` run them on the calling thread, hafailover.aio on its event loop, so both
wait the same way (call_timeout, call_failover_timeout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TypeVar

from hafailover.ack_modes import AckMode, AckRules
from hafailover.core.inflight import CallKind
from hafailover.driver.completions import SendCompletion
from hafailover.driver.consumer import Consumer
from hafailover.driver.waits import Steps, attempts, blocking, run_steps
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
from hafailover.tx.state import CommitAction, TransactionState, TxPhase

if TYPE_CHECKING:
    from hafailover.driver.connection import Connection
    from hafailover.protocols.base import Link

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
        self._transaction("transaction")
        return TransactionBlock(self, retries)

    def commit(self) -> None:
        """Commit the transaction; TransactionRolledBackError if failover made it
        rollback-only (F9), TransactionOutcomeUnknownError if the reply was lost (F3).

        Every way it can end without the broker's yes is the transaction state's decision
        (``tx/state.py``); this writes the commit, waits and carries the decision out."""
        run_steps(self.connection, self._commit_steps())

    def _commit_steps(self) -> Steps[None]:
        """``commit()`` as steps."""
        self._check_open()
        transaction = self._transaction("commit")
        rules = self.rules
        connection = self.connection
        with connection._cond:
            # One lock hold from the decision to reading the work it covers: a failover
            # applied in between would roll the work back behind the commit's back.
            decision = transaction.begin_commit()
            # The commit belongs to this link: if a failover replaces it before the commit
            # is written, the transaction rules decide its fate (it never moves links).
            self._commit_link = getattr(connection._link, "serial", 0)
            received = rules.received_in_transaction()
            if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
                self._tx_sends = []
                rules.transaction_ended()
                handle = self._take_tx(decision.rollback_on_broker)
            else:
                handle = self._tx
                # Its link was replaced and no failover rule caught it.
                moved = handle is not None and self._tx_link != self._commit_link
        if decision.action is CommitAction.ROLL_BACK_AND_RAISE:
            given_back = received if decision.give_back else ()
            yield from self._end_on_broker(handle, commit=False, received=given_back, quiet=True)
            raise decision.error()
        with connection._cond:
            caught = transaction.phase is not TxPhase.COMMITTING
            if not caught and not moved and handle is None and not received:
                transaction.commit_finished()  # nothing was done: nothing to commit
                rules.transaction_ended()
                return
        if caught or moved:
            # A failover applied since the decision caught the commit (it decided), or the
            # transaction's link is gone: never report a commit that did not happen.
            yield from self._end_interrupted_commit(None, received)
        try:
            if handle is None:
                # Only received so far: the acknowledges go in a transaction of their own.
                handle = yield from self._ensure_tx_steps()
            yield from self._settle_transfers()
            yield from self._end_on_broker(handle, commit=True, received=received, quiet=False)
        except (
            UnblockedError,
            TransactionOutcomeUnknownError,
            CallTimeoutError,
            DisconnectedError,
        ) as exc:
            # No answer came: the connection was lost (failed over or not, yet or for good)
            # or the call timed out.
            yield from self._end_interrupted_commit(exc, received)
        except TransactionRolledBackError:
            raise  # a refused send of the transaction: rolled back already
        except RemoteError as exc:
            with connection._cond:
                refused = transaction.commit_refused(str(exc))
                rules.transaction_ended()
                self._tx = None
            raise refused.error() from exc
        with connection._cond:
            transaction.commit_finished()
            rules.transaction_ended()
            self._tx = None
            self._dedup_settled(received)

    def _end_interrupted_commit(
        self, exc: BaseException | None, received: tuple[str, ...]
    ) -> Steps[NoReturn]:
        """End a commit that got no answer and raise what the transaction state says may
        have happened, rolling it back on the broker when the state says the broker still
        holds it (a commit never written on a link that lives on)."""
        transaction = self._transaction("commit")
        with self.connection._cond:
            fate = transaction.commit_cut(timed_out=isinstance(exc, CallTimeoutError))
            handle = self._take_tx(fate.rollback_on_broker)
            self.rules.transaction_ended()
            undo = fate.rollback_on_broker or fate.give_back
            if undo:
                # Given back below: the broker delivers them anew, under new ids. A copy a
                # reattach resent under the old ids is stale: never hand it out.
                self._drop_buffered(received)
        if undo:
            yield from self._end_on_broker(handle, commit=False, received=received, quiet=True)
        raise fate.error(exc) from None

    def rollback(self) -> None:
        """Roll the transaction back; always succeeds and cleans the session (F9)."""
        run_steps(self.connection, self._rollback_steps())

    def _rollback_steps(self) -> Steps[None]:
        """``rollback()`` as steps."""
        self._check_open()
        transaction = self._transaction("rollback")
        connection = self.connection
        with connection._cond:
            decision = transaction.rollback()
            handle, received = self._end_transaction_locked(on_broker=decision.rollback_on_broker)
        yield from self._end_on_broker(handle, commit=False, received=received, quiet=True)

    def _end_transaction_locked(self, *, on_broker: bool) -> tuple[object, tuple[str, ...]]:
        """Under the lock, for a rollback: forget the transaction's work and prefetched
        messages; return the broker's transaction to roll back (None: nothing to send)
        and the deliveries to give back."""
        self._tx_sends = []
        received = self.rules.received_in_transaction()
        self._dedup_forget(received)
        self.rules.transaction_ended()
        handle = self._take_tx(on_broker)
        for consumer in self._consumers.values():
            consumer._drop_buffer(give_back=True)
        return handle, received

    def _settle_transfers(self) -> Steps[None]:
        """AMQP: every transfer of the transaction settled by the broker before the
        discharge; a refused one fails the commit (the transaction state decides)."""
        sends, self._tx_sends = self._tx_sends, []
        for completion in sends:
            try:
                yield from self.connection._completion_steps(completion)
            except UnblockedError:
                raise
            except RemoteError as exc:
                transaction = self._transaction("commit")
                with self.connection._cond:
                    decision = transaction.transfer_refused(str(exc))
                    handle, received = self._end_transaction_locked(
                        on_broker=decision.rollback_on_broker
                    )
                yield from self._end_on_broker(handle, commit=False, received=received, quiet=True)
                raise decision.error() from exc

    def _take_tx(self, on_broker: bool) -> object:
        """Under the lock: the transaction is over here; its broker handle when the
        transaction state says the broker holds it (to roll it back there), else None."""
        handle, self._tx = self._tx, None
        return handle if on_broker else None

    def _end_on_broker(
        self, handle: object, *, commit: bool, received: tuple[str, ...], quiet: bool
    ) -> Steps[None]:
        """Acknowledge what was received inside the transaction, then commit or roll back."""
        connection = self.connection
        if handle is None:
            if not commit:
                with connection._cond:
                    self._give_back(received)
            return
        completion = SendCompletion(connection, None)
        written = yield from attempts(
            functools.partial(
                self._acknowledges_written,
                handle,
                completion,
                commit=commit,
                received=received,
                deadline=connection._failover_deadline(),
            )
        )
        if written is None:
            return
        link, settled = written
        try:
            if settled:
                # The discharge must not overtake these dispositions: written once settled.
                for ack in settled:
                    yield from connection._completion_steps(ack)
                if not self._end_written(link, handle, completion, commit=commit):
                    return
            yield from connection._completion_steps(completion)
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

    def _acknowledges_written(
        self,
        handle: object,
        completion: SendCompletion,
        *,
        commit: bool,
        received: tuple[str, ...],
        deadline: float | None,
    ) -> tuple[Link, list[SendCompletion]] | None:
        """Under the lock, once the connection admits calls (WouldBlock, nothing done,
        while it fails over): write the acknowledges of ``received`` and, unless the broker
        must settle them first, the commit or rollback itself. The link and the
        acknowledges to see settled before the commit is written; None when there is
        nothing left to end."""
        connection = self.connection
        with connection._cond:
            link = connection._admit(deadline, block=False)
            if self._tx_link != link.serial or (commit and link.serial != self._commit_link):
                # The transaction died with its link while this call waited for the
                # failover: a commit learns its fate from the transaction rules (F3, F9).
                if commit:
                    raise UnblockedError("the transaction's connection failed over")
                self._give_back(received)
                return None
            settled: list[SendCompletion] = []
            if commit:
                for tag in received:
                    ack_token = None
                    if link.settles_transacted_work:
                        ack = SendCompletion(connection, None)
                        ack_token = connection._call(CallKind.ACK, ack, self)
                        settled.append(ack)
                    link.acknowledge(
                        self._tag_subscriptions.get(tag, ""), tag, tx=handle, token=ack_token
                    )
                    connection._written(ack_token, link, -1, asked=True)
            if not settled:
                self._end_written(link, handle, completion, commit=commit)
            return link, settled

    def _end_written(
        self, link: Link, handle: object, completion: SendCompletion, *, commit: bool
    ) -> bool:
        """Register and write the commit or rollback on ``link`` (never waits); False when
        ``link`` is no longer the connection's (a rollback is then the failover's)."""
        connection = self.connection
        with connection._cond:
            if connection._admitted_link() is not link:
                # Lost while its acknowledges settled: a commit learns its fate from the
                # transaction rules (F3, F9); a rollback happened with the link.
                if commit:
                    raise UnblockedError("the transaction's connection failed over")
                return False
            token = connection._call(CallKind.END, completion, self, commit=commit)
            command_id = connection._window.next_id if link.windowed else -1
            try:
                link.end(handle, commit=commit, token=token)
            except HaFailoverError as exc:
                # Never written. Lost with the link: the failover's rules decide (a commit
                # not written is rolled back, F3). Refused here (the link closed, the
                # transaction unknown to it): the call ends with that error, not at its
                # call_timeout.
                connection._io_failed(link, exc)
                if not isinstance(exc, NotConnectedError | UnblockedError):
                    connection._abandon(token, exc)
            else:
                connection._written(token, link, command_id, asked=True)
                if commit:
                    self._transaction("commit").commit_written()
            return True

    def _transaction(self, what: str) -> TransactionState:
        transaction = self.rules.transaction
        if transaction is None:
            raise IllegalStateError(
                f"{what}() needs a transacted session; this one is {self.ack_mode.value}"
            )
        return transaction

    def _ensure_tx(self) -> object:
        """The broker transaction for the current work, begun on first use."""
        return run_steps(self.connection, self._ensure_tx_steps())

    def _ensure_tx_steps(self) -> Steps[object]:
        """``_ensure_tx()`` as steps: it waits out a failover (F1), and a link whose calls
        block begins it with the lock let go."""
        connection = self.connection
        deadline = connection._failover_deadline()
        while True:
            link, handle = yield from attempts(functools.partial(self._tx_now, deadline))
            if handle is not None:
                return handle
            if link is None:
                continue  # F1: wait for the failover; its rules decide the work's fate
            try:
                # AMQP declare waits for the broker: outside the lock
                handle = yield from blocking(link.begin)
            except (NotConnectedError, UnblockedError) as exc:
                connection._io_failed(link, exc)
                continue
            with connection._cond:
                if self._tx is None or self._tx_link != link.serial:
                    self._tx = handle
                    self._tx_link = link.serial
                    self._transaction("begin").begun_on_broker()
                return self._tx

    def _tx_now(self, deadline: float | None) -> tuple[Link | None, object]:
        """Under the lock, once the connection admits calls (WouldBlock, nothing done,
        while it fails over): the link and the transaction's handle, begun now unless the
        link's calls block (then None: begin it outside the lock). No link when the begin
        failed with the link: the failover comes next."""
        connection = self.connection
        with connection._cond:
            link = connection._admit(deadline, block=False)
            if self._tx is not None and self._tx_link == link.serial:
                return link, self._tx
            if link.calls_block:
                return link, None
            try:
                self._tx = link.begin()
            except (NotConnectedError, UnblockedError) as exc:
                connection._io_failed(link, exc)
                return None, None
            self._tx_link = link.serial
            self._transaction("begin").begun_on_broker()
            return link, self._tx

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
        return run_steps(self.session.connection, self._exit_steps(error))

    def _exit_steps(self, error: BaseException | None) -> Steps[bool]:
        """``__exit__`` as steps: whether to swallow ``error`` (to run the block again)."""
        if error is not None:
            if isinstance(error, TransactionRolledBackError):
                self.retry_because = error  # the block's own commit() was rolled back
                return True
            yield from self.session._rollback_steps()  # the block failed: nothing is kept
            return False
        try:
            yield from self.session._commit_steps()
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
