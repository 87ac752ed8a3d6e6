"""Journal compaction: checkpoints written through the store, the segments before them deleted on
the live and on the backup, and a pair that compacts while it serves and loses nothing to a
SIGKILL or a failback afterwards.

The unit tests use real journals in temporary directories; the pair test talks STOMP to real
node processes started by ``BrokerPair``. Nothing is mocked but a stream writer that collects
replication frames.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import cast

import pytest
import stomp

from reference_broker.engine import AckMode, Engine
from reference_broker.journal import Journal, Record, SyncPolicy
from reference_broker.node import BackupCompactor, Checkpointer, build_parser, config_from_args
from reference_broker.pair import BrokerPair, NodeProcess
from reference_broker.records import RecordType, decode
from reference_broker.replication import FRAME_RECORD_BYTES, decode_records, write_records
from reference_broker.store import Store, compact_before

Q = "queue://orders"


def recover(journal: Journal) -> Engine:
    return Engine.recover(decode(r.type, r.payload) for r in journal.replay())


def busy_engine(rounds: int) -> Engine:
    """An engine with history: most messages acknowledged, some in flight, some waiting."""
    engine = Engine()
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=30)
    for r in range(rounds):
        for i in range(20):
            engine.send(
                Q, b"%d-%d " % (r, i) + b"x" * 200, persistent=True, duplicate_id=f"{r}-{i}"
            )
        for delivery in engine.poll(0.0)[:18]:
            engine.ack(consumer, delivery.tag)
    return engine


# --- the store ------------------------------------------------------------------------------


class Collected:
    """A replica that keeps what the store sends it."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def replicate(self, records: list[Record]) -> None:
        self.records += records


@pytest.mark.timeout(30)
def test_persist_later_encodes_on_the_journal_thread_at_its_place(tmp_path: Path) -> None:
    async def main() -> None:
        journal = Journal.open(tmp_path / "journal", sync=SyncPolicy.never())
        store = Store(journal)
        replica = Collected()
        store.attach_replica(replica)
        threads: list[str] = []

        def encode() -> list[tuple[int, bytes]]:
            threads.append(threading.current_thread().name)
            return [(0x40, b"b1"), (0x40, b"b2")]

        first = store.persist([(0x40, b"a")])
        later = store.persist_later(encode)
        after = store.persist([(0x40, b"c")])
        assert threads == []  # nothing encoded on the loop
        assert await first is None
        assert await later == 2  # the sequence number of its first record
        await after
        assert [(r.seq, r.payload) for r in journal.replay()] == [
            (1, b"a"),
            (2, b"b1"),
            (3, b"b2"),
            (4, b"c"),
        ]
        assert [(r.seq, r.payload) for r in replica.records] == [
            (r.seq, r.payload) for r in journal.replay()
        ]
        assert threads[0].startswith("journal")
        assert await store.persist_later(list) == 0
        await store.close()

    asyncio.run(main())


def test_compact_before_deletes_only_segments_wholly_before(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "journal", segment_size=200, sync=SyncPolicy.never()) as journal:
        for i in range(60):
            journal.append(0x40, b"%02d" % i + b"." * 40)
        segments = journal.segments
        assert len(segments) > 10
        middle = segments[5]
        seq = middle.first_seq + 1  # inside segment 5: it must stay
        assert compact_before(journal, middle.first_seq) is not None
        assert compact_before(journal, seq) is None  # nothing more wholly before seq
        kept = journal.segments
        assert kept[0].number == middle.number
        assert [r.seq for r in journal.replay()] == list(range(middle.first_seq, 61))
        # The active segment is never touched, even when everything is before seq.
        compact_before(journal, 1000)
        assert len(journal.segments) == 1


