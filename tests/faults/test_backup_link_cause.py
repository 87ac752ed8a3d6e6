"""A backup whose own disk ends the link says why (issue 18, scenario f, seen from the log).

The backup's follower task fails when its journal cannot store a batch (JournalFullError on a
full disk). reference_broker/node.py used to swallow that exception: the log said only "lost
live ...", as if the live had gone. The backup must log the cause with the link's end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from tests.integration.support import url_for, wait_until

from .clients import ConfirmedProducer, stop_all
from .disk import DiskHog, small_disk

pytestmark = pytest.mark.timeout(120)


def test_a_backup_whose_disk_is_full_logs_the_cause(tmp_path: Path) -> None:
    pair = BrokerPair(tmp_path / "pair", user="app", password="secret", segment_size=256 * 1024)
    live, backup = pair.nodes
    with small_disk(backup.data_dir, 4 * 1024 * 1024), pair:
        pair.wait_synchronized(30)
        producer = ConfirmedProducer(
            url_for(pair, "stomp", reconnect_attempts=-1, heartbeat="1s"),
            "queue://backup-link-cause",
            body=b"x" * 2048,
        )
        hog = DiskHog(backup.data_dir)
        producer.start()
        try:
            wait_until(lambda: len(producer.confirmed) >= 50, 30, "the first traffic")
            hog.start()
            wait_until(lambda: live.status().get("degraded"), 30, "the live to drop its backup")

            def cause_logged() -> bool:
                text = backup.log_path.read_text(errors="replace")
                return "the link to live" in text and "JournalFullError" in text

            deadline = time.monotonic() + 20
            while not cause_logged():
                assert time.monotonic() < deadline, (
                    "the backup's log does not say why the link ended:\n"
                    + backup.log_path.read_text(errors="replace")[-3000:]
                )
                time.sleep(0.1)
        finally:
            hog.release()
            stop_all(producer)
