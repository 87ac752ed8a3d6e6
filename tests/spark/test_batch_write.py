"""df.write.format("hafailover") into the bundled pair, read back with raw stomp.py."""

from __future__ import annotations

import json
import time
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
from tests.spark.udfs import fail_midway_first_attempt, failing_after_stored, row_of

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.timeout(240)]


def commits(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sink(df: Any, pair: BrokerPair, destination: str, **options: str) -> Any:
    writer = (
        df.write.format("hafailover")
        .option("url", pair.stomp_url)
        .option("user", USER)
        .option("password", PASSWORD)
        .option("destination", destination)
        .mode("append")
    )
    for name, value in options.items():
        writer = writer.option(name, value)
    return writer


def test_batch_write_of_10000_rows_arrives_once_with_body_and_headers(
    spark: Any, pair: BrokerPair, tmp_path: Path
) -> None:
    df = spark.range(10_000, numPartitions=2).select(
        F.format_string("order-%05d", "id").alias("key"),
        F.to_json(F.struct(F.col("id"), (F.col("id") * 3).alias("total"))).alias("body"),
        F.create_map(
            F.lit("order"),
            F.col("id").cast("string"),
            F.lit("parity"),
            (F.col("id") % 2).cast("string"),
        ).alias("headers"),
    )
    commit_log = tmp_path / "commits.jsonl"
    sink(df, pair, "queue://spark-batch", commit_log=str(commit_log)).save()

    received = consume_all(pair, "/queue/spark-batch", expected=10_000)
    assert len(received) == 10_000
    by_order = {int(m.headers["order"]): m for m in received}
    assert sorted(by_order) == list(range(10_000))
    for order, message in by_order.items():
        assert json.loads(message.body) == {"id": order, "total": order * 3}
        assert message.headers["parity"] == str(order % 2)

    [report] = commits(commit_log)
    assert report["committed"] and report["rows"] == 10_000 and report["confirmed"] == 10_000
    assert (report["tasks"], report["failed_tasks"]) == (2, 0)


def test_a_retried_task_duplicates_nothing(spark: Any, pair: BrokerPair, tmp_path: Path) -> None:
    """Partition 0 fails on its first attempt after part of it was sent and confirmed (the
    control in test_retry_order.py shows that it was); the retry sends those rows again under
    the same ids and the broker keeps one of each."""
    failing = F.udf(fail_midway_first_attempt, StringType(), useArrow=False)
    df = spark.range(4_000, numPartitions=2).select(failing("id").alias("body"))
    commit_log = tmp_path / "commits.jsonl"
    with failing_after_stored(spark, pair.stomp_url, "queue://spark-retry"):
        sink(df, pair, "queue://spark-retry", commit_log=str(commit_log)).save()

    received = consume_all(pair, "/queue/spark-retry", expected=4_000)
    bodies = [row_of(m.body) for m in received]
    assert sorted(bodies) == sorted(f"row-{n}" for n in range(4_000))
    [report] = commits(commit_log)
    assert report["retried_tasks"] == 1 and report["rows"] == 4_000


def test_foreach_batch_helper_rerun_of_a_batch_is_dropped(spark: Any, pair: BrokerPair) -> None:
    df = spark.range(1_000, numPartitions=2).select(F.col("id").cast("string").alias("value"))
    write = ForeachBatchSink(
        pair.stomp_url, "queue://spark-foreach", user=USER, password=PASSWORD, sink_id="fb"
    )
    first = write(df, 5)
    again = write(df, 5)  # the same batch once more, as after a restart
    write(df.limit(10), 6)  # a later batch is new data
    assert (first.rows, first.confirmed, again.rows, first.batch_id) == (1_000, 1_000, 1_000, "5")
    received = consume_all(pair, "/queue/spark-foreach", expected=1_010)
    assert sorted(int(m.body) for m in received) == sorted([*range(1_000), *range(10)])


BAD_INPUTS = [
    ({"url": None}, 'option "url" is missing'),
    ({"destination": None}, 'option "destination" is missing'),
    ({"destinaton": "queue://x"}, "unknown option 'destinaton'"),
    ({"heartbeat": "often"}, "heartbeat"),
]


@pytest.mark.parametrize(("options", "message"), BAD_INPUTS)
def test_bad_options_fail_before_any_send(
    spark: Any, pair: BrokerPair, options: dict[str, str | None], message: str
) -> None:
    writer = (
        spark.range(10).select(F.col("id").cast("string").alias("body")).write.format("hafailover")
    )
    given: dict[str, str | None] = {
        "url": pair.stomp_url,
        "user": USER,
        "password": PASSWORD,
        "destination": "queue://spark-bad",
        **options,
    }
    for name, value in given.items():
        if value is not None:
            writer = writer.option(name, value)
    with pytest.raises(Exception, match=message):
        writer.mode("append").save()
    assert consume_all(pair, "/queue/spark-bad", expected=0, idle=0.2) == []


def test_bad_columns_and_null_bodies_fail_before_any_send(spark: Any, pair: BrokerPair) -> None:
    ids = spark.range(100, numPartitions=1)
    with pytest.raises(Exception, match="the message body must be string or binary"):
        sink(ids.select(F.col("id").alias("body")), pair, "queue://spark-null").save()
    with pytest.raises(Exception, match="does not use"):
        sink(
            ids.select(F.col("id").cast("string").alias("body"), "id"), pair, "queue://spark-null"
        ).save()
    nulls = ids.select(F.when(F.col("id") != 57, F.col("id").cast("string")).alias("body"))
    started = time.monotonic()
    with pytest.raises(Exception, match="row 57 of partition 0 has a null body"):
        sink(nulls, pair, "queue://spark-null").save()
    assert time.monotonic() - started < 60
    assert consume_all(pair, "/queue/spark-null", expected=0, idle=0.2) == []
