"""Retries that see another order, and a retry after many later messages (issue 20).

A shuffle leaves the order of rows inside a partition to the order its blocks arrive in;
here a sort key that depends on the attempt makes a task's retry see its rows in reverse, and
the first attempt of partition 0 fails midway, after part of it was sent and confirmed. The
rows have no key: their duplicate ids come from their content. The same query with
positional ids shows that the reorder is real: there it loses rows and doubles others.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention
from pyspark.sql.types import LongType, StringType

from reference_broker.engine import EngineConfig
from reference_broker.pair import BrokerPair
from tests.spark.broker import PASSWORD, USER, consume_all
from tests.spark.udfs import (
    FAIL_AFTER,
    fail_midway_first_attempt,
    failing_after_stored,
    order_by_attempt,
    row_of,
)

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.timeout(300)]

ROWS = 6_000


def write(df: Any, pair: BrokerPair, destination: str, **options: str) -> None:
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
    writer.save()


def reordered_on_retry(spark: Any) -> Any:
    """ROWS rows through a shuffle; partition 0 fails midway on its first attempt (once
    1,000 of its rows are stored) and its retry sees its rows in the reverse order."""
    failing = F.udf(fail_midway_first_attempt, StringType(), useArrow=False)
    sort_key = F.udf(order_by_attempt, LongType(), useArrow=False)
    return (
        spark.range(ROWS, numPartitions=3)
        .repartition(2, "id")
        .sortWithinPartitions(sort_key("id"))
        .select(failing("id").alias("body"))
    )


def received(pair: BrokerPair, destination: str, expected: int) -> Counter[str]:
    return Counter(row_of(m.body) for m in consume_all(pair, destination, expected=expected))


def reports(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_retry_that_sees_another_order_loses_and_doubles_nothing(
    spark: Any, pair: BrokerPair, tmp_path: Path
) -> None:
    commit_log = tmp_path / "commits.jsonl"
    with failing_after_stored(spark, pair.stomp_url, "queue://reorder"):
        write(reordered_on_retry(spark), pair, "queue://reorder", commit_log=str(commit_log))
    got = received(pair, "/queue/reorder", ROWS)
    assert sorted(got) == sorted(f"row-{n}" for n in range(ROWS)), "rows lost"
    assert max(got.values()) == 1, "rows doubled"
    [report] = reports(commit_log)
    assert report["retried_tasks"] == 1 and report["rows"] == ROWS


def test_the_same_retry_with_positional_ids_loses_and_doubles_rows(
    spark: Any, pair: BrokerPair, tmp_path: Path
) -> None:
    """The control: under positional ids the reversed retry sends rows under ids attempt 0
    had given to others. The broker drops them (lost) and keeps attempt 0's rows under
    their own ids and again under the retry's (doubled)."""
    commit_log = tmp_path / "commits.jsonl"
    with failing_after_stored(spark, pair.stomp_url, "queue://reorder-positional"):
        write(
            reordered_on_retry(spark),
            pair,
            "queue://reorder-positional",
            commit_log=str(commit_log),
            positional_ids="true",
        )
    got = received(pair, "/queue/reorder-positional", ROWS)
    lost = {f"row-{n}" for n in range(ROWS)} - set(got)
    doubled = [body for body, count in got.items() if count > 1]
    # Attempt 0 failed once the broker stored 1,000 of its rows (failing_after_stored).
    assert len(lost) >= 1_000 and len(doubled) == len(lost) < FAIL_AFTER
    [report] = reports(commit_log)
    assert report["retried_tasks"] == 1


def rerun_after_later_messages(spark: Any, pair: BrokerPair, destination: str, later: int) -> int:
    """Write 1,000 rows, then ``later`` other messages to the same address, then the first
    write again (as a retry would, with the same sink id); returns how many of the first
    1,000 the broker stored twice."""
    first = spark.range(1_000, numPartitions=2).select(
        F.format_string("first-%d", "id").alias("body")
    )
    write(first, pair, destination, sink_id="late-retry")
    filler = spark.range(later, numPartitions=2).select(
        F.format_string("later-%d", "id").alias("body")
    )
    write(filler, pair, destination, sink_id="late-filler")
    write(first, pair, destination, sink_id="late-retry")
    got = received(pair, "/" + destination.replace("://", "/"), 1_000 + later)
    assert sum(1 for body in got if body.startswith("later-")) == later
    assert sorted(b for b in got if b.startswith("first-")) == sorted(
        f"first-{n}" for n in range(1_000)
    )
    return sum(1 for body, count in got.items() if body.startswith("first-") and count > 1)


def test_a_retry_after_many_later_messages_within_the_bound_doubles_nothing(
    spark: Any, pair: BrokerPair
) -> None:
    """The bundled broker remembers at least the last duplicate_cache_size ids per address
    (20,000 by default; older ones too while they are within the retention by time): a
    retry after 18,000 later messages to the same address is still dropped, whatever the
    retention (docs/spark.md has the figures)."""
    bound = EngineConfig().duplicate_cache_size
    assert bound == 20_000, "the bound changed: update this test and docs/spark.md"
    assert rerun_after_later_messages(spark, pair, "queue://late-retry", 18_000) == 0