# --- the live's checkpoints -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_checkpointer_keeps_the_journal_small_and_recoverable(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    segment = 4096

    async def main() -> Engine:
        journal = Journal.open(directory, segment_size=segment, sync=SyncPolicy.never())
        engine = Engine()
        store = Store(journal)
        checkpointer = Checkpointer(engine, store, segments=3, ratio=2.0)
        conn = engine.connect()
        consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
        tx = engine.begin(conn)
        written = biggest = 0
        running: asyncio.Task[None] | None = None
        for r in range(100):
            for i in range(20):
                engine.send(Q, b"x" * 200, persistent=True, duplicate_id=None if i else f"{r}")
            deliveries = engine.poll(0.0)
            for delivery in deliveries[:18]:
                engine.ack(consumer, delivery.tag)
            engine.ack(consumer, deliveries[18].tag, tx=tx)  # settled inside an open tx
            # deliveries[19] stays in flight
            records = [record.encode() for record in engine.drain_records()]
            size = sum(len(payload) + 19 for _, payload in records)
            written += size
            biggest = max(biggest, size)
            store.persist(records)
            segments = await store.run(lambda: journal.segments)
            # As in the node, rounds go on while a checkpoint is written and compacted.
            if (running is None or running.done()) and checkpointer.due(segments):
                running = asyncio.create_task(checkpointer.checkpoint())
        assert running is not None
        await running
        await store.durable_barrier()
        # How many rounds ran while a checkpoint was written depends on the machine; checking
        # once more, as the node's loop would, leaves a journal that is not due whatever it was.
        while checkpointer.due(await store.run(lambda: journal.segments)):
            await checkpointer.checkpoint()
        await store.durable_barrier()
        assert checkpointer.count >= 3
        # Not due: fewer sealed segments than the threshold since the last checkpoint (its
        # segment, those sealed and the active one), or a journal under twice the estimate.
        bound = max((3 + 2) * segment + 2 * biggest, 2.0 * checkpointer.estimate())
        total = sum(s.size for s in journal.segments)
        assert total <= bound
        assert total < written / 4
        assert recover(journal).persistent_state() == engine.persistent_state()
        engine.commit(tx)
        await store.persist([record.encode() for record in engine.drain_records()])
        await store.close()
        return engine

    engine = asyncio.run(main())
    with Journal.open(directory) as journal:
        assert recover(journal).persistent_state() == engine.persistent_state()


