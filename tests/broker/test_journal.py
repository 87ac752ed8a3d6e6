"""Tests of the broker's append-only journal: format, recovery, compaction, replication."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reference_broker.journal import (
    MAGIC,
    RECORD_OVERHEAD,
    SEGMENT_HEADER_SIZE,
    Journal,
    JournalClosedError,
    JournalCorruptError,
    JournalError,
    JournalFormatError,
    JournalLockedError,
    JournalSequenceError,
    JournalUsageError,
    Record,
    SyncMode,
    SyncPolicy,
    check_format,
)

NEVER = SyncPolicy.never()
SMALL_SEGMENT = 1024

record_types = st.integers(min_value=1, max_value=255)
payloads = st.binary(max_size=300)
io_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def open_journal(
    directory: Path,
    *,
    segment_size: int = SMALL_SEGMENT,
    sync: SyncPolicy = NEVER,
    salvage: bool = False,
) -> Journal:
    return Journal.open(directory, segment_size=segment_size, sync=sync, salvage=salvage)


def sample_payload(seq: int, size: int | None = None) -> bytes:
    size = (seq * 37) % 200 if size is None else size
    return bytes((seq + i) % 251 for i in range(size))


def fill(journal: Journal, count: int) -> list[Record]:
    """Append `count` records, singly and in batches; return what was written."""
    written: list[Record] = []
    while len(written) < count:
        seq = journal.last_seq + 1
        batch = [
            (1 + (seq + i) % 255, sample_payload(seq + i))
            for i in range(min(3, count - len(written)))
        ]
        if len(batch) == 1:
            journal.append(*batch[0])
        else:
            journal.append_many(batch)
        written += [Record(t, seq + i, p) for i, (t, p) in enumerate(batch)]
    return written


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("journal-*.seg"))


def replayed(directory: Path) -> list[Record]:
    with open_journal(directory) as journal:
        return list(journal.replay())


def flip_bit(path: Path, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def record_offsets(data: bytes) -> list[int]:
    """Byte offsets of the records in a good segment file's bytes."""
    offsets = []
    offset = SEGMENT_HEADER_SIZE
    while offset < len(data):
        offsets.append(offset)
        (length,) = struct.unpack_from("<I", data, offset)
        offset += RECORD_OVERHEAD + length
    return offsets


def segment_header(
    number: int,
    prev_seq: int = 0,
    *,
    version: int = 2,
    content_format: int = 0,
    magic: bytes = MAGIC,
) -> bytes:
    head = struct.pack("<8sHHQQ", magic, version, content_format, number, prev_seq)
    return head + struct.pack("<I", zlib.crc32(head))


def encode_record(rtype: int, seq: int, payload: bytes) -> bytes:
    """The record layout, written out independently of the module under test."""
    fields = struct.pack("<IBQ", len(payload), rtype, seq)
    head = fields + struct.pack("<H", zlib.crc32(fields) & 0xFFFF)
    return head + payload + struct.pack("<I", zlib.crc32(head + payload))


# --- round trip -----------------------------------------------------------------------------


