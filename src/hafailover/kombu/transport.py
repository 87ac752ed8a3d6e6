"""The kombu transport: kombu's channel calls carried out on a hafailover connection.

A real ``kombu.transport.base.Transport``, not kombu's virtual one: messages stay on the
broker until they are acknowledged, and the broker redelivers what a consumer had not
acknowledged when its session ended. One kombu connection is one hafailover connection
(failover happens inside it, where kombu and Celery never see it); one kombu channel is one
hafailover session in CLIENT_INDIVIDUAL mode, so each kombu ``ack`` acknowledges one message
and each ``reject(requeue=True)`` gives one back (``Message.release()``).

What this module owns, and what it must never do:

- Consumers deliver through message listeners into one inbox per connection, which
  ``drain_events`` empties on the caller's thread, where kombu's callbacks run. Acknowledges
  may come from any thread (Celery's pools acknowledge from theirs); the hafailover driver
  serializes them. An acknowledge returns once written, as py-amqp's does: a pool thread
  does not wait a broker round trip per task. One a failover loses is a lost acknowledge
  (the broker delivers the message again), which the delivery window below drops when it
  is on.
- Exchanges and bindings become queues and topics (``_routing``); a message travels with
  its kombu headers, properties, exchange and routing key in one JSON property, so nothing
  kombu sets depends on what a broker's STOMP or AMQP mapping keeps.
- The delivery window (``consumer_dedup`` of the URL, per queue and message id) keeps a
  failover from running a message twice: a copy of a message whose acknowledge was called
  is acknowledged and dropped; a copy of one still being processed waits for it and is
  acknowledged with it. A stale acknowledge (the failover made the broker take the message
  back) is then not an error: its redelivery is settled on arrival.
- It never retries on its own what hafailover reported in doubt, and never swallows a
  connection hafailover gave up on: that reaches ``drain_events`` and kombu's callers as one
  of ``connection_errors``, where Celery restarts its consumer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import kombu.exceptions
from amqp.protocol import queue_declare_ok_t
from kombu.message import Message as KombuMessage
from kombu.transport import base

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    DisconnectedError,
    HaFailoverError,
    NotConnectedError,
    Protocol,
    ProtocolError,
    StaleAcknowledgeError,
    UnblockedError,
    parse_url,
)
from hafailover.kombu._routing import Binding, Routes

__all__ = ["Channel", "Connection", "Transport"]

log = logging.getLogger("hafailover.kombu")

# The one property that carries kombu's envelope (headers, properties, exchange, key).
ENVELOPE = "kombu_envelope"
# Subscriptions made with no basic_qos before them, or with prefetch_count 0 (unlimited).
DEFAULT_PREFETCH = 100
# How long basic_get waits for a message on a queue it has not read before: the first
# subscription needs a round trip before the broker sends anything.
FIRST_GET_WAIT = 1.0
LATER_GET_WAIT = 0.25
# How long queue_purge waits for the next message before it calls the queue empty.
PURGE_IDLE = 0.3

# Options of broker_transport_options that kombu itself reads: accepted, not used here.
_KOMBU_OPTIONS = frozenset(
    {
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "connect_retries_timeout",
        "confirm_timeout",
    }
)
# Options of this transport (docs/celery.md).
_OWN_OPTIONS = frozenset({"confirm_publish"})

# One routing table per process: exchanges and bindings that any connection declared.
ROUTES = Routes()


class _Closed:
    """The inbox's marker that its connection was closed."""


@dataclass
class _Subscription:
    """A kombu consumer (one basic_consume) and the hafailover consumers behind it."""

    tag: str
    queue: str
    no_ack: bool
    callback: Callable[[Any], Any] | None
    broadcast: list[Binding]
    consumers: list[hafailover.Consumer] = field(default_factory=list)
    cancelled: bool = False


@dataclass
class _Raw:
    """A delivery as the channel hands it to kombu (``message_to_python`` makes a Message)."""

    message: hafailover.Message
    delivery_tag: int
    consumer_tag: str | None
    envelope: dict[str, Any]


