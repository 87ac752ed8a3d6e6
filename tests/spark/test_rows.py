"""Record batches into messages, and the duplicate id each row gets (no Spark session)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from hafailover.destination import Destination
from hafailover.errors import ConfigurationError
from hafailover.spark import BatchReport, PartitionResult, SinkCommit, SinkOptions
from hafailover.spark._report import log_report
from hafailover.spark._rows import ColumnPlan, IdScheme, key_text, row_content, to_messages

pytestmark = [pytest.mark.spark]

URL = "failover:(stomp://127.0.0.1:61613,stomp://127.0.0.1:61614)"


def options(**given: str) -> SinkOptions:
    return SinkOptions.parse({"url": URL, "destination": "queue://orders", **given})


def test_ids_by_position_and_by_key() -> None:
    ids = IdScheme.for_batch(options(positional_ids="true"), "orders", "7", partition=3)
    assert ids.positional and ids.by_position(12) == "orders:7:p3:12"
    assert ids.by_key("A-1") == "orders:7:k:A-1"
    assert ids.by_key(42) == "orders:7:k:42"
    assert ids.by_key(b"\x01\xff") == "orders:7:k:01ff"


def test_at_least_once_derives_no_id() -> None:
    ids = IdScheme.for_batch(options(delivery_guarantee="at_least_once"), "s", "7", 0)
    assert ids.by_position(0) is None and ids.by_key("k") is None


def test_long_or_unprintable_keys_become_a_digest() -> None:
    assert key_text("x" * 128) == "x" * 128
    assert key_text("x" * 129).startswith("sha256:")
    assert key_text("a\nb").startswith("sha256:")
    assert key_text("x" * 129) != key_text("x" * 130)


def test_rows_become_messages_with_headers_and_ids() -> None:
    batch = pa.record_batch(
        {
            "body": pa.array([b"a", b"b"], pa.binary()),
            "headers": pa.array(
                [[("n", 1), ("gone", None)], None], pa.map_(pa.string(), pa.int64())
            ),
        }
    )
    ids = IdScheme.for_batch(options(positional_ids="true"), "s", "0", 1)
    plan = ColumnPlan(body="body", headers="headers")
    messages = to_messages(batch, plan, options(positional_ids="true"), ids, 10)
    assert [(m.body, m.properties, m.message_id) for m, _ in messages] == [
        (b"a", {"n": 1}, "s:0:p1:10"),
        (b"b", {}, "s:0:p1:11"),
    ]
    assert all(d == Destination.queue("orders") for _, d in messages)


def test_ids_by_content_number_identical_rows() -> None:
    batch = pa.record_batch({"body": ["a", "b", "a"]})
    ids = IdScheme.for_batch(options(), "s", "0", 1)
    first = [m.message_id for m, _ in to_messages(batch, ColumnPlan("body"), options(), ids, 0)]
    assert all(i is not None and i.startswith("s:0:c1:") for i in first)
    assert [i.rsplit(":", 1)[1] for i in first if i] == ["0", "0", "1"]
    assert first[0] and first[2] and first[0].rsplit(":", 1)[0] == first[2].rsplit(":", 1)[0]
    # The count runs across the record batches of one partition.
    more = to_messages(pa.record_batch({"body": ["a"]}), ColumnPlan("body"), options(), ids, 3)
    assert more[0][0].message_id == first[0].rsplit(":", 1)[0] + ":2"


def test_row_content_tells_apart_what_makes_another_message() -> None:
    queue, topic = Destination.queue("q"), Destination.topic("q")
    same = row_content("a", {"x": 1, "y": "z"}, queue)
    assert same == row_content("a", {"y": "z", "x": 1}, queue)  # map order means nothing
    others = [
        row_content(b"a", {"x": 1, "y": "z"}, queue),
        row_content("a", {"x": 1, "y": "z"}, topic),
        row_content("a", {"x": 1.0, "y": "z"}, queue),
        row_content("a", {"x": True, "y": "z"}, queue),
        row_content("a", {"x": "1", "y": "z"}, queue),
        row_content("a", {"x": 1}, queue),
        row_content("a", {"x": 1, "yz": ""}, queue),
        row_content("ax", {"x": 1, "y": "z"}, queue),
    ]
    assert len({same, *others}) == 1 + len(others)
    assert row_content("", {"n": float("nan")}, queue) == row_content("", {"n": -math.nan}, queue)


# A partition's rows: few distinct values, so identical rows are common. Header values are
# strings here (an Arrow map has one value type); row_content's typing is tested above.
Row = tuple[str, dict[str, str] | None, str | None]
rows = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "a\x00", "ü"]),
        st.none()
        | st.dictionaries(st.sampled_from(["h", "k"]), st.sampled_from(["", "1", "x"]), max_size=2),
        st.none() | st.sampled_from(["queue://x", "/topic/x"]),
    ),
    min_size=1,
    max_size=12,
)
ROW_PLAN = ColumnPlan(body="body", headers="headers", destination="destination")


def send_partition(
    partition: list[Row],
    sink: SinkOptions,
    cut: int,
) -> list[tuple[str, tuple[str, tuple[tuple[str, object], ...], str]]]:
    """The (id, message) pairs a task sends for ``partition``, in two record batches."""
    ids = IdScheme.for_batch(sink, "s", "3", 0)
    sent = []
    for start, end in ((0, cut), (cut, len(partition))):
        chunk = partition[start:end]
        batch = pa.record_batch(
            {
                "body": pa.array([r[0] for r in chunk], pa.string()),
                "headers": pa.array(
                    [None if r[1] is None else list(r[1].items()) for r in chunk],
                    pa.map_(pa.string(), pa.string()),
                ),
                "destination": pa.array([r[2] for r in chunk], pa.string()),
            }
        )
        for message, target in to_messages(batch, ROW_PLAN, sink, ids, start):
            assert message.message_id is not None
            what = (str(message.body), tuple(sorted(message.properties.items())), str(target))
            sent.append((message.message_id, what))
    return sent


@given(rows, st.data())
def test_any_order_of_a_partition_gives_each_row_the_same_id(
    partition: list[Row], data: st.DataObject
) -> None:
    """A retry that sees the partition in another order (and cut into other record batches)
    sends every message under the id it had before: the same id set, and each id names the
    same message."""
    again = data.draw(st.permutations(partition))
    first = send_partition(partition, options(), data.draw(st.integers(0, len(partition))))
    second = send_partition(again, options(), data.draw(st.integers(0, len(partition))))
    assert len({i for i, _ in first}) == len(partition)
    assert dict(first) == dict(second)


@given(rows, st.data())
def test_a_retry_in_another_order_loses_and_doubles_nothing(
    partition: list[Row], data: st.DataObject
) -> None:
    """Attempt 0 sends a prefix and fails; the retry sends all in another order; the broker
    keeps the first message of each id: exactly the partition's messages, each once."""
    failed_after = data.draw(st.integers(0, len(partition)))
    attempt0 = send_partition(partition, options(), 0)[:failed_after]
    attempt1 = send_partition(data.draw(st.permutations(partition)), options(), 0)
    kept: dict[str, object] = {}
    for message_id, what in attempt0 + attempt1:
        kept.setdefault(message_id, what)
    assert sorted(map(str, kept.values())) == sorted(str(what) for _, what in attempt1)


