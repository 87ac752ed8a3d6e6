"""Issue 18, scenario f: a full disk under the live's or the backup's journal.

Each node's data directory can be a small tmpfs, filled during traffic by a DiskHog that
keeps it full until released. What must hold:

- the live's disk full: persistent sends are refused with an error that names the cause
  (STOMP ERROR, AMQP rejected), which the client raises as an exception; consumers still
  receive and acknowledge (an acknowledge writes a record: the journal keeps a reserve for
  them); nothing confirmed is lost; sends are confirmed again once space returns;
- the backup's disk full: the backup acknowledges nothing it could not store, so the live
  declares it lost (degraded, not eligible) rather than count it as a copy: killing the live
  then must not let the backup take over with less than was confirmed;
- compaction that finds no room is postponed and retried with a growing pause, never
  given up: it runs once space returns.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hafailover import BrokerResourceError, ErrorCode
from reference_broker import BrokerPair
from reference_broker import node as node_module
from reference_broker.engine import DiskFullError, Engine
from reference_broker.journal import Journal, JournalFullError, SyncPolicy
from reference_broker.node import Checkpointer, Node, NodeConfig
from reference_broker.store import Store
from reference_broker.witness import Outcome
from tests.integration.support import AckingConsumer, url_for, wait_until

from .clients import ConfirmedProducer, base_url, check, stop_all
from .disk import DiskHog, small_disk

pytestmark = pytest.mark.timeout(120)

SEGMENT = 256 * 1024
DISK = 4 * 1024 * 1024
BODY = b"x" * 2048


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def small_pair(tmp_path: Path, node: int) -> Iterator[BrokerPair]:
    pair = BrokerPair(tmp_path / "pair", user="app", password="secret", segment_size=SEGMENT)
    with small_disk(pair.nodes[node].data_dir, DISK), pair:
        pair.wait_synchronized(30)
        yield pair


@pytest.fixture
def live_disk_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    yield from small_pair(tmp_path, 0)


@pytest.fixture
def backup_disk_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    yield from small_pair(tmp_path, 1)


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_full_disk_on_the_live_refuses_sends_and_still_acknowledges(
    live_disk_pair: BrokerPair, protocol: str
) -> None:
    pair = live_disk_pair
    queue = "queue://disk-full-live"
    # A kill is seen by a reset: a 250 ms heart-beat only adds false failovers under load.
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
    producer = ConfirmedProducer(url, queue, body=BODY)
    consumer = AckingConsumer(url, queue)
    hog = DiskHog(pair.live.data_dir)
    producer.start()
    try:
        # A backlog for the consumer to work through while the disk is full.
        wait_until(lambda: len(producer.confirmed) >= 200, 30, "a backlog")
        hog.start()
        full_at = time.monotonic()
        wait_until(lambda: producer.raised, 20, "a send refused for the full disk")
        refused_at = producer.raised[0].at
        confirmed_when_refused = len(producer.confirmed)
        consumer.start()
        wait_until(lambda: len(consumer.acknowledged) >= 100, 20, "acknowledges on a full disk")
        # Still full: nothing more was confirmed, every refusal says why.
        assert len(producer.confirmed) == confirmed_when_refused
        reasons = {f"{type(e.error).__name__}: {e.error}" for e in producer.raised}
        assert all("disk is full" in reason for reason in reasons), reasons
        # Its own type on both protocols, not a generic error or a lost connection.
        assert all(
            isinstance(e.error, BrokerResourceError) and e.error.code is ErrorCode.RESOURCE_LIMIT
            for e in producer.raised
        ), reasons
        if protocol == "amqp":  # the AMQP condition for a limit, as Artemis's "address full"
            assert all("amqp:resource-limit-exceeded" in reason for reason in reasons), reasons
        assert pair.live is pair.nodes[0], "the live gave up its role over a full disk"
        hog.release()
        freed_at = time.monotonic()
        wait_until(lambda: len(producer.confirmed) > confirmed_when_refused + 50, 20, "sends again")
        resumed = producer.confirmed_at[confirmed_when_refused] - freed_at
    finally:
        hog.release()
        stop_all(producer, consumer)
    outcome = check(base_url(pair, protocol), queue, [producer], [consumer])
    print(
        "\n"
        + outcome.line("live's disk full", protocol)
        + f" (producer {producer.failovers}, consumer {consumer.failovers})"
        f" refusals={len(producer.raised)} first refusal {refused_at - full_at:.2f}s"
        f" after the disk filled, sends confirmed {resumed:.2f}s after space returned;"
        f" the refusal: {next(iter(reasons))}"
    )
    outcome.assert_clean()


def test_a_full_disk_on_the_backup_is_never_counted_as_a_copy(
    backup_disk_pair: BrokerPair, protocol: str
) -> None:
    pair = backup_disk_pair
    live, backup = pair.nodes
    queue = "queue://disk-full-backup"
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
    producer = ConfirmedProducer(url, queue, body=BODY)
    hog = DiskHog(backup.data_dir)
    producer.start()
    try:
        wait_until(lambda: len(producer.confirmed) >= 50, 30, "the first traffic")
        hog.start()
        # The backup fails to store a batch, acknowledges nothing more, and the live declares
        # it lost before it confirms anything without it.
        wait_until(lambda: live.status().get("degraded"), 30, "the live to drop its backup")
        confirmed_alone = len(producer.confirmed)
        wait_until(lambda: len(producer.confirmed) > confirmed_alone + 50, 20, "degraded sends")
        assert not backup.status().get("synchronized")
        # What only the live holds must not be lost to a takeover by the backup.
        pair.kill(live)
        time.sleep(3 * pair.lease)
        # Asked twice: by its status, and by whether it listens for clients (a live does).
        assert backup.role == "backup", "a backup that could not store took over"
        assert not listening(pair.host, backup.stomp_port), "the backup serves clients"
        hog.release()
        pair.restart(live)
        assert pair.wait_active(20) is live
        pair.wait_synchronized(30)
        confirmed = len(producer.confirmed)
        wait_until(lambda: len(producer.confirmed) > confirmed + 50, 20, "sends after resync")
    finally:
        hog.release()
        stop_all(producer)
    outcome = check(base_url(pair, protocol), queue, [producer])
    print("\n" + outcome.line("backup's disk full, then the live killed", protocol))
    outcome.assert_clean()


def test_a_checkpoint_with_no_room_is_retried_until_space_returns(tmp_path: Path) -> None:
    """Compaction on a full disk is postponed and tried again with a growing pause, never
    stopped for good; once space returns a checkpoint is taken and old segments deleted."""
    directory = tmp_path / "disk"
    with small_disk(directory, 2 * 1024 * 1024):
        asyncio.run(_checkpoint_retried(directory))


async def _checkpoint_retried(directory: Path) -> None:
    journal = Journal.open(directory / "journal", sync=SyncPolicy.never(), segment_size=64 * 1024)
    store = Store(journal)
    engine = Engine()
    store.on_space = engine.refuse_persistent_sends
    checkpointer = Checkpointer(engine, store, segments=1, ratio=0.0, max_backoff=0.5)
    # Enough segments for a checkpoint to be due.
    for n in range(200):
        engine.send("queue://kept", b"k" * 1024, persistent=True, duplicate_id=f"id-{n}")
        await store.persist([r.encode() for r in engine.drain_records()])
    hog = DiskHog(directory)
    hog.start()
    task = asyncio.get_running_loop().create_task(checkpointer.run())
    try:
        deadline = time.monotonic() + 10
        while checkpointer.failures < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert checkpointer.failures >= 3, "compaction was not retried"
        assert checkpointer.count == 0
        assert "no room" in str(checkpointer.last_failure)
        # Sends fill the active segment down to its reserve; then they are refused, and the
        # store itself does not fail.
        refusal: DiskFullError | None = None
        for _ in range(100):
            try:
                engine.send("queue://kept", b"r" * 1024, persistent=True)
            except DiskFullError as exc:
                refusal = exc
                break
            await store.persist([r.encode() for r in engine.drain_records()])
        assert refusal is not None and "disk is full" in str(refusal), "no send was refused"
        assert not store.failed
        segments_before = len(journal.segments)
        hog.release()
        deadline = time.monotonic() + 10
        # count rises once the checkpoint is written, failures is cleared once its
        # compaction is done too: wait for both.
        while (checkpointer.count == 0 or checkpointer.failures) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert checkpointer.count == 1, f"no checkpoint after space returned: {checkpointer}"
        assert checkpointer.failures == 0, "the failures were not cleared by the checkpoint"
        assert len(journal.segments) < segments_before
        assert engine.refusing_persistent_sends is None
        engine.send("queue://kept", b"accepted again", persistent=True)
    finally:
        hog.release()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()


def test_a_journal_with_no_room_for_a_segment_stays_open_and_whole(tmp_path: Path) -> None:
    """A full disk: the append that needs a new segment raises JournalFullError having
    written nothing; appends that fit the active segment (its blocks were reserved when it
    was made) still work; once space returns the refused append succeeds, and a reopened
    journal holds every record appended, in order. Closing gives the unused reserve back."""
    directory = tmp_path / "disk"
    segment = 64 * 1024
    with small_disk(directory, 1024 * 1024):
        journal = Journal.open(
            directory / "journal", sync=SyncPolicy.always(), segment_size=segment
        )
        hog = DiskHog(directory).start()
        try:
            appended = []
            while journal.room >= 1000 + 19:
                appended.append(journal.append(1, b"a" * 1000))  # within the reserve
            last = journal.last_seq
            with pytest.raises(JournalFullError, match="no space left for a new journal segment"):
                journal.append(1, b"b" * 1000)
            assert journal.last_seq == last and not journal.closed
            appended.append(journal.append(1, b"c" * (journal.room - 19)))  # fills it exactly
            hog.release()
            appended.append(journal.append(1, b"b" * 1000))  # a new segment now
            assert len(journal.segments) == 2
        finally:
            hog.release()
            journal.close()
        active = journal.segments[-1].path
        assert active.stat().st_blocks * 512 < segment / 2, "the reserve was not given back"
        with Journal.open(directory / "journal", sync=SyncPolicy.always()) as reopened:
            assert [r.seq for r in reopened.replay()] == appended


def test_a_full_pair_directory_fences_the_live_that_cannot_revoke_its_lost_backup(
    tmp_path: Path,
) -> None:
    """The pair directory's disk fills, then the backup dies: the live cannot record that
    the backup is no longer eligible, so it must not go on alone. It stops serving at once
    (before its failing lease renewals would run the lease out) and says why in its log;
    nothing escapes as an unhandled error."""
    pair = BrokerPair(tmp_path / "pair", user="app", password="secret")
    with small_disk(pair.pair_dir, DISK), pair:
        pair.wait_synchronized(30)
        live, backup = pair.nodes
        hog = DiskHog(pair.pair_dir)
        try:
            hog.start()
            pair.kill(backup)
            wait_until(lambda: live.status().get("role") == "backup", 10, "the live to fence")
        finally:
            hog.release()
        log = live.log_path.read_text()
    fenced = [line for line in log.splitlines() if "fencing itself" in line]
    assert fenced and "is no longer eligible" in fenced[0], fenced
    assert "Traceback" not in log and "Unhandled exception" not in log


def test_a_node_records_its_activation_on_a_full_disk(tmp_path: Path) -> None:
    """The activation a node serves under is recorded in its data directory right after the
    witness gave it the role. On a full disk the record is written over in place: an
    exception there once ended the process holding a fresh claim, and no node served."""
    disk = tmp_path / "disk"
    with small_disk(disk, 1024 * 1024):
        node = Node(
            NodeConfig(node_id="live", role="live", data_dir=disk / "data", pair_dir=tmp_path)
        )
        node._record_activation(1)
        hog = DiskHog(disk).start()
        try:
            node._record_activation(2)
            # The file itself, not the process's own memory of it: a restart reads the file.
            assert json.loads(node._identity_path.read_text())["activation"] == 2
        finally:
            hog.release()


def test_a_backup_whose_disk_is_full_does_not_ask_for_the_role_back(tmp_path: Path) -> None:
    """Failback moves the role to the preferred live once it has synchronized as backup;
    not while its disk is full (its active segment past the acknowledgements' reserve and
    no room for another): it would refuse every send and fail its journal at the first
    writes past the reserve. Seen when the preferred live synchronized on a disk a hog kept
    full, took the role, and fenced itself again within milliseconds."""
    disk = tmp_path / "disk"
    with small_disk(disk, 1024 * 1024):
        node = Node(
            NodeConfig(
                node_id="live",
                role="live",
                data_dir=disk / "data",
                pair_dir=tmp_path,
                segment_size=64 * 1024,
            )
        )
        asyncio.run(_room_for_failback(node, disk))


async def _room_for_failback(node: Node, disk: Path) -> None:
    store = Store(node._open_journal())
    link: Any = types.SimpleNamespace(store=store)  # what the check reads of a BackupLink
    try:
        assert await node._room_to_serve(link)
        hog = DiskHog(disk).start()
        try:
            assert await node._room_to_serve(link), "a fresh segment is room enough"
            while store.journal.room >= store.space_reserve:
                await store.persist([(1, b"r" * 1000)])
            assert not await node._room_to_serve(link)
        finally:
            hog.release()
        assert await node._room_to_serve(link)
    finally:
        await store.close()


def test_a_hand_over_claim_is_served_once(tmp_path: Path) -> None:
    """A claim the acting live handed to this node is this node's to serve, but not again
    once it served it: it stopped serving under it (fenced: a full disk), and serving it
    again would loop, renewing the lease the other node waits for."""
    node = Node(
        NodeConfig(node_id="live", role="live", data_dir=tmp_path / "data", pair_dir=tmp_path)
    )
    addresses = ["127.0.0.1:61613"]
    assert node.witness.try_activate("backup", addresses).outcome is Outcome.ACTIVATED
    handed = node.witness.hand_over("backup", 1, "live", addresses)
    assert handed.state is not None and handed.state.activation == 2
    assert node._handed_to_us(1) == 2
    node._record_activation(2)  # it served activation 2, then fenced itself
    assert node._handed_to_us(1) is None


def test_a_hand_over_claim_is_served_once_even_when_node_json_could_not_keep_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk too full even for node.json's in-place write: the process remembers the
    activation it served, so the claim is still not served twice."""
    node = Node(
        NodeConfig(node_id="live", role="live", data_dir=tmp_path / "data", pair_dir=tmp_path)
    )
    addresses = ["127.0.0.1:61613"]
    assert node.witness.try_activate("backup", addresses).outcome is Outcome.ACTIVATED
    node.witness.hand_over("backup", 1, "live", addresses)

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(node_module, "_write_json", full)
    monkeypatch.setattr(node_module, "_overwrite", full)
    node._record_activation(2)
    assert not node._identity_path.exists()
    assert node._handed_to_us(1) is None


