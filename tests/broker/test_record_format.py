"""A node never reads records of another encoding: the journal's and the link's record format.

The journal's own format checks are in test_journal.py; here the broker's side: a node whose
data directory holds a journal of another record format refuses to start, naming the file and
both formats, and leaves the journal as it was (a backup would otherwise delete it to copy the
live's); the replication link refuses a peer of another format before anything is copied.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import zlib
from pathlib import Path

import pytest

from reference_broker import node
from reference_broker.journal import MAGIC, Journal, SyncPolicy
from reference_broker.records import RECORD_FORMAT
from reference_broker.replication import (
    BackupLink,
    Kind,
    ReplicationFormatError,
    backup_handshake,
    live_handshake,
    read_frame,
    write_frame,
)
from reference_broker.store import Store

from .test_replication import SECRET, Live, until


def segment_header(number: int, *, version: int, content_format: int) -> bytes:
    head = struct.pack("<8sHHQQ", MAGIC, version, content_format, number, 0)
    return head + struct.pack("<I", zlib.crc32(head))


def node_args(tmp_path: Path, role: str) -> list[str]:
    return [
        *("--node-id", "a", "--role", role),
        *("--data-dir", str(tmp_path / "data"), "--pair-dir", str(tmp_path / "pair")),
        *("--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"),
        *("--peer-replication-port", "4"),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("role", ["live", "backup"])
def test_a_node_refuses_to_start_on_a_journal_of_another_record_format(
    tmp_path: Path, role: str, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "data" / "journal"
    journal.mkdir(parents=True)
    segment = journal / "journal-00000001.seg"
    segment.write_bytes(segment_header(1, version=2, content_format=RECORD_FORMAT + 1))
    before = segment.read_bytes()
    with caplog.at_level(logging.ERROR, logger="reference_broker.node"):
        assert node.main(node_args(tmp_path, role)) == 2
    message = caplog.records[-1].getMessage()
    assert str(segment) in message
    assert f"content format {RECORD_FORMAT + 1}" in message
    assert f"reads journal format 2, content format {RECORD_FORMAT}" in message
    assert "corrupt" not in message
    assert [p.name for p in journal.iterdir()] == [segment.name]
    assert segment.read_bytes() == before


def test_a_node_reads_an_unversioned_journal_and_writes_on_in_its_format(tmp_path: Path) -> None:
    """The decision for journals written before formats were recorded: read as this format
    (its decoder reads every record they hold); new records go into a new segment."""
    journal = tmp_path / "journal"
    (journal).mkdir()
    with Journal.open(journal, sync=SyncPolicy.never(), content_format=RECORD_FORMAT) as made:
        made.append(0x40, b"old")
    # As older code wrote it: journal format 1, the content format's field reserved (0).
    segment = journal / "journal-00000001.seg"
    data = segment.read_bytes()
    segment.write_bytes(segment_header(1, version=1, content_format=0) + data[32:])
    config = node.NodeConfig(
        node_id="a", role="live", data_dir=tmp_path, pair_dir=tmp_path / "pair", sync="never"
    )
    with node.Node(config)._open_journal() as opened:
        assert [r.payload for r in opened.replay()] == [b"old"]
        opened.append(0x40, b"new")
        assert opened.segments[-1].path.read_bytes()[8:12] == struct.pack("<HH", 2, RECORD_FORMAT)


@pytest.mark.timeout(30)
def test_a_backup_refuses_a_live_of_another_format_before_it_opens_its_journal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        live = Live(tmp_path / "live")
        await live.start()
        opened: list[Store] = []

        async def open_store() -> Store:
            opened.append(Store(Journal.open(tmp_path / "backup", sync=SyncPolicy.never())))
            return opened[-1]

        link = BackupLink(
            node_id="backup",
            timeout=2.0,
            open_store=open_store,
            on_synchronized=lambda live, activation: None,
            secret=SECRET,
            record_format=RECORD_FORMAT + 1,
        )
        with pytest.raises(ReplicationFormatError) as info:
            await asyncio.wait_for(link.follow("127.0.0.1", live.port), 10)
        assert link.refused
        assert opened == [], "the backup opened (and emptied) its journal for a live it refuses"
        text = str(info.value)
        assert f"format {RECORD_FORMAT}," in text and f"format {RECORD_FORMAT + 1}" in text
        # The live refused it too: never attached, never eligible.
        await until(lambda: any("refused a backup" in r.getMessage() for r in caplog.records))
        assert live.eligibility == []
        await live.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_live_refuses_a_backup_that_does_not_say_its_format(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Older code's backup (no format in HELLO) may not read what this live writes."""

    async def main() -> None:
        live = Live(tmp_path / "live")
        await live.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        await backup_handshake(
            reader, writer, node_id="old", secret=SECRET, timeout=5, record_format=None
        )
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read_frame(reader, 5)  # no SYNC_BEGIN: the link is closed
        writer.close()
        assert live.eligibility == []
        await live.close()

    with caplog.at_level(logging.ERROR, logger="reference_broker.replication"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if "refused a backup" in r.getMessage()]
    assert refusals and "does not say which record format" in refusals[0]


@pytest.mark.timeout(30)
def test_a_backup_follows_a_live_that_predates_formats(tmp_path: Path) -> None:
    """A live of older code says no format: its records are what an unversioned journal
    holds, which this format reads, so the backup follows it (upgrade the backup first)."""

    async def main() -> None:
        async def old_live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await live_handshake(
                reader, writer, node_id="live", secret=SECRET, timeout=5, record_format=None
            )
            begin = {"live": "live", "activation": 1, "upto": 0}
            write_frame(writer, Kind.SYNC_BEGIN, json.dumps(begin).encode())
            await asyncio.sleep(0.2)
            writer.close()

        server = await asyncio.start_server(old_live, "127.0.0.1", 0)
        opened: list[Store] = []

        async def open_store() -> Store:
            opened.append(Store(Journal.open(tmp_path / "backup", sync=SyncPolicy.never())))
            return opened[-1]

        link = BackupLink(
            node_id="backup",
            timeout=2.0,
            open_store=open_store,
            on_synchronized=lambda live, activation: None,
            secret=SECRET,
        )
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(link.follow("127.0.0.1", server.sockets[0].getsockname()[1]), 10)
        server.close()
        assert len(opened) == 1 and not link.refused
        for store in opened:
            await store.close()

    asyncio.run(main())