def test_positional_ids_lose_a_row_when_a_retry_sees_another_order() -> None:
    """The issue's case: attempt 0 sent A and failed; the retry saw B, A, C. Under positional
    ids the broker keeps A, A, C; under content ids A, B, C."""
    original: list[Row] = [("A", None, None), ("B", None, None), ("C", None, None)]
    retry = [original[1], original[0], original[2]]
    for scheme, kept_bodies in (
        (options(positional_ids="true"), ["A", "A", "C"]),
        (options(), ["A", "B", "C"]),
    ):
        kept: dict[str, str] = {}
        for message_id, what in send_partition(original, scheme, 0)[:1] + send_partition(
            retry, scheme, 0
        ):
            kept.setdefault(message_id, what[0])
        assert sorted(kept.values()) == kept_bodies


def test_destination_column_overrides_per_row() -> None:
    batch = pa.record_batch({"body": ["a", "b"], "destination": ["/topic/t", None]})
    plan = ColumnPlan(body="body", destination="destination")
    messages = to_messages(batch, plan, options(), IdScheme(None, 0), 0)
    assert [str(d) for _, d in messages] == ["topic://t", "queue://orders"]


@pytest.mark.parametrize(
    ("columns", "plan", "message"),
    [
        ({"body": ["a", None]}, ColumnPlan(body="body"), "row 6 of partition 0 has a null body"),
        (
            {"body": ["a", "b"], "key": ["k", None]},
            ColumnPlan(body="body", key="key"),
            "row 6 of partition 0 has a null key",
        ),
        (
            {"body": ["a", "b"], "destination": ["queue://x", "ftp://y"]},
            ColumnPlan(body="body", destination="destination"),
            "row 6 of partition 0: unknown destination form",
        ),
    ],
)
def test_a_bad_row_stops_the_whole_record_batch(
    columns: dict[str, list[object]], plan: ColumnPlan, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        to_messages(pa.record_batch(columns), plan, options(), IdScheme(None, 0), 5)


def test_null_destination_without_a_default() -> None:
    given = SinkOptions.parse({"url": URL})
    batch = pa.record_batch({"body": ["a"], "destination": pa.array([None], pa.string())})
    with pytest.raises(ConfigurationError, match="null destination"):
        to_messages(
            batch, ColumnPlan(body="body", destination="destination"), given, IdScheme(None, 0), 0
        )


def result(partition: int, attempt: int = 0, **counts: int) -> PartitionResult:
    figures = {
        "rows": 10,
        "sent": 10,
        "confirmed": 10,
        "failovers": 0,
        "replayed": 0,
        "resent": 0,
        "in_doubt": 0,
    } | counts
    return PartitionResult(
        sink_id="s",
        batch_id="4",
        partition=partition,
        attempt=attempt,
        seconds=0.1,
        worker=1,
        **figures,
    )


def test_a_batch_report_adds_up_its_commits() -> None:
    commits = [SinkCommit(result(0)), SinkCommit(result(1, attempt=1, failovers=1, resent=3)), None]
    report = BatchReport.from_commits(commits, committed=False, batch_id="4")
    assert (report.tasks, report.failed_tasks, report.retried_tasks) == (3, 1, 1)
    assert (report.rows, report.failovers, report.resent, report.sink_id) == (20, 1, 3, "s")
    assert report.summary().startswith("hafailover sink s batch 4 ABORTED: 20 rows from 2/3")


def test_the_driver_logs_and_records_every_batch(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    commit_log = tmp_path / "commits.jsonl"
    report = BatchReport.from_commits([SinkCommit(result(0))], committed=True)
    with caplog.at_level(logging.INFO, logger="hafailover.spark"):
        log_report(report, str(commit_log), in_worker=False)
        log_report(report, str(commit_log), in_worker=False)
    assert [r.getMessage() for r in caplog.records] == [report.summary()] * 2
    assert "sent 10, confirmed 10, failovers 0, replayed 0, resent 0, in doubt 0" in (
        caplog.records[0].getMessage()
    )
    lines = commit_log.read_text().splitlines()
    assert len(lines) == 2 and '"batch_id": "4"' in lines[0]


def test_a_batch_written_to_a_broker_without_duplicate_detection_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a task saw at run time: its broker does not drop a copy by id, so a retry of its
    rows stores them twice; the driver's summary says so, as a warning."""
    without = PartitionResult(**{**result(1).__dict__, "duplicate_detection": False})
    report = BatchReport.from_commits([SinkCommit(result(0)), SinkCommit(without)], committed=True)
    assert report.without_duplicate_detection == 1
    detected = BatchReport.from_commits([SinkCommit(result(0))], committed=True)
    with caplog.at_level(logging.INFO, logger="hafailover.spark"):
        log_report(report, None, in_worker=False)
        log_report(detected, None, in_worker=False)
    first, second = caplog.records
    assert first.levelno == logging.WARNING
    assert "1 tasks wrote to a broker without duplicate detection" in first.getMessage()
    assert second.levelno == logging.INFO and "duplicate detection" not in second.getMessage()
