"""Where an AMQP 0-9-1 exchange and routing key send a message, on STOMP and AMQP 1.0 brokers.

Neither protocol has exchanges and bindings the way kombu means them, so the transport keeps
them in the process (``Routes``) and turns each publish into destinations hafailover knows:

- the default exchange (``""``) and ``direct`` exchanges send to queues: the queues bound
  here under that routing key (none: the message is dropped, as AMQP drops it), or, when
  this process knows no binding of the exchange at all, the queue named as the routing key.
  A consumer of a queue bound to a direct exchange under another key than its own name
  reads that key's queue as well, so a producer that never declared the binding reaches
  it: Celery's task queue (queue ``celery``, exchange ``celery``, key ``celery``) and its
  remote-control replies (queue ``<id>.reply.celery.pidbox``, key ``<id>``, sent by a worker
  that knows only the exchange) both arrive;
- ``fanout`` and ``topic`` exchanges broadcast: the message goes to the topic named as the
  exchange, carrying its routing key, and each queue bound to the exchange subscribes to
  that topic and keeps what its binding key matches. A broadcast queue therefore holds only
  what is published while it is consumed. Celery's remote control (``celery.pidbox``,
  fanout) and events (``celeryev``, topic) travel this way.

Pure: no I/O, no hafailover connection; the channel asks, this module answers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EXCHANGE_TYPES", "Binding", "Routes", "topic_matches"]

# The queue argument that makes a queue one the broker's STOMP and AMQP 1.0 plugins cannot
# declare (RabbitMQ: quorum, stream).
QUEUE_TYPE_ARGUMENT = "x-queue-type"

EXCHANGE_TYPES = frozenset({"direct", "fanout", "topic"})


@dataclass(frozen=True)
class Binding:
    exchange: str
    key: str


def _words_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_words_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words or (head != "*" and head != words[0]):
        return False
    return _words_match(rest, words[1:])


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """Whether a topic exchange's binding key takes a message sent with ``routing_key``
    (AMQP: words split by dots, ``*`` one word, ``#`` zero or more words)."""
    return _words_match(tuple(binding_key.split(".")), tuple(routing_key.split(".")))


class Routes:
    """Exchanges and bindings declared in this process (every connection shares them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exchanges: dict[str, tuple[str, bool]] = {}
        self._bindings: dict[str, set[Binding]] = {}  # queue -> its bindings
        self._typed: set[str] = set()  # queues declared with an x-queue-type

    def declare_exchange(self, name: str, kind: str, *, durable: bool) -> None:
        if kind not in EXCHANGE_TYPES:
            raise ValueError(
                f"exchange {name!r} has type {kind!r}; this transport routes "
                f"{', '.join(sorted(EXCHANGE_TYPES))} exchanges only"
            )
        if not name:
            raise ValueError("the default exchange ('') cannot be declared")
        with self._lock:
            self._exchanges[name] = (kind, durable)

    def delete_exchange(self, name: str) -> None:
        with self._lock:
            self._exchanges.pop(name, None)
            for bindings in self._bindings.values():
                bindings -= {b for b in bindings if b.exchange == name}

    def bind(self, queue: str, exchange: str, key: str) -> None:
        if not exchange:
            return  # every queue is bound to the default exchange by its name already
        with self._lock:
            self._bindings.setdefault(queue, set()).add(Binding(exchange, key))

    def unbind(self, queue: str, exchange: str, key: str) -> None:
        with self._lock:
            self._bindings.get(queue, set()).discard(Binding(exchange, key))

    def forget_queue(self, queue: str) -> None:
        with self._lock:
            self._bindings.pop(queue, None)
            self._typed.discard(queue)

    def declare_queue(self, queue: str, arguments: dict[str, object] | None) -> None:
        """Note a queue's declaration: one with an ``x-queue-type`` is used as it exists."""
        if arguments and arguments.get(QUEUE_TYPE_ARGUMENT) not in (None, "classic"):
            with self._lock:
                self._typed.add(queue)

    def address(self, queue: str) -> str:
        """The hafailover destination of a queue: ``/amq/queue/NAME`` (used as it is, never
        declared) for one declared with a queue type, else ``queue://NAME``."""
        with self._lock:
            typed = queue in self._typed
        return f"/amq/queue/{queue}" if typed else f"queue://{queue}"

    def broadcasts(self, exchange: str) -> bool:
        """Whether a publish to ``exchange`` goes to its topic rather than to queues. An
        exchange this process never saw declared is taken as a direct one."""
        if not exchange:
            return False
        with self._lock:
            kind = self._exchanges.get(exchange, ("direct", True))[0]
        return kind != "direct"

    def queues_for(self, exchange: str, key: str) -> list[str]:
        """The queues a publish to a queue-routed exchange reaches."""
        if not exchange:
            return [key]
        with self._lock:
            known = False
            bound = []
            for queue, bindings in sorted(self._bindings.items()):
                for binding in bindings:
                    if binding.exchange == exchange:
                        known = True
                        if binding.key == key:
                            bound.append(queue)
        # No binding of the exchange known here (a producer that never declared the
        # worker's queue): the queue named as the key, Celery's layout. Else, as AMQP
        # does, a key bound to no queue drops the message.
        return bound if known else [key]

    def subscriptions(self, queue: str) -> tuple[list[str], list[Binding]]:
        """What consuming ``queue`` subscribes to: the queues it reads (its own, and the
        keys of its direct bindings), and the broadcast bindings whose exchange topics it
        follows."""
        with self._lock:
            bindings = sorted(self._bindings.get(queue, ()), key=lambda b: (b.exchange, b.key))
        broadcast = [b for b in bindings if self.broadcasts(b.exchange)]
        direct = [b for b in bindings if not self.broadcasts(b.exchange)]
        queues = [queue] if direct or not bindings else []
        queues += sorted({b.key for b in direct if b.key and b.key != queue})
        return queues, broadcast

    def accepts(self, bindings: Iterable[Binding], exchange: str, key: str) -> bool:
        """Whether a broadcast copy from ``exchange`` sent with ``key`` is for a queue that
        has ``bindings``."""
        with self._lock:
            kind = self._exchanges.get(exchange, ("direct", True))[0]
        for binding in bindings:
            if binding.exchange != exchange:
                continue
            if kind == "fanout" or (kind == "direct" and binding.key == key):
                return True
            if kind == "topic" and topic_matches(binding.key, key):
                return True
        return False
