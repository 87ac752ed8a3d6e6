"""The kept duplicate window (core/dedup.py): the journal replays to the window it recorded,
a torn write never loses the ids before it, and the journal stays bounded."""

from __future__ import annotations

import json
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hafailover.core.dedup import DuplicateWindow, encode_record, replay


class MemoryJournal:
    """A journal in memory: what the driver's file would hold."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data
        self.rewrites = 0

    def append(self, data: bytes) -> None:
        self.data += data

    def rewrite(self, data: bytes) -> None:
        self.data = data
        self.rewrites += 1


ids = st.text(min_size=1, max_size=12)


def test_a_window_comes_back_from_its_journal() -> None:
    journal = MemoryJournal()
    window = DuplicateWindow(3, journal=journal)
    window.remember(["a", "b", "c", "d"])  # "a" falls out
    window.forget("c")
    assert replay(journal.data, 3) == (("b", "d"), 0)
    again = DuplicateWindow(3, journal=MemoryJournal(), kept=replay(journal.data, 3)[0])
    assert again.ids() == ("b", "d")


@given(st.lists(ids, min_size=2, max_size=20), st.data())
def test_a_torn_last_write_loses_only_that_record(written: list[str], data: st.DataObject) -> None:
    journal = MemoryJournal()
    window = DuplicateWindow(1000, journal=journal)
    window.remember(written[:-1])
    before = window.ids()
    last = encode_record("+", written[-1])
    cut = data.draw(st.integers(0, len(last) - 1), label="bytes of the last record written")
    kept, skipped = replay(journal.data + last[:cut], 1000)
    assert kept == before
    assert skipped == (1 if cut else 0)


def test_a_damaged_record_is_skipped_and_the_others_kept() -> None:
    records = [encode_record("+", i) for i in ("a", "b", "c")]
    damaged = records[1].replace(b"b", b"x")
    assert replay(records[0] + damaged + records[2], 10) == (("a", "c"), 1)
    assert replay(b"not a record\n" + records[0], 10) == (("a",), 1)


def test_ids_with_spaces_newlines_and_quotes_survive() -> None:
    journal = MemoryJournal()
    odd = ["a b", "line\nbreak", 'quote"d', "ünï"]
    DuplicateWindow(10, journal=journal).remember(odd)
    assert replay(journal.data, 10) == (tuple(odd), 0)


def test_a_journal_read_back_is_rewritten_before_anything_is_appended() -> None:
    """Nothing is appended behind a torn record: opening compacts first."""
    torn = encode_record("+", "a") + encode_record("+", "b")[:5]
    journal = MemoryJournal(torn)
    window = DuplicateWindow(10, journal=journal, kept=replay(torn, 10)[0])
    window.remember(["c"])
    assert journal.rewrites == 1
    assert replay(journal.data, 10) == (("a", "c"), 0)


def _record(body: bytes) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(body), body)


def test_the_journal_is_compacted_once_it_holds_more_than_size_records_beyond_the_window() -> None:
    """Appends until the records beyond the window's ids exceed ``size``; a forget is one
    record, as a remember is."""
    journal = MemoryJournal()
    window = DuplicateWindow(2, journal=journal)
    assert journal.rewrites == 1  # the snapshot a kept window starts from
    window.remember(["a", "b", "c", "d"])  # 4 records, 2 ids: 2 beyond, not more
    assert journal.rewrites == 1
    window.remember(["e"])  # 5 records, 2 ids: 3 beyond
    assert journal.rewrites == 2
    assert replay(journal.data, 2) == (("d", "e"), 0)

    journal = MemoryJournal()
    window = DuplicateWindow(2, journal=journal)
    window.remember(["a", "b"])
    window.forget("a")  # 3 records, 1 id: 2 beyond
    assert journal.rewrites == 1
    window.forget("b")  # 4 records, no id: 4 beyond
    assert journal.rewrites == 2
    assert journal.data == b""


def test_a_window_without_a_journal_never_compacts() -> None:
    window = DuplicateWindow(2)
    window.remember(["a", "b", "c"])
    assert not window.compaction_due


def test_any_string_id_is_written_as_ascii_and_read_back() -> None:
    """An id that is not valid UTF-8 text (a lone surrogate) is escaped, not refused: the
    journal is ASCII whatever the ids."""
    journal = MemoryJournal()
    odd = ["ünï", "\ud800", "\u2028"]
    DuplicateWindow(10, journal=journal).remember(odd)
    assert journal.data.isascii()
    assert replay(journal.data, 10) == (tuple(odd), 0)


def test_a_record_whose_id_is_not_a_string_is_skipped() -> None:
    """A record with a good checksum but not of the journal's shape is damage, not an id."""
    good = encode_record("+", "a")
    for body in (["+", 5], ["+", None], ["?", "b"], ["+"]):
        record = _record(json.dumps(body).encode())
        assert replay(good + record, 10) == (("a",), 1)


def test_every_damaged_record_is_counted() -> None:
    good = encode_record("+", "a")
    assert replay(b"junk\n" + good + b"more junk\n" + b"00000000 []\n", 10) == (("a",), 3)


class JournalMachine(RuleBasedStateMachine):
    """Whatever the window does, its journal replays to the same window, and holds no more
    than twice the window's size in records (plus the one that triggers a compaction)."""

    SIZE = 5

    def __init__(self) -> None:
        super().__init__()
        self.journal = MemoryJournal()
        self.window = DuplicateWindow(self.SIZE, journal=self.journal)

    @rule(message_ids=st.lists(st.sampled_from("abcdefghij"), max_size=4))
    def remember(self, message_ids: list[str]) -> None:
        self.window.remember(message_ids)

    @rule(message_id=st.sampled_from("abcdefghij"))
    def forget(self, message_id: str) -> None:
        self.window.forget(message_id)

    @invariant()
    def replays_to_the_window(self) -> None:
        assert replay(self.journal.data, self.SIZE) == (self.window.ids(), 0)

    @invariant()
    def stays_bounded(self) -> None:
        assert self.journal.data.count(b"\n") <= 2 * self.SIZE + 4


JournalMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestJournalMachine = JournalMachine.TestCase
