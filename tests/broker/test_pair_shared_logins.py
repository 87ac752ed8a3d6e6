"""After a failover, the first login on the node that took over costs no password derivation
when the live had verified it (issue 18 item 4): the live shares verified logins with its
backup over the replication link.

Real node processes started by ``BrokerPair``, a real SIGKILL, raw stomp.py clients; the
derivations are counted by each node in its status (``login_derivations``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import stomp

from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker.test_pair_stomp import send_persistent

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


def derivations_after(node: NodeProcess, moment: float, timeout: float = 20.0) -> int:
    """The node's derivation count in a status written after ``moment`` (wall clock)."""
    deadline = time.monotonic() + timeout
    while True:
        status = node.status()
        if status.get("time", 0.0) > moment:
            return int(status["login_derivations"])
        assert time.monotonic() < deadline, f"{node} wrote no status within {timeout}s"
        time.sleep(0.05)


def login(node: NodeProcess, password: str) -> bool:
    connection = stomp.Connection12([("127.0.0.1", node.stomp_port)], heartbeats=(0, 0))
    try:
        connection.connect("admin", password, wait=True)
    except stomp.exception.ConnectFailedException:
        return False
    connection.disconnect()
    return True


def test_the_first_login_on_the_node_that_took_over_runs_no_derivation(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=1.0) as pair:
        pair.wait_synchronized()
        live, backup = pair.live, pair.backup
        # The login, then a send the backup must store before it is confirmed: the LOGINS
        # frame went before it on the link, so the backup has the login by then.
        assert send_persistent(live, "/queue/q", 1) == {"m-0"}
        assert derivations_after(live, time.time()) == 1

        pair.kill(live)
        assert pair.wait_active(timeout=30) is backup
        assert login(backup, "admin")
        assert derivations_after(backup, time.time()) == 0

        # The counter counts on this node: a login it never saw costs a derivation.
        assert not login(backup, "not-the-password")
        assert derivations_after(backup, time.time()) == 1