def _envelope_of(message: hafailover.Message) -> dict[str, Any]:
    raw = message.properties.get(ENVELOPE)
    if not isinstance(raw, str):
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class DeliveryWindow:
    """Which message ids each queue is processing or has processed (the URL's
    ``consumer_dedup``, oldest out): copies a failover brings again are not run twice.
    Keys are (queue, id): a broadcast reaches each bound queue with one id."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._active: dict[tuple[str, str], list[tuple[Channel, hafailover.Message]]] = {}
        self._done: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self.dropped = 0

    def arrived(
        self, key: tuple[str, str] | None, channel: Channel, message: hafailover.Message
    ) -> str:
        """``deliver``, ``drop`` (acknowledge it: its first copy was processed) or
        ``park`` (its first copy is being processed; it is settled with it)."""
        if key is None or self.size == 0:
            return "deliver"
        with self._lock:
            if key in self._done:
                self.dropped += 1
                return "drop"
            parked = self._active.get(key)
            if parked is not None:
                parked.append((channel, message))
                self.dropped += 1
                return "park"
            self._active[key] = []
            return "deliver"

    def finished(self, key: tuple[str, str] | None) -> list[tuple[Channel, hafailover.Message]]:
        """The message is acknowledged (or discarded): later copies are dropped; the copies
        waiting for it are returned, to be acknowledged."""
        if key is None or self.size == 0:
            return []
        with self._lock:
            parked = self._active.pop(key, [])
            self._done[key] = None
            self._done.move_to_end(key)
            while len(self._done) > self.size:
                self._done.popitem(last=False)
            return parked

    def released(self, key: tuple[str, str] | None) -> list[tuple[Channel, hafailover.Message]]:
        """The message goes back to its queue unprocessed: a later copy is delivered."""
        if key is None or self.size == 0:
            return []
        with self._lock:
            return self._active.pop(key, [])

    def handed_back(self, key: tuple[str, str] | None) -> None:
        """A parked copy replaces its first: it is being processed now."""
        if key is None or self.size == 0:
            return
        with self._lock:
            self._active.setdefault(key, [])


class Channel(base.StdChannel):
    """A kombu channel: one hafailover session (CLIENT_INDIVIDUAL)."""

    Message: ClassVar[type[KombuMessage]] = KombuMessage

    def __init__(self, connection: Connection, channel_id: int) -> None:
        self.connection = connection
        self.channel_id = channel_id
        self.no_ack_consumers: set[str] = set()  # type: ignore[assignment]  # base: None
        self.session = connection.ha.create_session(AckMode.CLIENT_INDIVIDUAL)
        self._producer = self.session.create_producer(confirm=connection.confirm_publish)
        self._prefetch = DEFAULT_PREFETCH
        # kombu's prefetch_count: deliveries handed to kombu and not settled, at most (0:
        # no limit). Kept here: hafailover's prefetch bounds what a consumer buffers, which
        # on AMQP is not what the application holds.
        self._limit = 0
        self._backlog: collections.deque[tuple[_Subscription, hafailover.Message]] = (
            collections.deque()
        )
        self._subscriptions: dict[str, _Subscription] = {}
        self._cancelling: dict[str, _Subscription] = {}  # cancelled, holding deliveries
        self._delivered: dict[int, tuple[_Raw, str]] = {}
        self._delivery_tags = itertools.count(1)
        self._consumer_tags = itertools.count(1)
        self._get_session: hafailover.Session | None = None
        self._get_consumers: dict[str, hafailover.Consumer] = {}
        self._lock = threading.Lock()
        self.is_open = True

    # --- publishing ----------------------------------------------------------------------

    def prepare_message(
        self,
        body: bytes | str,
        priority: int | None = None,
        content_type: str | None = None,
        content_encoding: str | None = None,
        headers: dict[str, Any] | None = None,
        properties: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if properties is None:
            properties = {}
        # kombu prepares the message again on each retry of one publish, with the same
        # properties: the id stored there keeps the duplicate id across those retries (F13).
        properties.setdefault("message_id", uuid.uuid4().hex)
        if priority is not None:
            properties["priority"] = priority
        if isinstance(body, str):
            body = body.encode(content_encoding or "utf-8")
        return {
            "body": body,
            "content_type": content_type,
            "content_encoding": content_encoding,
            "headers": dict(headers or {}),
            "properties": properties,
        }

    def basic_publish(
        self,
        message: dict[str, Any],
        exchange: str = "",
        routing_key: str = "",
        mandatory: bool = False,
        immediate: bool = False,
        **kwargs: Any,
    ) -> None:
        self._check_open()
        properties = dict(message["properties"])
        envelope = {
            "headers": message["headers"],
            "properties": properties,
            "content_type": message["content_type"],
            "content_encoding": message["content_encoding"],
            "exchange": exchange,
            "routing_key": routing_key,
        }
        try:
            encoded = json.dumps(envelope)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"kombu headers and properties must be JSON-serializable to travel over "
                f"STOMP and AMQP 1.0: {exc}"
            ) from exc
        broadcast = ROUTES.broadcasts(exchange)
        if broadcast:
            destinations = [f"topic://{exchange}"]
        else:
            queues = ROUTES.queues_for(exchange, routing_key)
            destinations = [ROUTES.address(name) for name in queues]
        priority = properties.get("priority")
        expiration = properties.get("expiration")
        # A transient message to a queue goes persistent over STOMP: RabbitMQ's STOMP plugin
        # declares the queue a SEND names from its "persistent" header, and "false" declares
        # it exclusive to the sender's connection, which a queue that exists already (a
        # consumer's SUBSCRIBE declared it durable) refuses with RESOURCE_LOCKED: Celery's
        # remote-control replies and rpc results are transient. kombu still reads the
        # message's own delivery_mode from the envelope.
        persistent = properties.get("delivery_mode", 2) == 2 or (
            not broadcast and self.connection.protocol is Protocol.STOMP
        )
        outgoing = hafailover.Message(
            body=message["body"],
            properties={ENVELOPE: encoded},
            persistent=persistent,
            priority=4 if priority is None else max(0, min(9, int(priority))),
            time_to_live=None if expiration is None else max(float(expiration) / 1000.0, 0.001),
            correlation_id=_text(properties.get("correlation_id")),
            message_id=str(properties["message_id"]),
        )
        for destination in destinations:
            self._producer.send(outgoing, destination=destination)

    # --- declarations --------------------------------------------------------------------

    def exchange_declare(
        self,
        exchange: str = "",
        type: str = "direct",
        passive: bool = False,
        durable: bool = False,
        auto_delete: bool = True,
        nowait: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        if passive or not exchange:
            return
        try:
            ROUTES.declare_exchange(exchange, type, durable=durable)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from exc

    def exchange_delete(
        self, exchange: str = "", if_unused: bool = False, nowait: bool = False
    ) -> None:
        ROUTES.delete_exchange(exchange)

    def queue_declare(
        self,
        queue: str = "",
        passive: bool = False,
        durable: bool = False,
        exclusive: bool = False,
        auto_delete: bool = True,
        nowait: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Any:
        # STOMP and AMQP 1.0 brokers make a queue when it is first used, and neither
        # protocol tells its length: the counts are unknown, reported as 0. A queue of a
        # type (quorum) must exist already: it is then used as it is.
        name = queue or f"amq.gen-{uuid.uuid4().hex}"
        ROUTES.declare_queue(name, arguments)
        return queue_declare_ok_t(name, 0, 0)

    def queue_bind(
        self,
        queue: str,
        exchange: str = "",
        routing_key: str = "",
        nowait: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        ROUTES.bind(queue, exchange, routing_key)

    def queue_unbind(
        self,
        queue: str,
        exchange: str = "",
        routing_key: str = "",
        nowait: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        ROUTES.unbind(queue, exchange, routing_key)

    def exchange_bind(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigurationError(
            "exchange-to-exchange bindings have no STOMP or AMQP 1.0 equivalent; "
            "bind the queues to the exchange instead"
        )

    exchange_unbind = exchange_bind

    def queue_purge(self, queue: str, nowait: bool = False) -> int:
        """Consume and count what waits on ``queue`` (what this connection's own
        consumers hold unacknowledged is not purged)."""
        self._check_open()
        count = 0
        session = self.connection.ha.create_session(AckMode.DUPS_OK)
        try:
            consumer = session.create_consumer(ROUTES.address(queue), prefetch=500, dedup=0)
            while consumer.receive(PURGE_IDLE) is not None:
                count += 1
        finally:
            session.close()
        return count

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, nowait: bool = False
    ) -> int:
        """Neither protocol deletes a queue: its messages are purged and its bindings
        forgotten; the broker keeps the (empty) queue."""
        count = 0 if if_empty else self.queue_purge(queue)
        ROUTES.forget_queue(queue)
        return count

    # --- consuming -----------------------------------------------------------------------

    def basic_qos(
        self, prefetch_size: int = 0, prefetch_count: int = 0, a_global: bool = False
    ) -> None:
        """At most ``prefetch_count`` deliveries of this channel unsettled (0: no limit),
        from now on; subscriptions made later also ask the broker for that many at once."""
        if (
            isinstance(prefetch_count, bool)
            or not isinstance(prefetch_count, int)
            or prefetch_count < 0
        ):
            raise ConfigurationError(
                f"prefetch_count must be a whole number >= 0, not {prefetch_count!r}"
            )
        self._prefetch = prefetch_count or DEFAULT_PREFETCH
        with self._lock:
            self._limit = prefetch_count
        self._release_backlog()

    def admits(self, subscription: _Subscription, message: hafailover.Message) -> bool:
        """Whether a delivery may go to kombu now; else it waits in the backlog until a
        delivery of this channel is settled (qos)."""
        with self._lock:
            if subscription.no_ack or not self._limit or len(self._delivered) < self._limit:
                return True
            self._backlog.append((subscription, message))
            return False

    def _release_backlog(self) -> None:
        with self._lock:
            released = []
            room = (self._limit or len(self._backlog)) - len(self._delivered)
            while self._backlog and room > 0:
                released.append(self._backlog.popleft())
                room -= 1
        for subscription, message in released:
            self.connection.inbox.put((self, subscription, message))

    def basic_consume(
        self,
        queue: str = "",
        consumer_tag: str = "",
        no_local: bool = False,
        no_ack: bool = False,
        exclusive: bool = False,
        nowait: bool = False,
        callback: Callable[[Any], Any] | None = None,
        arguments: dict[str, Any] | None = None,
        on_cancel: Callable[[str], Any] | None = None,
        **kwargs: Any,
    ) -> str:
        self._check_open()
        tag = consumer_tag or f"ctag-{self.channel_id}-{next(self._consumer_tags)}"
        if tag in self._subscriptions:
            raise ConfigurationError(f"consumer tag {tag!r} is in use on this channel")
        queues, broadcast = ROUTES.subscriptions(queue)
        subscription = _Subscription(tag, queue, no_ack, callback, broadcast)
        destinations = [ROUTES.address(name) for name in queues]
        destinations += sorted({f"topic://{b.exchange}" for b in broadcast})
        try:
            for destination in destinations:
                consumer = self.session.create_consumer(
                    destination, prefetch=self._prefetch, dedup=0
                )
                subscription.consumers.append(consumer)
                consumer.set_message_listener(functools.partial(self._arrived, subscription))
        except BaseException:
            for consumer in subscription.consumers:
                consumer.close()
            raise
        self._subscriptions[tag] = subscription
        if no_ack:
            self.no_ack_consumers.add(tag)
        return tag

    def _arrived(self, subscription: _Subscription, message: hafailover.Message) -> None:
        self.connection.arrived(self, subscription, message)

    def basic_cancel(self, consumer_tag: str, nowait: bool = False) -> None:
        """Stop delivering; the subscriptions end once kombu has settled what they
        delivered (an acknowledge after basic_cancel is valid in kombu, and a STOMP broker
        refuses one for a subscription that is gone)."""
        subscription = self._subscriptions.pop(consumer_tag, None)
        self.no_ack_consumers.discard(consumer_tag)
        if subscription is None:
            return
        subscription.cancelled = True
        for consumer in subscription.consumers:
            consumer.set_message_listener(None)  # what still comes waits in its buffer
        with self._lock:
            holds = any(raw.consumer_tag == consumer_tag for raw, _ in self._delivered.values())
            if holds:
                self._cancelling[consumer_tag] = subscription
        if not holds:
            _close_all(subscription.consumers)

    def basic_get(self, queue: str = "", no_ack: bool = False, **kwargs: Any) -> _Raw | None:
        self._check_open()
        if self._get_session is None:
            self._get_session = self.connection.ha.create_session(AckMode.CLIENT_INDIVIDUAL)
        consumer = self._get_consumers.get(queue)
        wait = LATER_GET_WAIT
        if consumer is None:
            consumer = self._get_session.create_consumer(ROUTES.address(queue), prefetch=1, dedup=0)
            self._get_consumers[queue] = consumer
            wait = FIRST_GET_WAIT
        while True:
            message = consumer.receive(wait)
            if message is None:
                return None
            decision = self.connection.window.arrived(_key(queue, message), self, message)
            if decision == "deliver":
                break
            if decision == "drop":
                _settle(message)
        raw = self.delivered(message, None, queue)
        if no_ack:
            self.basic_ack(raw.delivery_tag)
        return raw

    def delivered(self, message: hafailover.Message, consumer_tag: str | None, queue: str) -> _Raw:
        """Number a message handed to kombu; ``basic_ack``/``basic_reject`` find it by it."""
        with self._lock:
            raw = _Raw(message, next(self._delivery_tags), consumer_tag, _envelope_of(message))
            self._delivered[raw.delivery_tag] = (raw, queue)
        return raw

    def message_to_python(self, raw: _Raw) -> KombuMessage:
        envelope = raw.envelope
        properties = dict(envelope.get("properties") or {})
        message = raw.message
        redelivered = bool(
            message.redelivered or message.delivery_count > 1 or envelope.get("redelivered")
        )
        delivery_info = {
            "exchange": envelope.get("exchange", ""),
            "routing_key": envelope.get("routing_key", ""),
            "consumer_tag": raw.consumer_tag,
            "redelivered": redelivered,
            "delivery_tag": raw.delivery_tag,
            "priority": properties.get("priority", message.priority),
        }
        properties["delivery_info"] = delivery_info
        return self.Message(
            body=message.body_bytes,
            delivery_tag=raw.delivery_tag,
            content_type=envelope.get("content_type"),
            content_encoding=envelope.get("content_encoding"),
            delivery_info=delivery_info,
            properties=properties,
            headers=envelope.get("headers") or {},
            channel=self,
        )

    # --- settling ------------------------------------------------------------------------

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        for tag in self._tags(delivery_tag, multiple=multiple):
            self._finish(tag)

    def basic_reject(self, delivery_tag: int, requeue: bool = False) -> None:
        if not requeue:
            self._finish(delivery_tag)  # discarded: settled as an acknowledge is
            return
        raw, queue_name = self._take(delivery_tag)
        try:
            self._requeue(raw, queue_name)
        finally:
            self._settled(raw)

    def _requeue(self, raw: _Raw, queue_name: str) -> None:
        window = self.connection.window
        key = _key(queue_name, raw.message)
        parked = window.released(key)
        subscription = self._subscription_of(raw)
        if parked and subscription is not None:
            # A failover brought the message again already: that copy is the requeued one.
            self._acknowledge(raw.message, stale_ok=True)
            (channel, first), *rest = parked
            window.handed_back(key)
            for _, copy in rest:
                _settle(copy)
            self.connection.inbox.put((channel, subscription, first))
            return
        for _, copy in parked:
            _settle(copy)
        if subscription is not None and subscription.broadcast and not _from_queue(raw):
            # A broadcast copy is this queue's alone: it is delivered again here.
            self.connection.inbox.put((self, subscription, raw.message))
            return
        # The message itself goes back, alone (a STOMP NACK, the AMQP modified outcome with
        # delivery-failed): the broker delivers it again with its delivery count raised,
        # and the window, which let go of it above, delivers that copy.
        try:
            raw.message.release()
        except StaleAcknowledgeError:
            # A failover gave it back with the old broker session already: it comes again.
            log.info(
                "requeue of %s on %s: a failover gave it back already",
                raw.message.message_id,
                queue_name,
            )

    def basic_recover(self, requeue: bool = True) -> None:
        """Every message this channel delivered and kombu has not settled goes back."""
        with self._lock:
            delivered = list(self._delivered.values())
            self._delivered.clear()
        with self._lock:
            delivered += [(_Raw(m, 0, None, {}), s.queue) for s, m in self._backlog]
            self._backlog.clear()
        for raw, queue_name in delivered:
            self.connection.window.released(_key(queue_name, raw.message))
        self.session.recover()

    def _settled(self, raw: _Raw) -> None:
        """After a delivery was settled: end its cancelled subscription if that held
        nothing else, and hand over what the prefetch limit held back."""
        tag = raw.consumer_tag
        ended = None
        with self._lock:
            if tag in self._cancelling and not any(
                held.consumer_tag == tag for held, _ in self._delivered.values()
            ):
                ended = self._cancelling.pop(tag)
        if ended is not None:
            _close_all(ended.consumers)
        self._release_backlog()

    def _tags(self, delivery_tag: int, *, multiple: bool) -> list[int]:
        if not multiple:
            return [delivery_tag]
        with self._lock:
            return sorted(tag for tag in self._delivered if tag <= delivery_tag)

    def _take(self, delivery_tag: int) -> tuple[_Raw, str]:
        with self._lock:
            entry = self._delivered.pop(delivery_tag, None)
        if entry is None:
            raise kombu.exceptions.ChannelError(
                f"unknown delivery tag {delivery_tag} on channel {self.channel_id}: "
                "never delivered here, or settled already"
            )
        return entry

    def _finish(self, delivery_tag: int) -> None:
        """Acknowledge (or discard) a delivery, with the copies a failover brought of it."""
        raw, queue_name = self._take(delivery_tag)
        window = self.connection.window
        try:
            acknowledged = self._acknowledge(raw.message, stale_ok=window.size > 0)
        finally:
            for _, copy in window.finished(_key(queue_name, raw.message)):
                _settle(copy)
            self._settled(raw)
        if not acknowledged:
            log.warning(
                "acknowledge of %s on %s went stale in a failover; the window drops the "
                "broker's redelivery",
                raw.message.message_id,
                queue_name,
            )

    def _acknowledge(self, message: hafailover.Message, *, stale_ok: bool) -> bool:
        """True when acknowledged; False when a failover made it stale or left its outcome
        unknown (only with ``stale_ok``, else that raises: kombu's callers log it as
        "could not ack")."""
        try:
            message.acknowledge(confirm=False)
        except (StaleAcknowledgeError, AcknowledgeFailedError, UnblockedError):
            # Stale, or caught by the failover with its outcome unknown: either way the
            # broker may deliver the message again.
            if not stale_ok:
                raise
            return False
        return True

    def _subscription_of(self, raw: _Raw) -> _Subscription | None:
        if raw.consumer_tag is None:
            return None
        tag = raw.consumer_tag
        return self._subscriptions.get(tag) or self._cancelling.get(tag)

    # --- life ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self.is_open:
            raise kombu.exceptions.ChannelError(f"channel {self.channel_id} is closed")

    def close(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        for tag in list(self._subscriptions):
            self.basic_cancel(tag)
        for subscription in self._cancelling.values():
            _close_all(subscription.consumers)
        self._cancelling.clear()
        with contextlib.suppress(HaFailoverError):
            # Messages delivered and not settled go back to the broker with the session.
            self.session.close()
            if self._get_session is not None:
                self._get_session.close()
        self.connection.forget(self)

    def flow(self, active: bool) -> None:
        """Nothing to do: prefetch (credit) holds back what a consumer has not taken."""


def _close_all(consumers: Iterable[hafailover.Consumer]) -> None:
    for consumer in consumers:
        with contextlib.suppress(HaFailoverError):
            consumer.close()


def _from_queue(raw: _Raw) -> bool:
    destination = raw.message.destination
    return destination is not None and not destination.is_topic


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _key(queue_name: str, message: hafailover.Message) -> tuple[str, str] | None:
    return None if message.message_id is None else (queue_name, message.message_id)


def _settle(message: hafailover.Message) -> None:
    """Acknowledge a copy nobody will process (its first copy was)."""
    with contextlib.suppress(HaFailoverError):
        message.acknowledge()


class Connection:
    """A kombu connection: one hafailover connection and the inbox its consumers fill."""

    def __init__(self, client: Any, url: str, options: dict[str, Any]) -> None:
        self.client = client
        self.confirm_publish = bool(options.get("confirm_publish", True))
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        policy = parse_url(url)
        self.protocol = policy.protocol
        self.window = DeliveryWindow(policy.consumer_dedup)
        self.channels: dict[int, Channel] = {}
        self._channel_ids = itertools.count(1)
        self._failed: HaFailoverError | None = None
        self.ha = hafailover.connect(
            url,
            user=client.userid,
            password=_password(client.password),
            exception_listener=self._on_failure,
        )
        self.ha.start()
        self.closed = False

    def _on_failure(self, error: HaFailoverError) -> None:
        if not isinstance(error, DisconnectedError):
            # A failover notice (F10), or a failure a call reports to its caller as well.
            log.info("hafailover connection: %s", error)
            return
        # hafailover gave up: drain_events raises it, and Celery restarts its consumer.
        self._failed = error
        self.inbox.put(error)

    def channel(self) -> Channel:
        if self._failed is not None:
            raise self._failed
        channel = Channel(self, next(self._channel_ids))
        self.channels[channel.channel_id] = channel
        return channel

    def forget(self, channel: Channel) -> None:
        self.channels.pop(channel.channel_id, None)

    def arrived(
        self, channel: Channel, subscription: _Subscription, message: hafailover.Message
    ) -> None:
        """A consumer's listener (the session's thread): filter, deduplicate, queue."""
        if (
            subscription.broadcast
            and message.destination is not None
            and message.destination.is_topic
        ):
            envelope = _envelope_of(message)
            if not ROUTES.accepts(
                subscription.broadcast,
                envelope.get("exchange", ""),
                envelope.get("routing_key", ""),
            ):
                _settle(message)
                return
        decision = self.window.arrived(_key(subscription.queue, message), channel, message)
        if decision == "drop":
            _settle(message)
        elif decision == "deliver":
            self.inbox.put((channel, subscription, message))

    def drain_events(self, timeout: float | None = None) -> None:
        """Hand the next deliveries to their kombu callbacks; socket.timeout when none
        came within ``timeout`` (kombu's contract)."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no message within the timeout") from None  # socket.timeout
        self._dispatch(item)
        for _ in range(63):  # the rest of a burst, bounded so a caller's loop gets its turns
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._dispatch(item)

    def _dispatch(self, item: Any) -> None:
        if isinstance(item, _Closed):
            raise ConnectionClosedError("the kombu connection was closed")
        if isinstance(item, BaseException):
            raise item
        channel, subscription, message = item
        if subscription.cancelled or not channel.is_open:
            # Never handed over: the session gives it back when it closes; a later copy
            # is delivered.
            self.window.released(_key(subscription.queue, message))
            return
        if not channel.admits(subscription, message):
            return
        raw = channel.delivered(message, subscription.tag, subscription.queue)
        if subscription.no_ack:
            channel.basic_ack(raw.delivery_tag)
        if subscription.callback is not None:
            subscription.callback(raw)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for channel in list(self.channels.values()):
            with contextlib.suppress(HaFailoverError):
                channel.close()
        with contextlib.suppress(HaFailoverError):
            self.ha.close()
        self.inbox.put(_Closed())


def _password(value: object) -> str | None:
    if callable(value):
        value = value()
    return None if value is None else str(value)


class Transport(base.Transport):
    """kombu's Transport over a hafailover connection (STOMP or AMQP 1.0, by the URL)."""

    client: Any  # the kombu.Connection
    can_parse_url = True
    driver_type = "hafailover"
    driver_name = "hafailover"
    # Restart a consumer only where hafailover gave up (or the call failed for good);
    # failing over is hafailover's own business, never seen here. (kombu's base infers
    # one-element tuples for these.)
    connection_errors = (  # type: ignore[assignment]
        kombu.exceptions.ConnectionError,
        DisconnectedError,
        NotConnectedError,
        ConnectionClosedError,
        UnblockedError,
        CallTimeoutError,
        StaleAcknowledgeError,
        AcknowledgeFailedError,
    )
    channel_errors = (kombu.exceptions.ChannelError, ProtocolError)  # type: ignore[assignment]
    recoverable_connection_errors = (
        kombu.exceptions.ConnectionError,
        DisconnectedError,
        NotConnectedError,
        ConnectionClosedError,
        UnblockedError,
        CallTimeoutError,
    )
    recoverable_channel_errors = ()
    implements = base.Transport.implements.extend(
        asynchronous=False,
        exchange_type=frozenset({"direct", "fanout", "topic"}),
        heartbeats=False,
    )

    def establish_connection(self) -> Connection:
        client = self.client
        url = client.hostname
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError(
                f"the hafailover transport needs a hafailover URL as its broker URL "
                f"(failover:(stomp://h1:61613,...) or amqp://h:5672), not {url!r}"
            )
        url, options = _with_options(url, client.transport_options or {})
        return Connection(client, url, options)

    def close_connection(self, connection: Connection) -> None:
        connection.close()

    def create_channel(self, connection: Connection) -> Channel:
        return connection.channel()

    def close_channel(self, channel: Channel) -> None:
        channel.close()

    def drain_events(
        self, connection: Connection, timeout: float | None = None, **kwargs: Any
    ) -> None:
        connection.drain_events(timeout)

    def verify_connection(self, connection: Connection) -> bool:
        return not connection.closed and connection._failed is None

    def driver_version(self) -> str:
        return hafailover.__version__

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        if include_password:
            return f"hafailover+{uri}"
        try:
            return f"hafailover+{parse_url(uri)}"
        except ConfigurationError:
            return "hafailover+<invalid URL>"


def _with_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Split broker_transport_options into URL options (appended to the URL, which rejects
    an unknown or repeated one by name), this transport's own, and kombu's."""
    own = {k: v for k, v in options.items() if k in _OWN_OPTIONS}
    for name in ("confirm_publish",):
        if name in own and not isinstance(own[name], bool):
            raise ConfigurationError(
                f"transport option {name} must be True or False, not {own[name]!r}"
            )
    extra: Iterable[tuple[str, Any]] = (
        (k, v) for k, v in options.items() if k not in _OWN_OPTIONS and k not in _KOMBU_OPTIONS
    )
    query = "&".join(f"{k}={_option_text(v)}" for k, v in extra)
    if query:
        url = f"{url}{'&' if '?' in url.rsplit(')', 1)[-1] else '?'}{query}"
    parse_url(url)  # a bad option is named now, not at the first connection
    return url, own


def _option_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
