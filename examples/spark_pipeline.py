"""A streaming job into the bundled broker pair, exactly once: rate source -> transform -> queue.

Run: .venv/bin/python examples/spark_pipeline.py [--seconds 10] [--rows-per-second 500]

It starts the bundled pair (live + backup) in a temporary directory, runs a Spark query that
turns the rate source's rows into JSON orders and writes them with the hafailover sink to
queue://orders, stops it after --seconds, and reads the queue back to show that every row
the query committed arrived once. With --kill-live the live broker is SIGKILLed halfway: the
sink fails over to the backup and the count is still exact. Needs Java 17 and the spark
extra (make test installs it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hafailover  # noqa: E402
from reference_broker.pair import BrokerPair  # noqa: E402

USER, PASSWORD = "app", "secret"


def read_orders(url: str) -> Counter[int]:
    """Every order on the queue, read back with the hafailover client."""
    received: Counter[int] = Counter()
    # The first broker of the list may be the killed live: let the first connection walk
    # the list (by default it tries the first broker only, F12).
    url += ("&" if "?" in url.rpartition(")")[2] else "?") + "initial_connect_attempts=4"
    with hafailover.connect(url, user=USER, password=PASSWORD) as connection:
        consumer = connection.create_session().create_consumer("queue://orders")
        connection.start()
        while (message := consumer.receive(timeout=2.0)) is not None:
            received[json.loads(message.body)["order"]] += 1
    return received


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows-per-second", type=int, default=500)
    parser.add_argument("--kill-live", action="store_true", help="SIGKILL the live halfway")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)

    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers need pyarrow and hafailover
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention

    from hafailover.spark import register

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("hafailover-example")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)

    with (
        tempfile.TemporaryDirectory() as scratch,
        BrokerPair(Path(scratch) / "pair", user=USER, password=PASSWORD) as pair,
    ):
        print(f"pair up: {pair.stomp_url}")
        orders = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", args.rows_per_second)
            .option("numPartitions", 2)
            .load()
            .select(
                F.col("value").cast("string").alias("key"),  # the row's identity: its order id
                F.to_json(
                    F.struct(
                        F.col("value").alias("order"),
                        (F.col("value") % 7 + 1).alias("quantity"),
                        F.col("timestamp").cast("string").alias("placed"),
                    )
                ).alias("body"),
                F.create_map(F.lit("region"), (F.col("value") % 3).cast("string")).alias("headers"),
            )
        )
        commit_log = Path(scratch) / "commits.jsonl"
        query = (
            orders.writeStream.format("hafailover")
            .option("url", pair.stomp_url)
            .option("user", USER)
            .option("password", PASSWORD)
            .option("destination", "queue://orders")
            .option("commit_log", str(commit_log))
            .option("checkpointLocation", str(Path(scratch) / "checkpoint"))
            .trigger(processingTime="1 second")
            .start()
        )
        # Let some batches commit (a loaded machine may take a while for the first one),
        # kill the live, and make sure batches commit again after the failover.
        time.sleep(args.seconds / 2)
        before = wait_for_batches(commit_log, 1)
        if args.kill_live:
            print(f"SIGKILL the live broker {pair.live}")
            pair.kill(pair.live)
        time.sleep(args.seconds / 2)
        wait_for_batches(commit_log, before + 1)
        query.stop()

        batches = read_batches(commit_log)
        committed = sum(b["rows"] for b in batches if b["committed"])
        received = read_orders(pair.stomp_url)
        duplicates = sum(n - 1 for n in received.values())
        print(
            f"{len(batches)} batches committed {committed} rows; the queue holds "
            f"{sum(received.values())} messages, {len(received)} distinct orders, "
            f"{duplicates} duplicates; failovers {sum(b['failovers'] for b in batches)}"
        )
    spark.stop()
    # A query stopped mid-batch may have sent part of a batch it never committed: extra
    # rows are possible, lost or repeated ones are not.
    ok = duplicates == 0 and set(range(committed)) <= received.keys()
    print("exactly once: yes" if ok else "exactly once: NO")
    return 0 if ok else 1


def read_batches(commit_log: Path) -> list[dict[str, Any]]:
    """The sink's per-batch records so far (none before the first commit)."""
    if not commit_log.exists():
        return []
    return [json.loads(line) for line in commit_log.read_text().splitlines() if line]


def wait_for_batches(commit_log: Path, count: int, timeout: float = 120.0) -> int:
    """Wait until ``count`` batches have committed; return how many have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        committed = sum(1 for batch in read_batches(commit_log) if batch["committed"])
        if committed >= count:
            return committed
        time.sleep(0.2)
    raise SystemExit(f"fewer than {count} batches committed within {timeout:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
