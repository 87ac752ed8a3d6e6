"""The transport's routing table and delivery window, without a broker."""

from __future__ import annotations

import pytest

from hafailover import Message
from hafailover.kombu._routing import Binding, Routes, topic_matches
from hafailover.kombu.transport import DeliveryWindow


@pytest.mark.parametrize(
    ("binding", "key", "matches"),
    [
        ("worker.#", "worker.heartbeat", True),
        ("worker.#", "worker", True),
        ("worker.#", "workers.x", False),
        ("#", "", True),
        ("#.done", "task.x.done", True),
        ("#.done", "done", True),
        ("task.*.done", "task.x.done", True),
        ("task.*.done", "task.x.y.done", False),
        ("task.*", "task", False),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("a.#.z", "a.b.c", False),
        ("exact", "exact", True),
        ("exact", "exactly", False),
    ],
)
def test_topic_binding_keys(binding: str, key: str, matches: bool) -> None:
    assert topic_matches(binding, key) is matches


def test_direct_exchange_routes_to_bound_queues_or_the_key() -> None:
    routes = Routes()
    routes.declare_exchange("tasks", "direct", durable=True)
    # Nothing bound here: the queue named as the key (a producer that never declared it).
    assert routes.queues_for("tasks", "celery") == ["celery"]
    routes.bind("hipri", "tasks", "hi")
    routes.bind("also-hi", "tasks", "hi")
    assert routes.queues_for("tasks", "hi") == ["also-hi", "hipri"]
    # Bindings of the exchange are known, none under this key: dropped, as AMQP drops it.
    assert routes.queues_for("tasks", "lo") == []
    assert routes.queues_for("", "anything") == ["anything"]
    # A consumer of hipri reads its own queue and the key's.
    assert routes.subscriptions("hipri") == (["hipri", "hi"], [])


def test_broadcast_exchanges_go_through_their_topic() -> None:
    routes = Routes()
    routes.declare_exchange("celery.pidbox", "fanout", durable=False)
    routes.declare_exchange("celeryev", "topic", durable=True)
    routes.bind("w1.celery.pidbox", "celery.pidbox", "")
    routes.bind("monitor", "celeryev", "worker.#")
    assert routes.broadcasts("celery.pidbox")
    assert routes.broadcasts("celeryev")
    assert not routes.broadcasts("unknown")  # never declared here: taken as direct
    queues, broadcast = routes.subscriptions("monitor")
    assert queues == []
    assert broadcast == [Binding("celeryev", "worker.#")]
    assert routes.accepts(broadcast, "celeryev", "worker.heartbeat")
    assert not routes.accepts(broadcast, "celeryev", "task.sent")
    assert routes.accepts([Binding("celery.pidbox", "")], "celery.pidbox", "any key")


def test_unsupported_exchange_type_is_named() -> None:
    with pytest.raises(ValueError, match="'headers'"):
        Routes().declare_exchange("h", "headers", durable=True)


def test_delivery_window_parks_and_drops_copies() -> None:
    window = DeliveryWindow(2)
    first, copy, late = Message(body=b"1"), Message(body=b"1"), Message(body=b"1")
    key = ("q", "id-1")
    channel = object()
    assert window.arrived(key, channel, first) == "deliver"  # type: ignore[arg-type]
    # A failover brought it again while it runs: the copy waits for it.
    assert window.arrived(key, channel, copy) == "park"  # type: ignore[arg-type]
    assert window.finished(key) == [(channel, copy)]
    # Done: a later copy is dropped (acknowledged, never run).
    assert window.arrived(key, channel, late) == "drop"  # type: ignore[arg-type]
    # The window is bounded: the oldest ids leave it.
    for n in range(2):
        window.arrived(("q", f"other-{n}"), channel, first)  # type: ignore[arg-type]
        window.finished(("q", f"other-{n}"))
    assert window.arrived(key, channel, late) == "deliver"  # type: ignore[arg-type]
    # Given back unprocessed: the next copy is delivered.
    assert window.released(key) == []
    assert window.arrived(key, channel, late) == "deliver"  # type: ignore[arg-type]


def test_window_off_delivers_everything() -> None:
    window = DeliveryWindow(0)
    message = Message(body=b"x")
    for _ in range(3):
        assert window.arrived(("q", "same"), object(), message) == "deliver"  # type: ignore[arg-type]
        assert window.finished(("q", "same")) == []


def test_a_queue_declared_with_a_type_is_addressed_as_existing() -> None:
    routes = Routes()
    routes.declare_queue("plain", None)
    routes.declare_queue("classic", {"x-queue-type": "classic", "x-max-priority": 5})
    routes.declare_queue("tasks", {"x-queue-type": "quorum"})
    assert routes.address("plain") == "queue://plain"
    assert routes.address("classic") == "queue://classic"
    assert routes.address("tasks") == "/amq/queue/tasks"  # RabbitMQ would declare /queue/ classic
    routes.forget_queue("tasks")
    assert routes.address("tasks") == "queue://tasks"