ACK_SEGMENT = 32 * 1024  # a reserve of 8 KiB: a couple of hundred acknowledges
BACKLOG = 600


def wait_for_a_fresh_segment(journal: Path, timeout: float) -> None:
    """Until the live's active segment (its newest file: its length is what was written)
    is less than half full. The reserve for acknowledgements is what is left of the active
    segment's last quarter when the disk fills: a disk filled while the segment is past
    three quarters leaves them less (docs/broker.md, "A full disk")."""

    def fresh() -> bool:
        segments = sorted(journal.glob("journal-*.seg"))
        try:
            return bool(segments) and segments[-1].stat().st_size < ACK_SEGMENT // 2
        except FileNotFoundError:
            return False  # compacted away between the listing and the look

    wait_until(fresh, timeout, "a fresh journal segment on the live")


def test_acknowledges_on_a_full_disk_use_the_reserve_and_its_end_hands_over_to_the_backup(
    tmp_path: Path, protocol: str
) -> None:
    """The live's disk full with a backlog waiting: acknowledges go on in the active
    segment's reserve while sends are refused; when the reserve runs out, the write that
    finds no room fails the live's journal and it fences itself (log: the full disk), its
    synchronized backup takes over, and the consumer goes on there: nothing is lost or
    doubled, acknowledges in flight at the end are in doubt (their messages come again).

    The backup is paused past the old lease's end and grace when the live fences: the
    fenced live, whose disk failed, must leave the role to it rather than activate again
    by the start rule the moment its own lease has run out (a claim it made would have the
    backup follow it, and in one run in three it did, then died writing its identity to its
    full disk, and no node served again)."""
    # A long lease: on a loaded machine a missed renewal must not move the role before the
    # reserve is used up.
    pair = BrokerPair(
        tmp_path / "pair",
        user="app",
        password="secret",
        segment_size=ACK_SEGMENT,
        heartbeat_timeout=2.0,
    )
    live, backup = pair.nodes
    with small_disk(live.data_dir, DISK), pair:
        pair.wait_synchronized(30)
        queue = "queue://ack-reserve"
        url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
        producer = ConfirmedProducer(url, queue)
        consumer = AckingConsumer(url, queue)
        hog = DiskHog(live.data_dir)
        producer.start()
        try:
            wait_until(lambda: len(producer.confirmed) >= BACKLOG, 60, "a backlog")
            wait_for_a_fresh_segment(live.data_dir / "journal", 30)
            hog.start()
            wait_until(lambda: producer.raised, 20, "a send refused for the full disk")
            producer.stop.set()
            consumer.start()
            wait_until(
                lambda: "fencing itself" in live.log_path.read_text(errors="replace"),
                60,
                "the reserve to run out",
            )
            acknowledged_on_live = len(consumer.acknowledged)  # none is confirmed after it
            pair.pause(backup)
            try:
                time.sleep(pair.lease * 1.2 + 1.0)  # past the lease's end and its grace
            finally:
                pair.resume(backup)
            wait_until(lambda: backup.role == "live", 30, "the backup to take over")
            # The consumer goes on with the rest on the backup.
            wait_until(
                lambda: len(consumer.acknowledged) > acknowledged_on_live + 100,
                30,
                "acknowledges on the backup",
            )
        finally:
            hog.release()
            stop_all(producer, consumer)
        log = live.log_path.read_text()
        outcome = check(base_url(pair, protocol), queue, [producer], [consumer])
    assert acknowledged_on_live >= 50, "acknowledges stopped before the reserve was used"
    assert "journal write failed" in log and "no space left for a new journal segment" in log
    assert "the journal failed: fencing itself" in log
    assert "activates again" not in log, "the fenced live took the role before its backup"
    print(
        "\n"
        + outcome.line("acknowledge reserve used up on a full disk", protocol)
        + f" acknowledged on the full live={acknowledged_on_live}"
        f" in doubt={len(consumer.in_doubt)} stale acknowledges={consumer.stale}"
    )
    outcome.assert_clean()


def test_a_node_that_cannot_write_the_witness_does_not_take_the_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair directory cut off or read-only when a node would take the role (a start, a
    hand-over back to it): it stays backup and tries again later. The OSError once ended
    the process of an old live that resynchronized while its pair directory was cut."""
    node = Node(
        NodeConfig(node_id="live", role="live", data_dir=tmp_path / "data", pair_dir=tmp_path)
    )

    def read_only(*_args: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(node.witness, "try_activate", read_only)
    monkeypatch.setattr(node.witness, "renew", read_only)
    assert asyncio.run(node._acquire()) is False
    node._pending_activation = 2  # a hand-over claim
    assert asyncio.run(node._acquire()) is False
    assert node._pending_activation is None and node.lease is None
