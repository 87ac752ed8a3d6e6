"""Replication between the live and its backup, each end against a scripted peer.

Real journals in temporary directories and real loopback sockets; the other end of the link
is a few lines of frames written and read by the test, so that it can stop at any point of
the protocol.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from reference_broker.journal import Journal, Record, SyncPolicy
from reference_broker.replication import (
    BackupLink,
    Kind,
    LiveReplicationServer,
    decode_records,
    encode_records,
    read_frame,
    write_frame,
)
from reference_broker.store import Store

TYPE = 0x40  # any record type: the link never reads what records mean
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
        timeout: float = 2.0,
        on_handover: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.journal = Journal.open(directory, sync=SyncPolicy.never())
        self.store = Store(self.journal)
        self.eligibility: list[tuple[str, bool]] = []

        async def no_handover() -> int:
            raise AssertionError("no hand-over expected")

        self.server = LiveReplicationServer(
            self.store,
            node_id="live",
            activation=1,
            timeout=timeout,
            on_handover=on_handover or no_handover,
            on_eligibility=lambda backup, eligible: self.eligibility.append((backup, eligible)),
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
        write_frame(writer, Kind.HELLO, json.dumps({"node_id": "backup"}).encode())
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
            kind, _ = await next_frame(reader)
            assert kind is Kind.HELLO
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
