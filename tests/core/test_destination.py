"""Destinations: canonical and protocol-native forms, rendering, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.destination import Destination, DestinationKind, parse_destination
from hafailover.errors import ConfigurationError


@pytest.mark.parametrize(
    ("text", "kind", "name"),
    [
        ("queue://orders", DestinationKind.QUEUE, "orders"),
        ("topic://prices.eu", DestinationKind.TOPIC, "prices.eu"),
        ("/queue/orders", DestinationKind.QUEUE, "orders"),
        ("/topic/prices", DestinationKind.TOPIC, "prices"),
        ("/temp-queue/replies", DestinationKind.TEMPORARY_QUEUE, "replies"),
        ("temp-queue://live-1-replies", DestinationKind.TEMPORARY_QUEUE, "live-1-replies"),
        ("orders", DestinationKind.QUEUE, "orders"),
    ],
)
def test_forms(text: str, kind: DestinationKind, name: str) -> None:
    destination = parse_destination(text)
    assert destination == Destination(kind, name)
    assert not destination.existing


def test_an_existing_queue_is_rabbitmqs_amq_queue_form() -> None:
    destination = parse_destination("/amq/queue/orders")
    assert destination == Destination(DestinationKind.QUEUE, "orders", existing=True)
    assert destination != Destination.queue("orders")  # one is declared on use, one is not
    # RabbitMQ takes the same address over STOMP and over its AMQP 1.0 plugin; brokers that
    # declare nothing on use get the plain queue
    assert destination.stomp == "/amq/queue/orders"
    assert destination.amqp == "queue://orders"
    assert str(destination) == "/amq/queue/orders"
    assert parse_destination(str(destination)) == destination


def test_only_a_queue_can_be_an_existing_queue() -> None:
    with pytest.raises(ConfigurationError, match="only a queue can be an existing queue"):
        Destination(DestinationKind.TOPIC, "prices", existing=True)


def test_renderings() -> None:
    assert Destination.queue("orders").stomp == "/queue/orders"
    assert Destination.topic("prices").stomp == "/topic/prices"
    assert Destination.queue("orders").amqp == "queue://orders"
    assert str(Destination.topic("prices")) == "topic://prices"
    temp = Destination(DestinationKind.TEMPORARY_QUEUE, "live-1-r")
    assert temp.stomp == "temp-queue://live-1-r"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("queue://", "names no queue"),
        ("/queue/", "names no queue"),
        ("/amq/queue/", "names no queue"),
        ("http://x", "unknown destination form"),
        ("/exchange/x", "unknown destination form"),
        ("", "1 to 255 characters"),
        ("a\nb", "line breaks"),
        (" padded", "surrounding spaces"),
        ("x" * 300, "1 to 255"),
    ],
)
def test_bad_destinations_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        parse_destination(text)


def test_non_strings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="not int"):
        parse_destination(42)  # type: ignore[arg-type]


@given(
    st.sampled_from(list(DestinationKind)),
    st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True),
    st.booleans(),
)
def test_canonical_form_round_trips(kind: DestinationKind, name: str, existing: bool) -> None:
    destination = Destination(kind, name, existing=existing and kind is DestinationKind.QUEUE)
    assert parse_destination(str(destination)) == destination
    assert parse_destination(destination) is destination
