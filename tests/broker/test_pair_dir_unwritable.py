"""A pair directory that cannot be written (here: a small tmpfs kept full) on the live.

The lease keeper must not die: it logs the failure once, retries, and renews again once the
directory takes writes, within the lease; the replication server that cannot record that a
lost backup is no longer eligible must confirm nothing without it and tell the node, which
fences itself (stops serving) with a log line that says why. Needs root (mount), as CI runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reference_broker._files import replace_atomically
from reference_broker.node import LeaseKeeper, Node, NodeConfig
from reference_broker.witness import Outcome
from tests.faults.disk import DiskHog, small_disk

from .test_replication import Live, synchronized_backup, until

pytestmark = pytest.mark.timeout(60)

DISK = 1024 * 1024


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", DISK) as mounted:
        yield mounted


@pytest.fixture
def hog(disk: Path) -> Iterator[DiskHog]:
    filler = DiskHog(disk)
    try:
        yield filler
    finally:
        filler.release()


def test_the_lease_keeper_retries_a_full_pair_directory_and_renews_once_it_has_room(
    tmp_path: Path, disk: Path, hog: DiskHog, caplog: pytest.LogCaptureFixture
) -> None:
    # A long lease: the disk is full for a moment only, well within it on a loaded machine.
    node = Node(
        NodeConfig(
            node_id="live",
            role="live",
            data_dir=tmp_path / "data",
            pair_dir=disk / "pair",
            lease=6.0,
        )
    )
    decision = node.witness.try_activate("live", ["127.0.0.1:61613"])
    assert decision.outcome is Outcome.ACTIVATED and decision.lease is not None
    node.lease = decision.lease
    thread_errors: list[BaseException | None] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: thread_errors.append(args.exc_value)

    async def main() -> LeaseKeeper:
        keeper = LeaseKeeper(node)
        keeper.start()
        try:
            hog.start()
            lease = node.lease
            assert lease is not None
            # Past the next renewal and a few retries, well before the lease runs out.
            while time.monotonic() < lease.renew_at + 0.3:
                await asyncio.sleep(0.02)
            hog.release()
            renewals = keeper.renewals
            await until(lambda: keeper.renewals > renewals, 10)
            assert node.lease is not None and node.lease.may_serve(time.monotonic())
            assert keeper.renew_failures >= 2  # retried while the disk was full
            assert keeper.renew_error is None
        finally:
            keeper.stop(keep_lease=True)
        return keeper

    try:
        with caplog.at_level(logging.WARNING, logger="reference_broker.node"):
            keeper = asyncio.run(main())
    finally:
        threading.excepthook = previous_hook
    assert thread_errors == [], f"the lease keeper died: {thread_errors}"
    messages = [r.getMessage() for r in caplog.records]
    failed = [m for m in messages if "cannot renew its lease" in m]
    assert len(failed) == 1, messages  # once per streak, not once per attempt
    assert str(disk / "pair") in failed[0]
    assert any(f"renewed again after {keeper.renew_failures}" in m for m in messages)


def test_a_revocation_the_pair_directory_refuses_confirms_nothing_alone(
    tmp_path: Path, disk: Path, hog: DiskHog, caplog: pytest.LogCaptureFixture
) -> None:
    """The link to an eligible backup ends while the pair directory is full: the live cannot
    revoke the eligibility, so what waited for the backup stays unconfirmed, the server says
    why in ``failed`` (the node fences on it), and nothing escapes as an unhandled error."""
    eligibility = disk / "eligible-1.json"

    def record(backup: str, eligible: bool) -> None:
        replace_atomically(
            eligibility,
            json.dumps({"backup": backup, "eligible": eligible}).encode(),
            durable=True,
        )

    async def main() -> None:
        unhandled: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        live = Live(tmp_path / "live", record_eligibility=record)
        await live.start()
        _, writer = await synchronized_backup(live)
        waiting = live.store.persist([(0x40, b"needs the backup")])
        hog.start()
        writer.close()
        await asyncio.sleep(0.5)  # the live sees the link end at once
        assert unhandled == [], unhandled
        assert not waiting.done(), "confirmed without the backup it could not revoke"
        assert not live.store.degraded
        assert json.loads(eligibility.read_text())["eligible"] is True
        assert "no longer eligible" in str(live.server.failed)
        waiting.cancel()
        await live.close()

    with caplog.at_level(logging.ERROR, logger="reference_broker.replication"):
        asyncio.run(main())
    assert any("cannot record in the pair directory" in r.getMessage() for r in caplog.records)
