"""A link over one AMQP 1.0 connection: the driver's operations as AMQP transfers.

AMQP links carry the driver's token in the transfer and report its settlement; the engine
(``engine.AmqpEngine``) runs on a socket through ``transport.AmqpTransport``. What a link is
and owes the driver: ``hafailover.protocols.base.Link``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hafailover.core.subscriptions import NamedSubscription
from hafailover.destination import Destination
from hafailover.errors import (
    CallTimeoutError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.amqp.engine import AmqpTransaction, Outcome
from hafailover.protocols.amqp.transport import AmqpTransport
from hafailover.protocols.base import LINK_SERIALS, LinkEvents, Opened, TlsOptions
from hafailover.url import BrokerAddress, FailoverPolicy

__all__ = ["AmqpLink"]


class AmqpLink:
    """A link over one AMQP 1.0 connection (``transport.AmqpTransport``: proton's engine on a
    socket)."""

    def __init__(self, events: LinkEvents, policy: FailoverPolicy) -> None:
        self.serial = next(LINK_SERIALS)
        self.events = events
        self.policy = policy
        self.windowed = False  # no reattach extension on AMQP: every failover reconnects
        # attach and declare wait for the broker's answer
        self.calls_block = True
        # the broker settles transactional transfers and dispositions; a discharge must not
        # overtake them
        self.settles_transacted_work = True
        self._transport = AmqpTransport(
            _AmqpEvents(self),
            tls=TlsOptions.of(policy),
            heartbeat=policy.heartbeat,
            connect_timeout=max(2.0, policy.heartbeat * 4),
            call_timeout=policy.call_timeout,
            # Requests made under the driver's lock are written once it is released.
            flush_later=self._flush_later,
            container_id=policy.client_id,
        )
        self._removals = itertools.count(1)
        self.broker: BrokerAddress = policy.brokers[0]

    def _flush_later(self, flush: Callable[[], None]) -> None:
        self.events.link_output(self, flush)

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        self.broker = broker
        return self._transport.open(broker)

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        self._transport.send(
            token,
            destination,
            message,
            duplicate_detection=self.policy.duplicate_detection,
            tx=_transaction(tx),
        )
        return -1

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
        named: NamedSubscription | None = None,
    ) -> None:
        # A named subscription is a link of that name (Qpid JMS): with a durable source
        # when durable, with the capability "shared" when shared; the container id is the
        # client id (``open``).
        name = None if named is None else named.broker_name
        self._answer(
            token,
            lambda: self._transport.subscribe(
                subscription,
                destination,
                credit=prefetch,  # 0: credit only while a receive waits (pull)
                settle_on_delivery=not acknowledged,
                durable_name=name if named is not None and named.durable else None,
                shared_name=name if named is not None and named.shared else None,
            ),
        )

    def remove_subscription(self, name: str, *, token: int) -> None:
        self._answer(
            token,
            lambda: self._transport.remove_subscription(
                f"unsubscribe-{name}-{next(self._removals)}", name
            ),
        )

    def _answer(self, token: int | None, call: Callable[[], None]) -> None:
        """Make a blocking call and complete ``token`` with the broker's answer."""
        error: RemoteError | None = None
        try:
            call()
        except RemoteError as exc:
            if token is None or isinstance(
                exc, NotConnectedError | UnblockedError | CallTimeoutError
            ):
                # The connection failed or did not answer in time, not the subscription:
                # the caller decides (a failover's recreation fails its attempt).
                raise
            error = exc
        if token is not None:
            self.events.link_completed(self, token, error)

    def pull(self, subscription: str) -> None:
        self._transport.pull(subscription)

    def drain(self, subscription: str) -> None:
        self._transport.drain(subscription)

    def unsubscribe(self, subscription: str) -> None:
        self._transport.unsubscribe(subscription)

    def browse(self, subscription: str, queue: Destination) -> None:
        self._transport.subscribe(
            subscription, queue, credit=200, settle_on_delivery=True, browse=True
        )

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        # The broker's settlement confirms the acknowledge (inside a transaction: that the
        # broker holds it in the transaction).
        self._transport.settle(int(tag), Outcome.ACCEPTED, tx=_transaction(tx), token=token)

    def redeliver(self, subscription: str, tag: str) -> None:
        self._transport.settle(int(tag), Outcome.MODIFIED)

    def reject(self, subscription: str, tag: str) -> None:
        self._transport.settle(int(tag), Outcome.REJECTED)

    def begin(self) -> object:
        return self._transport.declare()

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        # Never waits: the broker's answer completes the token (``on_settled``).
        transaction = _transaction(tx)
        assert transaction is not None
        self._transport.discharge_later(transaction, fail=not commit, token=token)

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        created = self._transport.create_temporary_queue()
        if wanted is not None and wanted != created:
            self._transport.alias_temporary_queue(wanted, created)
            return wanted
        return created

    def replay(self, payload: object) -> None:
        raise NotConnectedError("AMQP links have no confirmation window to replay")

    def sync(self, token: int) -> None:
        raise NotConnectedError("AMQP links confirm each call on its own: nothing to sync")

    def resend(self, payload: object) -> int:
        raise NotConnectedError("AMQP links have no confirmation window to resend from")

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()


def _transaction(tx: object) -> AmqpTransaction | None:
    if tx is None or isinstance(tx, AmqpTransaction):
        return tx
    raise TypeError(f"not an AMQP transaction: {tx!r}")


class _AmqpEvents:
    def __init__(self, link: AmqpLink) -> None:
        self._link = link
        self._events = link.events

    def on_message(self, subscription: str, delivery: int, message: Message) -> None:
        self._events.link_message(self._link, subscription, str(delivery), message)

    def on_settled(self, token: int, error: RemoteError | None) -> None:
        if token:
            self._events.link_completed(self._link, token, error)

    def on_error(self, error: ProtocolError) -> None:
        self._events.link_error(self._link, error)

    def on_lost(self, reason: str) -> None:
        self._events.link_lost(self._link, reason)

    def on_browse_end(self, subscription: str) -> None:
        self._events.link_browse_end(self._link, subscription)

    def on_redirect(self, host: str, port: int | None) -> None:
        self._events.link_redirected(self._link, host, port)
