"""Record batches into messages, and the duplicate id each row gets (no Spark session)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

import pyarrow as pa

from hafailover.destination import Destination
from hafailover.errors import ConfigurationError
from hafailover.spark import BatchReport, PartitionResult, SinkCommit, SinkOptions
from hafailover.spark._report import log_report
from hafailover.spark._rows import ColumnPlan, IdScheme, key_text, to_messages

pytestmark = [pytest.mark.spark]

URL = "failover:(stomp://127.0.0.1:61613,stomp://127.0.0.1:61614)"


def options(**given: str) -> SinkOptions:
    return SinkOptions.parse({"url": URL, "destination": "queue://orders", **given})


def test_ids_by_position_and_by_key() -> None:
    ids = IdScheme.for_batch(options(), "orders", "7", partition=3)
    assert ids.by_position(12) == "orders:7:p3:12"
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
    ids = IdScheme.for_batch(options(), "s", "0", 1)
    messages = to_messages(batch, ColumnPlan(body="body", headers="headers"), options(), ids, 10)
    assert [(m.body, m.properties, m.message_id) for m, _ in messages] == [
        (b"a", {"n": 1}, "s:0:p1:10"),
        (b"b", {}, "s:0:p1:11"),
    ]
    assert all(d == Destination.queue("orders") for _, d in messages)


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