@pytest.mark.timeout(120)
def test_a_checkpoint_torn_at_any_byte_recovers_and_is_superseded(tmp_path: Path) -> None:
    """The live dies while its checkpoint reaches the disk: the state before it stands, and
    the new checkpoint the node writes first makes what follows readable."""
    engine = busy_engine(rounds=5)
    origin = tmp_path / "origin"
    with Journal.open(origin, sync=SyncPolicy.never()) as journal:
        journal.append_many(record.encode() for record in engine.drain_records())
        start = journal.segments[-1].size
        journal.append_many(engine.take_checkpoint().encode())
        end = journal.segments[-1].size
        path = journal.segments[-1].path
    state = engine.persistent_state()
    after_begin = start + 27  # a record is 19 bytes and the checkpoint id 8
    clean = {after_begin, end - 27}  # between two records: no torn tail to cut
    cuts = {start + 1, after_begin, start + 40, (start + end) // 2, end - 30, *clean, end - 1}
    for cut in sorted(cuts):
        directory = tmp_path / f"cut-{cut}"
        shutil.copytree(origin, directory)
        with (directory / path.name).open("r+b") as file:
            file.truncate(cut)

        async def restart(directory: Path = directory, cut: int = cut) -> Engine:
            journal = Journal.open(directory, sync=SyncPolicy.never())
            assert (journal.recovery.truncated is None) == (cut in clean)
            recovered = recover(journal)
            assert recovered.persistent_state() == state
            assert recovered.torn_checkpoint == (cut >= after_begin)
            store = Store(journal)
            if recovered.torn_checkpoint:  # as node.py does before serving
                await Checkpointer(recovered, store, segments=1, ratio=0).checkpoint()
            recovered.send(Q, b"after the restart", persistent=True)
            await store.persist([r.encode() for r in recovered.drain_records()])
            await store.close()
            return recovered

        restarted = asyncio.run(restart())
        with Journal.open(directory) as journal:
            again = recover(journal)
            assert again.persistent_state() == restarted.persistent_state()
            assert not again.torn_checkpoint


# --- the backup's compaction ----------------------------------------------------------------


def test_the_backup_compacts_once_it_stored_a_whole_checkpoint(tmp_path: Path) -> None:
    engine = busy_engine(rounds=6)
    encoded = [record.encode() for record in engine.drain_records()]
    checkpoint = engine.take_checkpoint()
    encoded += checkpoint.encode()
    engine.send(Q, b"after", persistent=True)
    encoded += [record.encode() for record in engine.drain_records()]
    records = [Record(t, seq, p) for seq, (t, p) in enumerate(encoded, start=1)]
    begin = next(r.seq for r in records if r.type == RecordType.CHECKPOINT_BEGIN)
    end = next(r.seq for r in records if r.type == RecordType.CHECKPOINT_END)

    compactor = BackupCompactor()
    with Journal.open(tmp_path / "journal", segment_size=2048, sync=SyncPolicy.never()) as journal:
        for offset in range(0, len(records), 7):  # as RECORDS frames arrive, END in its own
            frame = records[offset : offset + 7]
            journal.append_records(frame)
            compactor(journal, frame)
            first = journal.segments[0].first_seq
            if frame[-1].seq < end:
                assert first == 1, "compacted before the checkpoint was complete"
        segments = journal.segments
        assert segments[0].first_seq <= begin <= segments[0].last_seq
        assert recover(journal).persistent_state() == engine.persistent_state()

    # An END that does not match the BEGIN deletes nothing.
    compactor = BackupCompactor()
    stray = [*records[:begin], Record(RecordType.CHECKPOINT_END, begin + 1, b"\x63" + b"\x00" * 7)]
    with Journal.open(tmp_path / "stray", segment_size=2048, sync=SyncPolicy.never()) as journal:
        journal.append_records(stray)
        compactor(journal, stray)
        assert journal.segments[0].first_seq == 1


def test_replication_cuts_big_batches_into_frames() -> None:
    class Frames:
        def __init__(self) -> None:
            self.frames: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.frames.append(data)

    records = [Record(0x22, seq, bytes([seq]) * 300_000) for seq in range(1, 12)]
    writer = Frames()
    write_records(cast(asyncio.StreamWriter, writer), records)
    assert len(writer.frames) > 1
    assert all(len(frame) <= FRAME_RECORD_BYTES + 300_100 for frame in writer.frames)
    decoded = [r for frame in writer.frames for r in decode_records(frame[5:])]
    assert decoded == records


def test_the_command_line_sets_segment_size_and_checkpoint_thresholds() -> None:
    base = [
        *("--node-id", "a", "--role", "live", "--data-dir", "d", "--pair-dir", "p"),
        *("--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"),
    ]
    defaults = config_from_args(build_parser().parse_args(base))
    assert (defaults.segment_size, defaults.checkpoint_segments) == (16 * 1024 * 1024, 3)
    assert defaults.checkpoint_ratio == 2.0
    options = ["--segment-size", "65536", "--checkpoint-segments", "2", "--checkpoint-ratio", "3"]
    config = config_from_args(build_parser().parse_args([*base, *options]))
    assert (config.segment_size, config.checkpoint_segments, config.checkpoint_ratio) == (
        65536,
        2,
        3.0,
    )


# --- the pair -------------------------------------------------------------------------------

SEGMENT = 64 * 1024
CHECKPOINT_SEGMENTS = 3
PAD = "x" * 1000


class Listener(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.receipts: set[str] = set()
        self.messages: list[stomp.utils.Frame] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        with self.lock:
            self.receipts.add(frame.headers["receipt-id"])

    def on_message(self, frame: stomp.utils.Frame) -> None:
        with self.lock:
            self.messages.append(frame)

    def on_error(self, frame: stomp.utils.Frame) -> None:
        self.errors.append(frame.headers.get("message", ""))


def _connect(node: NodeProcess) -> tuple[stomp.Connection12, Listener]:
    connection = stomp.Connection12([("127.0.0.1", node.stomp_port)], heartbeats=(0, 0))
    listener = Listener()
    connection.set_listener("test", listener)
    connection.connect("admin", "admin", wait=True)
    return connection, listener


def _wait(listener: Listener, receipts: set[str], timeout: float = 60) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with listener.lock:
            if receipts <= listener.receipts:
                break
        time.sleep(0.01)
    with listener.lock:
        return receipts & listener.receipts


def send(node: NodeProcess, destination: str, names: list[str]) -> set[str]:
    """Send persistent 1 KiB messages, a receipt each; the names the broker confirmed."""
    connection, listener = _connect(node)
    try:
        for name in names:
            body = f"{name}:{PAD}"
            connection.send(destination, body, headers={"persistent": "true", "receipt": name})
        return _wait(listener, set(names))
    finally:
        connection.disconnect()


def consume(node: NodeProcess, destination: str, count: int | None) -> set[str]:
    """Acknowledge `count` messages (None: until the queue stays empty), a receipt each;
    the names whose acknowledgement the broker confirmed."""
    connection, listener = _connect(node)
    acked: dict[str, str] = {}  # receipt -> name
    try:
        connection.subscribe(
            destination, id="c", ack="client-individual", headers={"prefetch-count": "100"}
        )
        last = time.monotonic()
        taken = 0
        deadline = time.monotonic() + 60
        while (count is None or len(acked) < count) and time.monotonic() < deadline:
            with listener.lock:
                fresh = listener.messages[taken:]
            taken += len(fresh)
            if fresh:
                last = time.monotonic()
            elif count is None and time.monotonic() - last > 1.5:
                break
            for frame in fresh:
                if count is not None and len(acked) >= count:
                    break
                name = str(frame.body).split(":", 1)[0]
                assert f"ack-{name}" not in acked, f"{name} delivered twice"
                receipt = f"ack-{name}"
                acked[receipt] = name
                connection.ack(frame.headers["ack"], receipt=receipt)
            time.sleep(0.005)
        confirmed = _wait(listener, set(acked))
        assert not listener.errors, listener.errors
        return {acked[r] for r in confirmed}
    finally:
        connection.disconnect()


def journal_files(node: NodeProcess) -> list[Path]:
    return sorted((node.data_dir / "journal").glob("journal-*.seg"))


def journal_bytes(node: NodeProcess) -> int:
    return sum(path.stat().st_size for path in journal_files(node))


def log_lines(node: NodeProcess, words: str) -> int:
    return node.log_path.read_text(errors="replace").count(words)


@pytest.mark.broker
@pytest.mark.timeout(240)
def test_the_pair_compacts_while_serving_and_loses_nothing(tmp_path: Path) -> None:
    with BrokerPair(
        tmp_path / "pair",
        heartbeat_timeout=1.0,
        segment_size=SEGMENT,
        checkpoint_segments=CHECKPOINT_SEGMENTS,
    ) as pair:
        original, backup = pair.live, pair.backup
        destination = "/queue/compaction"
        confirmed: set[str] = set()
        consumed: set[str] = set()
        rounds = 14
        for r in range(rounds):
            names = [f"r{r}-{i}" for i in range(600)]
            sent = send(original, destination, names)
            assert sent == set(names), f"round {r}: {len(names) - len(sent)} sends unconfirmed"
            confirmed |= sent
            # 200 stay behind: every checkpoint carries a backlog.
            consumed |= consume(original, destination, 400 if r == 0 else 600)
        assert len(consumed) == len(confirmed) - 200
        written = len(confirmed) * 1024  # without compaction the journal holds at least this
        assert written // SEGMENT > 120

        # Both journals shrink to the last checkpoint and what followed it (at most twice
        # the checkpoint, by the node's ratio, or the threshold's few segments).
        def small(node: NodeProcess) -> bool:
            return journal_bytes(node) < written / 3 and len(journal_files(node)) <= 30

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (small(original) and small(backup)):
            time.sleep(0.1)
        for node in (original, backup):
            size, files = journal_bytes(node), len(journal_files(node))
            assert small(node), f"{node.name}: {size} bytes in {files} segments"
        assert log_lines(original, "bytes at seq") >= 3
        assert log_lines(backup, "stored at seq") >= 3

        # SIGKILL the live: the backup recovers from its compacted journal.
        pair.kill(original)
        assert pair.wait_active(timeout=10) is backup
        remaining = confirmed - consumed
        half = consume(backup, destination, len(remaining) // 2)
        assert half <= remaining, f"consumed ones came back: {sorted(half - remaining)[:5]}"
        consumed |= half

        # The old live rejoins, copies the compacted journal (sequence numbers with gaps),
        # and takes its role back (failback).
        pair.restart(original)
        deadline = time.monotonic() + 30
        while pair.live is not original and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pair.live is original
        rest = consume(original, destination, None)
        assert rest == confirmed - consumed, (
            f"lost {len(confirmed - consumed - rest)}, came back {len(rest & consumed)}"
        )