def test_new_journal_is_empty_and_starts_at_one(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j", sync=SyncPolicy.always()) as journal:
        assert list(journal.replay()) == []
        assert journal.last_seq == 0
        assert journal.recovery.clean
        assert journal.append(7, b"first") == 1
    assert [p.name for p in segment_files(tmp_path / "j")] == ["journal-00000001.seg"]
    with open_journal(tmp_path / "deeper" / "still") as journal:
        assert journal.directory == tmp_path / "deeper" / "still"


def test_round_trip_across_segments_and_reopen(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 400)
        assert list(journal.replay()) == written
    assert len(segment_files(tmp_path)) > 10
    with open_journal(tmp_path) as journal:
        assert journal.recovery.clean
        assert journal.recovery.records == 400
        assert journal.last_seq == 400
        assert list(journal.replay()) == written
        assert journal.append(3, b"more") == 401
        assert journal.append_many([(4, b"a"), (5, b"")]) == 403
    assert replayed(tmp_path)[-3:] == [
        Record(3, 401, b"more"),
        Record(4, 402, b"a"),
        Record(5, 403, b""),
    ]


def test_files_hold_exactly_the_documented_layout(tmp_path: Path) -> None:
    with open_journal(tmp_path, segment_size=100) as journal:
        journal.append(1, b"alpha")
        journal.append_many([(2, b""), (255, b"\x00" * 40)])
        journal.append_records([Record(9, 10, b"replicated")])
    first, second, third = segment_files(tmp_path)
    assert first.read_bytes() == segment_header(1, 0) + encode_record(1, 1, b"alpha")
    assert second.read_bytes() == (
        segment_header(2, 1) + encode_record(2, 2, b"") + encode_record(255, 3, b"\x00" * 40)
    )
    assert third.read_bytes() == segment_header(3, 3) + encode_record(9, 10, b"replicated")


def test_segments_are_sealed_at_segment_size(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        fill(journal, 200)
        *sealed, active = journal.segments
        for info in sealed:
            assert info.size <= SMALL_SEGMENT
            assert info.path.stat().st_size == info.size
        assert active.size <= SMALL_SEGMENT
        seqs = [(info.first_seq, info.last_seq) for info in journal.segments]
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(seqs))


def test_oversized_record_gets_its_own_segment(tmp_path: Path) -> None:
    big = os.urandom(5 * SMALL_SEGMENT)
    with open_journal(tmp_path) as journal:
        journal.append(1, b"small")
        journal.append(2, big)
        journal.append(3, b"after")
        assert [info.records for info in journal.segments] == [1, 1, 1]
    assert [r.payload for r in replayed(tmp_path)] == [b"small", big, b"after"]


@pytest.mark.parametrize("bad_type", [0, 256, -1, 1.0, "1"])
def test_record_type_outside_1_to_255_is_refused(tmp_path: Path, bad_type: object) -> None:
    with open_journal(tmp_path) as journal:
        with pytest.raises(JournalUsageError, match=r"1\.\.255"):
            journal.append(bad_type, b"x")  # type: ignore[arg-type]
        with pytest.raises(JournalUsageError):
            journal.append_many([(1, b"ok"), (bad_type, b"x")])  # type: ignore[list-item]
        assert journal.last_seq == 0
    assert replayed(tmp_path) == []


def test_empty_batches_write_nothing(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        journal.append(1, b"x")
        assert journal.append_many([]) == 1
        assert journal.append_records([]) == 1
        assert journal.unsynced_bytes == RECORD_OVERHEAD + 1


# --- sync policy ----------------------------------------------------------------------------


@pytest.fixture
def fdatasync_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count real fdatasync calls (a spy: each call still reaches the kernel)."""
    calls: list[int] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    return calls


def test_sync_policy_values() -> None:
    assert SyncPolicy.always().mode is SyncMode.ALWAYS
    assert SyncPolicy.group(0.01).interval == 0.01
    assert not SyncPolicy.never().durable
    with pytest.raises(JournalUsageError):
        SyncPolicy.group(0)
    with pytest.raises(JournalUsageError):
        SyncPolicy.group(float("nan"))
    with pytest.raises(JournalUsageError):
        SyncPolicy(SyncMode.ALWAYS, 1.0)
    assert SyncPolicy("group", 0.5) == SyncPolicy.group(0.5)
    with pytest.raises(JournalUsageError, match="always, group, never"):
        SyncPolicy("sometimes")


def test_always_fsyncs_each_append_and_once_per_batch(
    tmp_path: Path, fdatasync_calls: list[int]
) -> None:
    with Journal.open(tmp_path, sync=SyncPolicy.always()) as journal:
        fdatasync_calls.clear()
        journal.append(1, b"a")
        journal.append(1, b"b")
        assert len(fdatasync_calls) == 2
        journal.append_many([(1, b"c")] * 50)
        assert len(fdatasync_calls) == 3
        assert journal.unsynced_bytes == 0


def test_group_fsyncs_only_when_the_owner_syncs(tmp_path: Path, fdatasync_calls: list[int]) -> None:
    with Journal.open(tmp_path, sync=SyncPolicy.group(0.002)) as journal:
        fdatasync_calls.clear()
        for _ in range(20):
            journal.append(1, b"x" * 10)
        assert fdatasync_calls == []
        assert journal.unsynced_bytes == 20 * (RECORD_OVERHEAD + 10)
        journal.sync()
        assert len(fdatasync_calls) == 1
        assert journal.unsynced_bytes == 0
        journal.sync()  # nothing new: no fsync
        assert len(fdatasync_calls) == 1


def test_rotation_makes_the_sealed_segment_durable(
    tmp_path: Path, fdatasync_calls: list[int]
) -> None:
    with Journal.open(tmp_path, sync=SyncPolicy.group(), segment_size=SMALL_SEGMENT) as journal:
        while len(journal.segments) == 1:
            journal.append(1, b"x" * 100)
        # The sealed segment was fsynced before the new one was created (header fsync too).
        assert len(fdatasync_calls) >= 2
        assert journal.unsynced_bytes == RECORD_OVERHEAD + 100


def test_segment_size_below_one_record_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JournalUsageError, match="too small"):
        Journal.open(tmp_path, segment_size=SEGMENT_HEADER_SIZE + RECORD_OVERHEAD - 1)


def test_never_does_not_fsync(tmp_path: Path, fdatasync_calls: list[int]) -> None:
    with Journal.open(tmp_path, sync=NEVER, segment_size=SMALL_SEGMENT) as journal:
        fill(journal, 100)
        journal.sync()
    assert fdatasync_calls == []
    assert len(replayed(tmp_path)) == 100


@pytest.mark.parametrize("policy", [SyncPolicy.always(), SyncPolicy.group()], ids=str)
def test_io_error_closes_the_journal_and_reopen_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: SyncPolicy
) -> None:
    journal = Journal.open(tmp_path, sync=policy)
    journal.append(1, b"durable")
    journal.sync()

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    def append_and_sync() -> None:
        journal.append(1, b"unknown outcome")
        journal.sync()  # under group the failure surfaces here

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="Input/output"):
        append_and_sync()
    assert journal.closed
    with pytest.raises(JournalClosedError, match="I/O error"):
        journal.append(1, b"refused")
    monkeypatch.undo()
    with Journal.open(tmp_path) as reopened:  # the failed journal released its lock
        records = list(reopened.replay())
    assert records[0] == Record(1, 1, b"durable")
    assert len(records) <= 2


# --- lifetime -------------------------------------------------------------------------------


def test_second_open_of_a_directory_is_refused(tmp_path: Path) -> None:
    with open_journal(tmp_path):
        with pytest.raises(JournalLockedError) as info:
            open_journal(tmp_path)
        assert isinstance(info.value, OSError)
        assert info.value.code == "LOCKED"
    with open_journal(tmp_path):
        pass


def test_closed_journal_refuses_use(tmp_path: Path) -> None:
    journal = open_journal(tmp_path)
    journal.append(1, b"x")
    records = journal.replay()
    journal.close()
    journal.close()  # idempotent
    for call in (
        lambda: journal.append(1, b"y"),
        lambda: journal.append_many([(1, b"y")]),
        lambda: journal.sync(),
        lambda: journal.replay(),
        lambda: journal.compact(lambda r: True),
        lambda: next(records),
    ):
        with pytest.raises(JournalClosedError):
            call()
    assert "closed" in repr(journal)


# --- torn tails -----------------------------------------------------------------------------


def build_two_segments(directory: Path, count: int = 12) -> list[Record]:
    with open_journal(directory, segment_size=400) as journal:
        written = fill(journal, count)
        assert len(journal.segments) >= 2
    return written


class Template(NamedTuple):
    """A small journal kept in memory, so hypothesis examples each get a fresh copy."""

    files: dict[str, bytes]
    records: list[Record]

    @property
    def last_name(self) -> str:
        return max(self.files)

    @property
    def last_record_at(self) -> int:
        return record_offsets(self.files[self.last_name])[-1]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    directory = tmp_path_factory.mktemp("template")
    records = build_two_segments(directory, 9)
    return Template({path.name: path.read_bytes() for path in segment_files(directory)}, records)


@contextlib.contextmanager
def journal_copy(template: Template) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for name, data in template.files.items():
            (directory / name).write_bytes(data)
        yield directory


def test_truncation_at_every_offset_of_the_last_segment(tmp_path: Path) -> None:
    original = tmp_path / "original"
    written = build_two_segments(original)
    last = segment_files(original)[-1]
    size = last.stat().st_size
    starts = record_offsets(last.read_bytes())
    first_seq_in_last = len(written) - len(starts) + 1
    for cut in range(size + 1):
        directory = tmp_path / f"cut-{cut}"
        shutil.copytree(original, directory)
        os.truncate(directory / last.name, cut)
        if cut < SEGMENT_HEADER_SIZE:
            # Segments are created whole, so a short header is damage, not a torn write.
            with pytest.raises(JournalCorruptError, match="segment"):
                open_journal(directory)
            continue
        complete = sum(
            1 for start, end in zip(starts, [*starts[1:], size], strict=True) if end <= cut
        )
        expected = written[: first_seq_in_last - 1 + complete]
        with open_journal(directory) as journal:
            assert list(journal.replay()) == expected, cut
            assert journal.last_seq == len(expected)
            torn = journal.recovery.truncated
            if cut in (*starts, size):
                assert torn is None
            else:
                assert torn is not None
                assert torn.offset == starts[complete]
                assert torn.length == cut - starts[complete]
            assert journal.append(9, b"after the crash") == len(expected) + 1
        after = replayed(directory)
        assert after == [*expected, Record(9, len(expected) + 1, b"after the crash")]
        shutil.rmtree(directory)


@pytest.mark.parametrize(
    "tail",
    [
        b"\x00" * 5000,
        random.Random(7).randbytes(3000),
        random.Random(8).randbytes(2 * 1024 * 1024),
        b"\xff" * 20,
    ],
    ids=["zeros", "garbage", "much-garbage", "ones"],
)
@pytest.mark.parametrize("policy", [NEVER, SyncPolicy.always()], ids=str)
def test_junk_after_the_last_record_is_a_torn_tail(
    tmp_path: Path, tail: bytes, policy: SyncPolicy
) -> None:
    written = build_two_segments(tmp_path)
    last = segment_files(tmp_path)[-1]
    size = last.stat().st_size
    with last.open("ab") as file:
        file.write(tail)
    with open_journal(tmp_path, sync=policy) as journal:
        assert list(journal.replay()) == written
        assert journal.recovery.truncated is not None
        assert journal.recovery.truncated.offset == size
        assert journal.recovery.truncated.length == len(tail)
    assert last.stat().st_size == size


@io_settings
@given(cut=st.integers(min_value=0), extra=st.binary(max_size=64))
def test_any_cut_plus_any_junk_keeps_exactly_the_complete_records(
    template: Template, cut: int, extra: bytes
) -> None:
    data = template.files[template.last_name]
    cut = SEGMENT_HEADER_SIZE + cut % (len(data) - SEGMENT_HEADER_SIZE + 1)
    starts = record_offsets(data)
    in_last = sum(
        1 for start, end in zip(starts, [*starts[1:], len(data)], strict=True) if end <= cut
    )
    with journal_copy(template) as directory:
        (directory / template.last_name).write_bytes(data[:cut] + extra)
        records = replayed(directory)
    assert records == template.records[: len(template.records) - len(starts) + in_last]


# --- corruption -----------------------------------------------------------------------------


def test_template_replays_what_was_written(template: Template) -> None:
    with journal_copy(template) as directory:
        assert replayed(directory) == template.records


@settings(io_settings, max_examples=300)
@given(data=st.data())
def test_a_flipped_bit_anywhere_is_detected_never_served(
    template: Template, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(template.files)), label="segment")
    bit = data.draw(st.integers(0, len(template.files[name]) * 8 - 1), label="bit")
    with journal_copy(template) as directory:
        flip_bit(directory / name, bit)
        if name == template.last_name and bit // 8 >= template.last_record_at:
            # Only the journal's very last record can be mistaken for a torn write: dropped.
            with open_journal(directory) as journal:
                assert list(journal.replay()) == template.records[:-1]
                assert journal.recovery.truncated is not None
                assert journal.recovery.truncated.offset == template.last_record_at
        else:
            with pytest.raises(JournalCorruptError) as info:
                open_journal(directory)
            assert info.value.path == directory / name
            assert info.value.code == "CORRUPT"


def test_a_flipped_bit_in_every_byte_is_detected(template: Template) -> None:
    for name, content in sorted(template.files.items()):
        for index in range(len(content)):
            in_last_record = name == template.last_name and index >= template.last_record_at
            with journal_copy(template) as directory:
                flip_bit(directory / name, index * 8 + index % 8)
                if in_last_record:
                    assert replayed(directory) == template.records[:-1]
                else:
                    with pytest.raises(JournalCorruptError):
                        open_journal(directory)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (encode_record(0, 3, b"type zero"), "record type 0"),
        (encode_record(1, 2, b"seq again"), "sequence number 2 after 2"),
    ],
    ids=["type-0", "seq-repeats"],
)
@pytest.mark.parametrize("where", ["end", "middle"])
def test_a_whole_record_with_impossible_content_is_never_a_torn_tail(
    tmp_path: Path, bad: bytes, message: str, where: str
) -> None:
    good = encode_record(1, 1, b"one") + encode_record(1, 2, b"two")
    after = encode_record(1, 3, b"three") if where == "middle" else b""
    segment = tmp_path / "journal-00000001.seg"
    segment.write_bytes(segment_header(1) + good + bad + after)
    with pytest.raises(JournalCorruptError, match=message) as info:
        open_journal(tmp_path)
    assert info.value.offset == SEGMENT_HEADER_SIZE + len(good)


def test_a_segment_shrinking_after_open_is_reported(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        fill(journal, 100)
        first = journal.segments[0].path
        os.truncate(first, first.stat().st_size - 5)
        with pytest.raises(JournalCorruptError, match="shorter"):
            list(journal.replay())


def test_salvaging_the_same_segment_twice_keeps_both_copies(tmp_path: Path) -> None:
    write_good_segment(tmp_path)
    bad = tmp_path / "journal-00000002.seg"
    kept: list[str] = []
    for _ in range(2):
        bad.write_bytes(b"junk")
        with open_journal(tmp_path, salvage=True) as journal:
            kept_as = journal.recovery.salvaged[0].kept_as
            assert kept_as is not None
            kept.append(kept_as.name)
    assert kept == ["journal-00000002.seg.corrupt", "journal-00000002.seg.corrupt.1"]


def test_flipped_bit_in_a_middle_record_names_file_and_offset(tmp_path: Path) -> None:
    build_two_segments(tmp_path)
    last = segment_files(tmp_path)[-1]
    offsets = record_offsets(last.read_bytes())
    assert len(offsets) >= 3
    flip_bit(last, (offsets[1] + 16) * 8)  # inside the second record's payload
    with pytest.raises(JournalCorruptError) as info:
        open_journal(tmp_path)
    assert info.value.path == last
    assert info.value.offset == offsets[1]
    assert "checksum" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(last) in str(info.value)
    # Nothing was modified by the refused open.
    with pytest.raises(JournalCorruptError):
        open_journal(tmp_path)


def test_flipped_length_in_a_middle_record_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    build_two_segments(tmp_path)
    last = segment_files(tmp_path)[-1]
    offsets = record_offsets(last.read_bytes())
    flip_bit(last, offsets[0] * 8 + 30)  # the length's top byte: it now runs past the file's end
    with pytest.raises(JournalCorruptError, match="incomplete record"):
        open_journal(tmp_path)


def test_salvage_keeps_records_before_the_damage(tmp_path: Path) -> None:
    written = build_two_segments(tmp_path, 30)
    files = segment_files(tmp_path)
    assert len(files) >= 4
    damaged = files[1]
    offsets = record_offsets(damaged.read_bytes())
    flip_bit(damaged, (offsets[1] + 16) * 8)
    kept = len(record_offsets(files[0].read_bytes())) + 1
    with open_journal(tmp_path, salvage=True) as journal:
        assert list(journal.replay()) == written[:kept]
        salvaged = journal.recovery.salvaged
        assert [d.path for d in salvaged] == files[1:]
        assert salvaged[0].offset == offsets[1]
        assert "checksum" in salvaged[0].reason
        assert all(d.kept_as is not None and d.kept_as.exists() for d in salvaged)
        assert journal.append(1, b"continues") == kept + 1
    assert segment_files(tmp_path) == files[:2]
    with open_journal(tmp_path) as journal:
        assert journal.recovery.clean
        assert list(journal.replay()) == [*written[:kept], Record(1, kept + 1, b"continues")]
        fill(journal, 40)  # rotation must not reuse the names of the segments set aside
    assert len(list(tmp_path.glob("*.corrupt"))) == len(salvaged)


# --- bad segment files ----------------------------------------------------------------------


def write_good_segment(directory: Path) -> list[Record]:
    with open_journal(directory) as journal:
        return fill(journal, 5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty segment file"),
        (segment_header(2)[:17], "segment header cut at 17 bytes"),
        (b"hello, this is not a journal segment at all", "bad magic"),
        (segment_header(2, magic=b"HAFJRNL\x01"), "bad magic"),
        (segment_header(2)[:-1] + bytes([segment_header(2)[-1] ^ 1]), "header checksum"),
        (segment_header(3, 5), "header says segment 3"),
        (segment_header(2, 1), "earlier segments reach 5"),
    ],
    ids=[
        "empty",
        "short-header",
        "garbage",
        "magic",
        "header-crc",
        "number",
        "prev-seq",
    ],
)
def test_bad_last_segment_is_a_clear_error_and_salvage_sets_it_aside(
    tmp_path: Path, content: bytes, message: str
) -> None:
    written = write_good_segment(tmp_path)
    bad = tmp_path / "journal-00000002.seg"
    bad.write_bytes(content)
    with pytest.raises(JournalCorruptError, match=message) as info:
        open_journal(tmp_path)
    assert info.value.path == bad
    with open_journal(tmp_path, salvage=True) as journal:
        assert list(journal.replay()) == written
        assert journal.recovery.salvaged[0].kept_as == tmp_path / "journal-00000002.seg.corrupt"
        assert journal.append(1, b"next") == 6
    assert not bad.exists()
    assert replayed(tmp_path)[-1] == Record(1, 6, b"next")


def test_bad_first_segment_with_salvage_leaves_an_empty_journal(tmp_path: Path) -> None:
    write_good_segment(tmp_path)
    first = tmp_path / "journal-00000001.seg"
    first.write_bytes(b"\x00" * 100)
    with pytest.raises(JournalCorruptError, match="bad magic"):
        open_journal(tmp_path)
    with open_journal(tmp_path, salvage=True) as journal:
        assert list(journal.replay()) == []
        assert journal.append(1, b"fresh") == 1
    assert [p.name for p in segment_files(tmp_path)] == ["journal-00000002.seg"]


def test_two_files_for_one_segment_number(tmp_path: Path) -> None:
    write_good_segment(tmp_path)
    shutil.copy(tmp_path / "journal-00000001.seg", tmp_path / "journal-000000001.seg")
    with pytest.raises(JournalCorruptError, match="same segment number"):
        open_journal(tmp_path)


def test_stray_temp_files_are_removed_and_other_files_ignored(tmp_path: Path) -> None:
    written = write_good_segment(tmp_path)
    (tmp_path / "journal-00000002.seg.tmp").write_bytes(b"half a segment")
    (tmp_path / "README").write_text("not ours")
    (tmp_path / "journal-00000009.seg.corrupt").write_bytes(b"set aside earlier")
    assert replayed(tmp_path) == written
    assert not (tmp_path / "journal-00000002.seg.tmp").exists()
    assert (tmp_path / "README").exists()


@io_settings
@given(content=st.binary(max_size=200), keep_header=st.booleans(), last=st.booleans())
def test_arbitrary_segment_content_never_raises_anything_unexpected(
    content: bytes, keep_header: bool, last: bool
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        good = [Record(1, 1, b"one"), Record(2, 2, b"two")]
        (directory / "journal-00000001.seg").write_bytes(
            segment_header(1) + b"".join(encode_record(r.type, r.seq, r.payload) for r in good)
        )
        if keep_header:
            content = segment_header(2, 2) + content
        (directory / "journal-00000002.seg").write_bytes(content)
        if not last:
            (directory / "journal-00000003.seg").write_bytes(segment_header(3, 2))
        try:
            with open_journal(directory) as journal:
                records = list(journal.replay())
                journal.append(1, b"still appends")
        except JournalCorruptError:
            with open_journal(directory, salvage=True) as journal:
                records = list(journal.replay())
                journal.append(1, b"still appends")
        assert records[:2] == good
        assert all(a.seq < b.seq for a, b in itertools.pairwise(records))


# --- replication ----------------------------------------------------------------------------


def test_backup_stores_live_records_with_the_same_sequence_numbers(tmp_path: Path) -> None:
    with open_journal(tmp_path / "live") as live, open_journal(tmp_path / "backup") as backup:
        fill(live, 50)
        backup.append_records(live.records_after(backup.last_seq))  # initial synchronization
        assert list(backup.replay()) == list(live.replay())
        fill(live, 25)  # streaming: the backup catches up from its last seq
        assert backup.append_records(live.records_after(backup.last_seq)) == 75
        assert list(backup.replay()) == list(live.replay())
    with open_journal(tmp_path / "backup") as backup:
        assert backup.last_seq == 75
        assert backup.append(1, b"taken over") == 76  # the backup becoming live continues


def test_out_of_order_sequence_numbers_are_refused_whole(tmp_path: Path) -> None:
    with open_journal(tmp_path) as backup:
        backup.append_records([Record(1, 10, b"a"), Record(1, 11, b"b")])
        for batch in (
            [Record(1, 11, b"again")],
            [Record(1, 5, b"older")],
            [Record(1, 12, b"ok"), Record(1, 12, b"duplicate")],
            [Record(1, 13, b"ok"), Record(1, 2**64, b"too big")],
        ):
            with pytest.raises(JournalSequenceError) as info:
                backup.append_records(batch)
            assert isinstance(info.value, ValueError)
            assert backup.last_seq == 11
        assert [r.seq for r in backup.replay()] == [10, 11]
        assert backup.append_records([Record(2, 20, b"gap is fine")]) == 20
    assert [r.seq for r in replayed(tmp_path)] == [10, 11, 20]


def test_records_after_sees_appends_made_while_iterating(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 10)
        seen: list[Record] = []
        for record in journal.records_after(5):
            seen.append(record)
            if record.seq < 40:
                journal.append(1, sample_payload(record.seq, 100))  # rotates segments too
        assert seen[:5] == written[5:]
        assert [r.seq for r in seen] == list(range(6, journal.last_seq + 1))
        assert list(journal.records_after(journal.last_seq)) == []
        with pytest.raises(JournalUsageError):
            journal.records_after(-1)


# --- compaction -----------------------------------------------------------------------------


def test_compaction_deletes_only_dead_segments(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 300)
        segments = journal.segments
        dead_segment = {info.number for info in segments[1:-1:2]}  # every other sealed one
        owner = {
            r.seq: info.number
            for info in segments
            for r in written
            if info.first_seq <= r.seq <= info.last_seq
        }

        def is_live(record: Record) -> bool:
            return owner[record.seq] not in dead_segment

        report = journal.compact(is_live)
        assert set(report.deleted) == dead_segment
        assert report.rewritten == ()
        assert report.reclaimed_bytes == sum(i.size for i in segments if i.number in dead_segment)
        survivors = [r for r in written if is_live(r)]
        assert list(journal.replay()) == survivors
        assert journal.append(1, b"after compaction") == 301
    with open_journal(tmp_path) as journal:
        assert list(journal.replay()) == [*survivors, Record(1, 301, b"after compaction")]


def test_compaction_never_deletes_a_live_record_or_the_active_segment(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 200)
        live = {r.seq for r in written if r.seq % 17 == 0}
        journal.compact(lambda r: r.seq in live)
        remaining = list(journal.replay())
        assert live <= {r.seq for r in remaining}
        assert remaining == [r for r in written if r.seq in {x.seq for x in remaining}]
        active = journal.segments[-1]
        journal.compact(lambda r: False)
        assert journal.segments == (active,)
    with open_journal(tmp_path) as journal:
        assert journal.last_seq == 200
        assert journal.append(1, b"x") == 201


def test_rewrite_keeps_live_records_with_their_sequence_numbers(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 200)
        live = {r.seq for r in written if r.seq % 5 == 0}
        sealed = journal.segments[:-1]
        report = journal.compact(lambda r: r.seq in live, rewrite_below=1.0)
        assert report.rewritten
        assert set(report.rewritten) | set(report.deleted) == {i.number for i in sealed}
        active_seqs = range(journal.segments[-1].first_seq, journal.last_seq + 1)
        expected = [r for r in written if r.seq in live or r.seq in active_seqs]
        assert list(journal.replay()) == expected
        assert list(tmp_path.glob("*.tmp")) == []
    with open_journal(tmp_path) as journal:
        assert journal.recovery.clean
        assert list(journal.replay()) == expected
        assert [r.seq for r in journal.records_after(100)] == [
            r.seq for r in expected if r.seq > 100
        ]
        assert journal.append(1, b"x") == 201


def test_durable_compaction_survives_reopen(tmp_path: Path) -> None:
    with Journal.open(tmp_path, sync=SyncPolicy.group(), segment_size=SMALL_SEGMENT) as journal:
        written = fill(journal, 60)
        journal.sync()
        report = journal.compact(lambda r: r.seq % 4 == 0 or r.seq > 50, rewrite_below=0.9)
        assert report.deleted or report.rewritten
        expected = list(journal.replay())
    assert {r.seq for r in written if r.seq % 4 == 0} <= {r.seq for r in expected}
    with Journal.open(tmp_path, sync=SyncPolicy.group(), segment_size=SMALL_SEGMENT) as journal:
        assert journal.recovery.clean
        assert list(journal.replay()) == expected


def test_compaction_while_a_reader_is_behind(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        written = fill(journal, 200)
        reader = journal.records_after(0)
        first = [next(reader) for _ in range(3)]
        journal.compact(lambda r: r.seq <= 3 or r.seq > 150)
        rest = list(reader)
        assert first == written[:3]
        assert {r.seq for r in written if r.seq > 150} <= {r.seq for r in rest}
        assert all(r == written[r.seq - 1] for r in rest)


def test_compaction_argument_is_checked(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal, pytest.raises(JournalUsageError):
        journal.compact(lambda r: True, rewrite_below=1.5)


def test_damage_found_after_open_is_raised_not_served(tmp_path: Path) -> None:
    with open_journal(tmp_path) as journal:
        fill(journal, 100)
        first = journal.segments[0].path
        flip_bit(first, (SEGMENT_HEADER_SIZE + 20) * 8)
        with pytest.raises(JournalCorruptError):
            list(journal.replay())
        with pytest.raises(JournalCorruptError):
            journal.compact(lambda r: False)


# --- a model-based test ---------------------------------------------------------------------


class JournalMachine(RuleBasedStateMachine):
    """Appends, reopens and compactions against a list model of what must be there."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = tempfile.TemporaryDirectory()
        self.directory = Path(self.scratch.name)
        self.journal = open_journal(self.directory, segment_size=600)
        self.model: list[Record] = []
        self.dead: set[int] = set()

    @rule(rtype=record_types, payload=payloads)
    def append(self, rtype: int, payload: bytes) -> None:
        seq = self.journal.append(rtype, payload)
        self.model.append(Record(rtype, seq, payload))

    @rule(batch=st.lists(st.tuples(record_types, payloads), max_size=8))
    def append_many(self, batch: list[tuple[int, bytes]]) -> None:
        first = self.journal.last_seq + 1
        assert self.journal.append_many(batch) == first + len(batch) - 1
        self.model += [Record(t, first + i, p) for i, (t, p) in enumerate(batch)]

    @rule()
    def reopen(self) -> None:
        self.journal.close()
        self.journal = open_journal(self.directory, segment_size=600)
        assert self.journal.recovery.clean

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        seqs = [r.seq for r in self.model]
        self.dead |= set(data.draw(st.lists(st.sampled_from(seqs), max_size=len(seqs))))

    @rule(rewrite=st.sampled_from([0.0, 0.5, 1.0]))
    def compact(self, rewrite: float) -> None:
        self.journal.compact(lambda r: r.seq not in self.dead, rewrite_below=rewrite)
        remaining = {r.seq for r in self.journal.replay()}
        assert {r.seq for r in self.model if r.seq not in self.dead} <= remaining
        self.model = [r for r in self.model if r.seq in remaining]  # the invariant checks it

    @rule(data=st.data())
    def crash_mid_write(self, data: st.DataObject) -> None:
        """Cut the last segment anywhere after its header, as a crash during a write would."""
        last = self.journal.segments[-1].path
        self.journal.close()
        content = last.read_bytes()
        cut = data.draw(st.integers(SEGMENT_HEADER_SIZE, len(content)), label="cut")
        os.truncate(last, cut)
        lost = set()
        for offset in record_offsets(content):
            length, _, seq = struct.unpack_from("<IBQ", content, offset)
            if offset + RECORD_OVERHEAD + length > cut:
                lost.add(seq)
        self.model = [r for r in self.model if r.seq not in lost]
        self.journal = open_journal(self.directory, segment_size=600)
        boundaries = {SEGMENT_HEADER_SIZE, len(content), *record_offsets(content)}
        assert (self.journal.recovery.truncated is None) == (cut in boundaries)

    @invariant()
    def replay_matches_model(self) -> None:
        assert list(self.journal.replay()) == self.model
        assert self.journal.last_seq >= (self.model[-1].seq if self.model else 0)

    def teardown(self) -> None:
        self.journal.close()
        self.scratch.cleanup()


TestJournalMachine = JournalMachine.TestCase
TestJournalMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# --- errors ---------------------------------------------------------------------------------


def test_every_error_is_a_journal_error_with_a_code() -> None:
    for cls in (
        JournalCorruptError,
        JournalUsageError,
        JournalSequenceError,
        JournalClosedError,
        JournalLockedError,
    ):
        assert issubclass(cls, JournalError)
        assert cls.code != JournalError.code
    assert issubclass(JournalSequenceError, ValueError)
    assert issubclass(JournalLockedError, OSError)


# --- formats --------------------------------------------------------------------------------


def write_segment(directory: Path, number: int, header: bytes, records: list[Record]) -> Path:
    path = directory / f"journal-{number:08d}.seg"
    path.write_bytes(header + b"".join(encode_record(r.type, r.seq, r.payload) for r in records))
    return path


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_new_segments_say_their_format_and_the_owners_content_format(tmp_path: Path) -> None:
    with Journal.open(tmp_path, segment_size=SMALL_SEGMENT, content_format=7) as journal:
        fill(journal, 40)
        assert journal.content_format == 7
    heads = [path.read_bytes()[:SEGMENT_HEADER_SIZE] for path in segment_files(tmp_path)]
    assert len(heads) > 1
    assert all(struct.unpack_from("<HH", head, 8) == (2, 7) for head in heads)


@pytest.mark.parametrize(
    ("header", "found"),
    [
        (segment_header(2, version=9), "journal format 9, content format 0"),
        (segment_header(2, content_format=8), "journal format 2, content format 8"),
        (segment_header(2, version=1), "journal format 1 (unversioned"),
    ],
    ids=["format-version", "content-format", "unversioned"],
)
def test_a_segment_of_another_format_is_refused_by_name_and_never_salvaged(
    tmp_path: Path, header: bytes, found: str
) -> None:
    """Not damage: the file and both formats are named, and salvage sets nothing aside."""
    with Journal.open(tmp_path, segment_size=SMALL_SEGMENT, content_format=7) as journal:
        fill(journal, 5)
    other = write_segment(tmp_path, 2, header, [Record(1, 6, b"other code")])
    before = files_of(tmp_path)
    for salvage in (False, True):
        with pytest.raises(JournalFormatError) as info:
            Journal.open(tmp_path, content_format=7, salvage=salvage)
        assert info.value.path == other
        message = str(info.value)
        assert str(other) in message and found in message
        assert "reads journal format 2, content format 7" in message
    with pytest.raises(JournalFormatError, match=found.replace("(", r"\(")):
        check_format(tmp_path, 7)
    assert files_of(tmp_path) == before, "a refused journal was changed"


def test_unversioned_segments_are_read_only_when_the_owner_says_so_and_never_extended(
    tmp_path: Path,
) -> None:
    """Segments written before content formats (journal format 1): the owner that reads them
    gets their records; appends go into a new segment of the current format, and the old file
    keeps its bytes. An owner that does not read them is refused, by file name."""
    old = [Record(1, seq, sample_payload(seq)) for seq in range(1, 6)]
    first = write_segment(tmp_path, 1, segment_header(1, version=1), old)
    old_bytes = first.read_bytes()
    with pytest.raises(JournalFormatError, match="unversioned") as info:
        Journal.open(tmp_path, content_format=7)
    assert info.value.path == first
    check_format(tmp_path, 7, reads_unversioned=True)
    with Journal.open(tmp_path, content_format=7, reads_unversioned=True) as journal:
        assert list(journal.replay()) == old
        assert journal.append(2, b"new") == 6
        assert len(journal.segments) == 2
    assert first.read_bytes() == old_bytes
    second = segment_files(tmp_path)[1]
    assert struct.unpack_from("<HH", second.read_bytes(), 8) == (2, 7)
    with Journal.open(tmp_path, content_format=7, reads_unversioned=True) as journal:
        assert list(journal.replay()) == [*old, Record(2, 6, b"new")]
        assert len(journal.segments) == 2  # the new segment is appended to again


def test_a_content_format_must_fit_its_field(tmp_path: Path) -> None:
    for bad in (-1, 65536):
        with pytest.raises(JournalUsageError, match="content_format"):
            Journal.open(tmp_path, content_format=bad)
