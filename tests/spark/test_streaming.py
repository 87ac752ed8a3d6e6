"""df.writeStream.format("hafailover") into the pair: a SIGKILLed live and a restarted query.

The input is a directory of JSON files read one file per micro-batch, so batches are
deterministic and a re-run batch holds the same rows in the same partition and order (the
condition for position-based duplicate ids, which these tests use: no key column).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention
from pyspark.sql.types import StringType

from hafailover.spark import ForeachBatchSink
from reference_broker.pair import BrokerPair
from tests.spark.broker import PASSWORD, USER, consume_all
from tests.spark.udfs import slow_and_marked_json

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.timeout(300)]

MIDWAY = 2_500  # of a batch's 5,000 rows


def write_files(directory: Path, files: int, rows: int) -> int:
    directory.mkdir(parents=True)
    for number in range(files):
        lines = (
            json.dumps({"id": number * rows + i, "name": f"item-{number * rows + i}"})
            for i in range(rows)
        )
        (directory / f"part-{number:03d}.json").write_text("\n".join(lines) + "\n")
    return files * rows


def rows_of(spark: Any, directory: Path, marks: Path | None = None) -> Any:
    """One JSON body per row; with ``marks``, through a UDF that takes 0.3 ms a row and
    marks each task midway (tests/spark/udfs.py)."""
    rows = (
        spark.readStream.schema("id long, name string")
        .option("maxFilesPerTrigger", 1)
        .json(str(directory))
    )
    if marks is None:
        return rows.select(F.to_json(F.struct("id", "name")).alias("body"))
    marks.mkdir()
    where = str(marks)
    slow = F.udf(
        lambda row_id, name: slow_and_marked_json(row_id, name, 0.0003, MIDWAY, where),
        StringType(),
        useArrow=False,  # pandas is not among the test dependencies: say so, not warn
    )
    return rows.select(slow("id", "name").alias("body"))


def start(df: Any, pair: BrokerPair, destination: str, checkpoint: Path, commit_log: Path) -> Any:
    return (
        df.writeStream.format("hafailover")
        .option("url", pair.stomp_url)
        .option("user", USER)
        .option("password", PASSWORD)
        .option("destination", destination)
        .option("commit_log", str(commit_log))
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def forget_commit(checkpoint: Path, batch: int) -> None:
    """As if the driver died after the sink wrote ``batch`` but before Spark recorded it:
    the restarted query runs the batch again (its offsets are in the checkpoint)."""
    (checkpoint / "commits" / str(batch)).unlink()
    (checkpoint / "commits" / f".{batch}.crc").unlink(missing_ok=True)


def reports(commit_log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in commit_log.read_text().splitlines()]


def ids_received(pair: BrokerPair, destination: str, expected: int) -> Counter[int]:
    messages = consume_all(pair, destination, expected=expected)
    return Counter(json.loads(m.body)["id"] for m in messages)


@pytest.fixture
def own_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    """A pair of its own: the failover test leaves it with one node."""
    with BrokerPair(tmp_path / "pair", user=USER, password=PASSWORD, heartbeat_timeout=1.0) as p:
        yield p


def test_stream_survives_sigkill_of_the_live(
    spark: Any, own_pair: BrokerPair, tmp_path: Path
) -> None:
    total = write_files(tmp_path / "in", files=4, rows=5_000)
    commit_log = tmp_path / "commits.jsonl"
    marks = tmp_path / "marks"
    query = start(
        rows_of(spark, tmp_path / "in", marks),
        own_pair,
        "queue://stream",
        tmp_path / "ck",
        commit_log,
    )
    try:
        # The third batch's task midway: the rows before the mark have left the UDF's
        # buffer and are being sent, and the rest take more than a second to follow.
        deadline = time.monotonic() + 120
        while not (marks / "2-0-0").exists():
            assert time.monotonic() < deadline, f"no third batch got midway: {query.status}"
            assert query.exception() is None, query.exception()
            time.sleep(0.02)
        own_pair.kill(own_pair.live)
        query.processAllAvailable()
    finally:
        query.stop()

    received = ids_received(own_pair, "/queue/stream", total)
    assert sorted(received) == list(range(total)), "rows lost"
    assert max(received.values()) == 1, "rows duplicated"
    done = reports(commit_log)
    assert [r["batch_id"] for r in done] == [str(n) for n in range(4)]
    assert sum(r["rows"] for r in done) == total
    assert sum(r["failovers"] for r in done) >= 1, "no batch met the failover"
    # The client rode through it inside the task: Spark did not have to retry anything.
    assert sum(r["retried_tasks"] for r in done) == 0


def test_restart_from_checkpoint_reruns_the_last_batch_without_duplicates(
    spark: Any, pair: BrokerPair, tmp_path: Path
) -> None:
    total = write_files(tmp_path / "in", files=3, rows=500)
    commit_log = tmp_path / "commits.jsonl"
    checkpoint = tmp_path / "ck"
    df = rows_of(spark, tmp_path / "in")
    query = start(df, pair, "queue://restart", checkpoint, commit_log)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    forget_commit(checkpoint, 2)

    query = start(df, pair, "queue://restart", checkpoint, commit_log)
    try:
        query.processAllAvailable()
    finally:
        query.stop()

    assert [r["batch_id"] for r in reports(commit_log)] == ["0", "1", "2", "2"]
    received = ids_received(pair, "/queue/restart", total)
    assert sorted(received) == list(range(total))
    assert max(received.values()) == 1


def test_foreach_batch_helper_restart_reruns_without_duplicates(
    spark: Any, pair: BrokerPair, tmp_path: Path
) -> None:
    total = write_files(tmp_path / "in", files=2, rows=500)
    checkpoint = tmp_path / "ck"
    df = rows_of(spark, tmp_path / "in")
    helper = ForeachBatchSink(pair.stomp_url, "queue://foreach", user=USER, password=PASSWORD)
    for attempt in range(2):
        query = (
            df.writeStream.foreachBatch(helper).option("checkpointLocation", str(checkpoint))
        ).start()
        try:
            query.processAllAvailable()
        finally:
            query.stop()
        if attempt == 0:
            assert helper.last_report is not None and helper.last_report.batch_id == "1"
            forget_commit(checkpoint, 1)

    assert helper.last_report is not None
    assert (helper.last_report.batch_id, helper.last_report.rows) == ("1", 500)
    received = ids_received(pair, "/queue/foreach", total)
    assert sorted(received) == list(range(total))
    assert max(received.values()) == 1
