"""The standard AMQP failover list: a broker that announces its backups only under the
``failover-server-list`` open property (as ActiveMQ Artemis does; Qpid JMS reads it) is
enough for a client whose URL names the live alone to fail over to the backup (F12)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from proton import symbol
from proton.utils import BlockingConnection

import hafailover
from reference_broker import BrokerPair

from .support import drain, seqs, single_url

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def standard_only(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(
        tmp_path / "pair", user="app", password="secret", topology_extension=False
    ) as started:
        started.wait_synchronized(30)
        yield started


def test_the_broker_announces_only_the_standard_list(standard_only: BrokerPair) -> None:
    live, backup = standard_only.live, standard_only.backup
    url = f"amqp://app:secret@127.0.0.1:{live.amqp_port}"
    connection = BlockingConnection(url, allowed_mechs="PLAIN", allow_insecure_mechs=True)
    try:
        properties = connection.conn.remote_properties
        assert symbol("hafailover-topology") not in properties
        (entry,) = properties[symbol("failover-server-list")]
        assert entry[symbol("network-host")] == "127.0.0.1"
        assert entry[symbol("port")] == backup.amqp_port
        assert entry[symbol("scheme")] == "amqp"
    finally:
        connection.close()


def test_a_client_learns_the_backup_from_the_standard_list_and_fails_over(
    standard_only: BrokerPair,
) -> None:
    live, backup = standard_only.live, standard_only.backup
    url = single_url("amqp", "127.0.0.1", live.amqp_port, standard_only, reconnect_attempts=-1)
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://standard-list")
        for n in range(50):
            producer.send("before", headers={"seq": n})
        standard_only.kill(live)
        for n in range(50, 100):
            producer.send("after", headers={"seq": n})  # waits for the failover (F1)
        report = connection.reports[-1]
        assert report.to_broker is not None and str(backup.amqp_port) in report.to_broker
    backup_url = single_url("amqp", "127.0.0.1", backup.amqp_port, standard_only)
    assert sorted(seqs(drain(backup_url, "queue://standard-list"))) == list(range(100))
