"""A pair's ports stay its own while a node does not run: the unstarted backup of
``BrokerPair(start_backup=False)``, and a node killed until it starts again. Before, those
ports were free, so another pair could be given them, and the first pair's live then
announced the other pair's node as its backup."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from reference_broker.pair import NodeProcess, free_ports

pytestmark = [pytest.mark.broker, pytest.mark.timeout(90)]


def ports_of(node: NodeProcess) -> list[int]:
    return [node.stomp_port, node.amqp_port, node.replication_port]


def taken(port: int) -> bool:
    """Whether another socket of this machine could not have ``port`` now."""
    probe = socket.socket()
    error = 0
    try:
        probe.bind(("127.0.0.1", port))
    except OSError as exc:
        error = exc.errno or -1
    finally:
        probe.close()
    assert error in (0, errno.EADDRINUSE), f"port {port}: {errno.errorcode.get(error)}"
    return error == errno.EADDRINUSE


def test_an_unstarted_backups_ports_are_given_to_nobody_else(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "a", start_backup=False) as first:
        backup = first.node("backup")
        assert not backup.running
        assert all(taken(port) for port in ports_of(backup))
        # What made two pairs overlap: the next pair's ports are picked from the free ones.
        assert not set(free_ports(200)) & set(ports_of(backup))
        with BrokerPair(tmp_path / "b", start_backup=False) as second:
            mine = {*ports_of(first.nodes[0]), *ports_of(backup)}
            assert not mine & {p for n in second.nodes for p in ports_of(n)}
    # A stopped pair holds nothing.
    assert not any(taken(port) for port in ports_of(backup))


def test_a_killed_nodes_ports_are_held_until_it_starts_again(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as pair:
        live = pair.node("live")
        assert pair.reserved_ports(live) == []  # running: it binds them itself
        pair.kill(live)
        assert pair.reserved_ports(live) == ports_of(live)
        assert not set(free_ports(200)) & set(ports_of(live))
        pair.restart(live)
        assert pair.wait_active(30) is live  # let go of before it started: it could listen
        assert pair.reserved_ports(live) == []


def test_given_ports_are_held_too_but_not_taken_from_their_holder(tmp_path: Path) -> None:
    ports = free_ports(6)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", ports[3]))
    squatter.listen()
    try:
        pair = BrokerPair(tmp_path / "pair", start_backup=False, ports=(*ports,))  # type: ignore[arg-type]
        try:
            backup = pair.node("backup")
            assert pair.reserved_ports(backup) == ports[4:]
            assert pair.reserved_ports(pair.node("live")) == ports[:3]
        finally:
            pair.stop()
        assert pair.reserved_ports(backup) == []
    finally:
        squatter.close()
