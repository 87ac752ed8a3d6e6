"""Replication between the live and its backup, each end against a scripted peer.

Real journals in temporary directories and real loopback sockets; the other end of the link
is a few lines of frames written and read by the test, so that it can stop at any point of
the protocol.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from reference_broker import replication
from reference_broker.journal import Journal, Record, SyncPolicy
from reference_broker.replication import (
    DRAIN_TIMEOUTS,
    SYNC_CHUNK,
    BackupLink,
    Kind,
    LiveReplicationServer,
    backup_handshake,
    decode_records,
    encode_records,
    live_handshake,
    read_frame,
    write_frame,
)
from reference_broker.store import FencedError, Store

TYPE = 0x40  # any record type: the link never reads what records mean
SECRET = bytes(range(32))  # the pair secret both ends prove they hold
_SEQ_BYTES = 8


def seq_of(payload: bytes) -> int:
    return int.from_bytes(payload[:_SEQ_BYTES], "little")


def ack(writer: asyncio.StreamWriter, seq: int) -> None:
    write_frame(writer, Kind.ACK, seq.to_bytes(_SEQ_BYTES, "little"))


async def next_frame(reader: asyncio.StreamReader, timeout: float = 5.0) -> tuple[Kind, bytes]:
    """The next frame that is not a PING."""
    while True:
        kind, payload = await read_frame(reader, timeout)
        if kind is not Kind.PING:
            return kind, payload


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


class Live:
    """A live's store and replication server on a loopback port."""

    def __init__(
        self,
        directory: Path,
        *,
        # Scripted backups send no PING: well above the tests' own pauses, so that a slow
        # machine never ends a link (and degrades the live) halfway through a test.
        timeout: float = 10.0,
        on_handover: Callable[[], Awaitable[int]] | None = None,
        record_eligibility: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.journal = Journal.open(directory, sync=SyncPolicy.never())
        self.store = Store(self.journal)
        self.eligibility: list[tuple[str, bool]] = []  # as recorded (the record did not fail)

        def on_eligibility(backup: str, eligible: bool) -> None:
            if record_eligibility is not None:
                record_eligibility(backup, eligible)
            self.eligibility.append((backup, eligible))

        async def no_handover() -> int:
            raise AssertionError("no hand-over expected")

        self.server = LiveReplicationServer(
            self.store,
            node_id="live",
            activation=1,
            timeout=timeout,
            on_handover=on_handover or no_handover,
            on_eligibility=on_eligibility,
            secret=SECRET,
        )
        self.port = 0

    @property
    def eligible(self) -> bool:
        return bool(self.eligibility) and self.eligibility[-1][1]

    async def start(self) -> None:
        self.port = await self.server.start("127.0.0.1", 0)

    async def close(self) -> None:
        await self.server.close()
        await self.store.close()


@pytest.mark.timeout(30)
def test_the_backup_is_eligible_only_once_it_holds_what_was_confirmed_during_the_copy(
    tmp_path: Path,
) -> None:
    """Records the live confirmed while the backup was copying its journal (the backlog) reach
    the backup after SYNC_END: an ACK of the copy alone must not make the backup eligible."""

    async def main() -> None:
        live = Live(tmp_path / "live")
        # Big enough that the copy waits for the socket to drain while the test holds back.
        await live.store.persist([(TYPE, b"c" * 100_000) for _ in range(40)])
        await live.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
        kind, payload = await next_frame(reader)
        assert kind is Kind.SYNC_BEGIN
        upto = json.loads(payload)["upto"]
        assert upto == 40
        # Confirmed during the copy, on the live's disk alone: the backlog.
        await live.store.persist([(TYPE, b"backlog-%d" % i) for i in range(5)])
        copied: list[Record] = []
        while True:
            kind, payload = await next_frame(reader)
            if kind is Kind.SYNC_END:
                break
            assert kind is Kind.RECORDS
            copied += decode_records(payload)
        assert [r.seq for r in copied] == list(range(1, 41))
        ack(writer, upto)  # the copy is on the backup's disk; the backlog is not
        after = live.store.persist([(TYPE, b"after SYNC_END")])
        await asyncio.sleep(0.2)
        assert not live.eligible, "eligible before the backlog reached the backup"
        assert not after.done(), "confirmed after SYNC_END without the backup"
        kind, payload = await next_frame(reader)
        assert kind is Kind.RECORDS
        backlog = [r for r in decode_records(payload) if r.seq <= 45]
        assert [r.payload for r in backlog] == [b"backlog-%d" % i for i in range(5)]
        ack(writer, 45)
        await until(lambda: live.eligible)
        assert not after.done()
        ack(writer, 46)
        await asyncio.wait_for(after, 5)
        writer.close()
        await until(lambda: not live.eligible)  # a lost link revokes it
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_backup_acknowledges_nothing_before_sync_end(tmp_path: Path) -> None:
    async def main() -> None:
        acks: list[int] = []
        sync_end_sent = asyncio.Event()
        acks_before_end: list[int] = []

        async def scripted_live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await live_handshake(reader, writer, node_id="live", secret=SECRET, timeout=5)
            begin = {"live": "live", "activation": 1, "upto": 3}
            write_frame(writer, Kind.SYNC_BEGIN, json.dumps(begin).encode())
            write_frame(
                writer,
                Kind.RECORDS,
                encode_records([Record(type=TYPE, seq=s, payload=b"x") for s in (1, 2, 3)]),
            )
            with_ack = asyncio.ensure_future(next_frame(reader))
            done, _ = await asyncio.wait([with_ack], timeout=0.5)
            if done:
                acks_before_end.append(seq_of(with_ack.result()[1]))
            write_frame(writer, Kind.SYNC_END, (3).to_bytes(_SEQ_BYTES, "little"))
            sync_end_sent.set()
            kind, payload = await (with_ack if not done else next_frame(reader))
            assert kind is Kind.ACK
            acks.append(seq_of(payload))
            write_frame(writer, Kind.RECORDS, encode_records([Record(TYPE, 4, b"y")]))
            kind, payload = await next_frame(reader)
            assert kind is Kind.ACK
            acks.append(seq_of(payload))
            writer.close()

        server = await asyncio.start_server(scripted_live, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stores: list[Store] = []

        async def open_store() -> Store:
            stores.append(Store(Journal.open(tmp_path / "backup", sync=SyncPolicy.never())))
            return stores[-1]

        link = BackupLink(
            node_id="backup",
            timeout=2.0,
            open_store=open_store,
            on_synchronized=lambda live, activation: None,
            secret=SECRET,
        )
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(link.follow("127.0.0.1", port), 10)
        server.close()
        assert acks_before_end == [], "acknowledged the copy before SYNC_END"
        assert sync_end_sent.is_set()
        assert acks == [3, 4]
        for store in stores:
            await store.close()

    asyncio.run(main())


async def synchronized_backup(live: Live) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A scripted backup that copied the live's journal and is eligible."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
    while (await next_frame(reader))[0] is not Kind.SYNC_END:
        pass
    ack(writer, live.store.local_seq)
    await until(lambda: live.eligible)
    return reader, writer


@pytest.mark.timeout(30)
def test_a_hand_over_under_traffic_reads_the_acks_it_waits_for(tmp_path: Path) -> None:
    """The hand-over waits until the backup acknowledged everything; those ACKs arrive on the
    link the hand-over was asked on, so it must not hold up the reading of that link."""

    async def main() -> None:
        async def handover() -> int:
            await live.store.durable_barrier()
            return live.store.local_seq

        live = Live(tmp_path / "live", on_handover=handover)
        await live.store.persist([(TYPE, b"before")])
        await live.start()
        reader, writer = await synchronized_backup(live)
        sent = live.store.persist([(TYPE, b"in flight")])
        kind, payload = await next_frame(reader)
        assert kind is Kind.RECORDS
        (record,) = decode_records(payload)
        write_frame(writer, Kind.HANDOVER)  # asked before the last batch is acknowledged
        await asyncio.sleep(0.05)
        ack(writer, record.seq)
        kind, payload = await next_frame(reader)
        assert kind is Kind.HANDOVER_READY
        assert seq_of(payload) == record.seq
        await asyncio.wait_for(sent, 5)
        writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_hand_over_the_backup_never_acknowledges_gives_up_in_time(tmp_path: Path) -> None:
    async def main() -> None:
        gave_up: list[bool] = []

        async def handover() -> int:
            caught_up = await live.store.replica_caught_up(0.3)
            gave_up.append(not caught_up)
            if not caught_up:
                raise ConnectionError("the backup did not acknowledge everything in time")
            return live.store.local_seq

        live = Live(tmp_path / "live", on_handover=handover)
        await live.start()
        reader, writer = await synchronized_backup(live)
        live.store.persist([(TYPE, b"never acknowledged")])
        write_frame(writer, Kind.HANDOVER)
        # The live serves on and ends the link: the backup resynchronizes.
        kinds: list[Kind] = []

        async def read_to_the_end() -> None:
            while True:
                kinds.append((await next_frame(reader))[0])

        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await read_to_the_end()
        assert Kind.HANDOVER_READY not in kinds
        assert gave_up == [True]
        writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_hand_over_request_fails_when_the_link_ends(tmp_path: Path) -> None:
    async def main() -> None:
        async def scripted_live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await live_handshake(reader, writer, node_id="live", secret=SECRET, timeout=5)
            begin = {"live": "live", "activation": 1, "upto": 0}
            write_frame(writer, Kind.SYNC_BEGIN, json.dumps(begin).encode())
            write_frame(writer, Kind.SYNC_END, (0).to_bytes(_SEQ_BYTES, "little"))
            assert (await next_frame(reader))[0] is Kind.ACK
            assert (await next_frame(reader))[0] is Kind.HANDOVER
            writer.close()  # the live dies before it answers

        server = await asyncio.start_server(scripted_live, "127.0.0.1", 0)
        stores: list[Store] = []

        async def open_store() -> Store:
            stores.append(Store(Journal.open(tmp_path / "backup", sync=SyncPolicy.never())))
            return stores[-1]

        link = BackupLink(
            node_id="backup",
            timeout=2.0,
            open_store=open_store,
            on_synchronized=lambda live, activation: None,
            secret=SECRET,
        )
        follower = asyncio.ensure_future(
            link.follow("127.0.0.1", server.sockets[0].getsockname()[1])
        )
        await until(lambda: link.synchronized)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(link.request_handover(), 5)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await follower
        server.close()
        for store in stores:
            await store.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_initial_copy_reads_the_journal_once(tmp_path: Path) -> None:
    """One iterator over the journal, not one read from the start per chunk of SYNC_CHUNK."""

    async def main() -> None:
        live = Live(tmp_path / "live")
        await live.store.persist([(TYPE, b"%d" % i) for i in range(5 * SYNC_CHUNK + 7)])
        reads: list[int] = []
        records_after = live.journal.records_after

        def counted(seq: int) -> Iterator[Record]:
            reads.append(seq)
            return records_after(seq)

        live.journal.records_after = counted  # type: ignore[method-assign]
        await live.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
        copied: list[int] = []
        while True:
            kind, payload = await next_frame(reader)
            if kind is Kind.SYNC_END:
                break
            if kind is Kind.RECORDS:
                copied += [r.seq for r in decode_records(payload)]
        assert copied == list(range(1, 5 * SYNC_CHUNK + 8))
        assert reads == [0]
        writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_backup_that_stops_reading_during_the_copy_is_dropped_in_time(tmp_path: Path) -> None:
    async def main() -> None:
        live = Live(tmp_path / "live", timeout=0.2)
        await live.store.persist([(TYPE, b"c" * 100_000) for _ in range(200)])
        await live.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
        started = asyncio.get_running_loop().time()
        # Read nothing: the live's copy waits for the socket to drain, then gives up.
        await until(lambda: live.store.replica is None and live.eligibility != [], timeout=10)
        waited = asyncio.get_running_loop().time() - started
        assert waited < DRAIN_TIMEOUTS * 0.2 + 2.0
        assert not live.eligible
        writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_backlog_past_its_bound_abandons_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replication, "MAX_BACKLOG_BYTES", 10_000)

    async def main() -> None:
        live = Live(tmp_path / "live")
        # Two chunks: the backlog is written between the copy's two reads of the journal.
        await live.store.persist([(TYPE, b"c" * 100) for _ in range(SYNC_CHUNK + 10)])
        await live.start()
        journal_busy = threading.Event()
        held = asyncio.ensure_future(live.store.run(journal_busy.wait))  # the copy waits
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
        assert (await next_frame(reader))[0] is Kind.SYNC_BEGIN
        backlog = live.store.persist([(TYPE, b"b" * 1000) for _ in range(20)])  # 20 kB
        await asyncio.sleep(0.05)  # its write is queued behind the copy's first read
        journal_busy.set()
        await held
        await backlog
        kinds: list[Kind] = []

        async def read_to_the_end() -> None:
            while True:
                kinds.append((await next_frame(reader))[0])

        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await read_to_the_end()
        assert Kind.SYNC_END not in kinds
        assert live.store.replica is None
        writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_second_backup_connection_never_shares_the_sync_state_of_the_first(
    tmp_path: Path,
) -> None:
    """While the first link is still ending, a new connection is refused: accepting it would
    let the first link's clean-up reset the state the second one synchronizes with."""

    async def main() -> None:
        live = Live(tmp_path / "live", timeout=1.0)
        await live.store.persist([(TYPE, b"x")])
        await live.start()
        journal_busy = threading.Event()
        held = asyncio.ensure_future(live.store.run(journal_busy.wait))  # the copy waits
        first_reader, first_writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(first_reader, first_writer, node_id="b", secret=SECRET, timeout=5)
        await until(lambda: live.store.replica is not None)
        server_side = live.server._writer  # the first link's end on the live
        assert server_side is not None
        server_side.close()  # closing, while its task still waits for the journal
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(reader, writer, node_id="backup", secret=SECRET, timeout=5)
        try:
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await next_frame(reader)  # refused
        finally:
            journal_busy.set()
            await held
        writer.close()
        await until(lambda: live.store.replica is None)  # the first link has ended
        _, again_writer = await synchronized_backup(live)
        assert live.server.synchronized
        again_writer.close()
        first_writer.close()
        await live.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_failed_journal_write_fails_the_store_for_good(tmp_path: Path) -> None:
    async def main() -> None:
        journal = Journal.open(tmp_path / "live", sync=SyncPolicy.never())
        store = Store(journal)
        await store.persist([(TYPE, b"ok")])
        assert not store.failed
        await store.run(journal.close)  # the next write fails
        with pytest.raises(FencedError):
            await store.persist([(TYPE, b"lost")])
        assert store.failed
        with pytest.raises(FencedError):
            await store.persist([(TYPE, b"after")])
        await store.close()

    asyncio.run(main())
