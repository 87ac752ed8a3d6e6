"""Broker redirects and the announced failover list, decided in the core: the rotation's
``redirect`` and ``learn_topology`` by failover_server_list, and the redirect's address."""

from __future__ import annotations

import random

import pytest

from hafailover.core.schedule import ReconnectSchedule
from hafailover.errors import InvalidURLError
from hafailover.protocols.base import parse_redirect
from hafailover.url import ServerListAction, parse_url

B, C = ("b", 61613), ("c", 61613)


def test_the_announced_list_adds_replaces_or_is_ignored() -> None:
    url = "failover:(stomp://a,stomp://b)?failover_server_list="
    add = ReconnectSchedule(parse_url(url + "add")).rotation
    assert add.learn_topology([C])
    assert [b.host for b in add.brokers] == ["a", "b", "c"]

    replace = ReconnectSchedule(parse_url(url + "replace")).rotation
    replace.connected_to(replace.brokers[1])  # on b when c is announced
    assert replace.learn_topology([C, B])
    assert [b.host for b in replace.brokers] == ["b", "c"]
    assert not replace.learn_topology([C, B])

    ignore = ReconnectSchedule(parse_url(url + "ignore")).rotation
    assert not ignore.learn_topology([C])
    assert [b.host for b in ignore.brokers] == ["a", "b"]
    assert parse_url("stomp://a").failover_server_list is ServerListAction.ADD


def test_use_topology_false_ignores_and_contradicts_an_explicit_action() -> None:
    assert parse_url("stomp://a?use_topology=false").server_list_action is ServerListAction.IGNORE
    with pytest.raises(InvalidURLError, match="contradicts") as caught:
        parse_url("stomp://a?use_topology=false&failover_server_list=replace")
    assert caught.value.option == "failover_server_list"
    with pytest.raises(InvalidURLError, match="failover_server_list"):
        parse_url("stomp://a?failover_server_list=merge")


def test_a_redirect_is_the_next_attempt_once_with_the_current_credentials() -> None:
    schedule = ReconnectSchedule(
        parse_url("failover:(amqps://u:p@a,amqps://u:p@b)"), rng=random.Random(0)
    )
    target = schedule.rotation.redirect("elsewhere", None)
    assert (target.scheme, target.user, target.password, target.port) == ("amqps", "u", "p", 5671)
    assert [a.broker.host for a in schedule.plan(initial=False, limit=3)] == [
        "elsewhere",
        "a",
        "b",
    ]
    assert [a.broker.host for a in schedule.plan(initial=False, limit=2)] == ["a", "b"]


def test_the_redirect_info_names_network_host_first() -> None:
    assert parse_redirect({"hostname": "vhost", "network-host": "10.0.0.9", "port": 5673}) == (
        "10.0.0.9",
        5673,
    )
    assert parse_redirect({"hostname": "h"}) == ("h", None)
    assert parse_redirect({"port": 1}) is None
    assert parse_redirect({"hostname": "h", "port": 70000}) is None
    assert parse_redirect("h:1") is None


def test_a_redirect_that_names_a_port_goes_to_that_port() -> None:
    schedule = ReconnectSchedule(parse_url("failover:(amqp://a,amqp://b)"), rng=random.Random(0))
    assert schedule.rotation.redirect("elsewhere", 5999).endpoint == ("elsewhere", 5999)
    assert schedule.plan(initial=False, limit=1)[0].broker.endpoint == ("elsewhere", 5999)
