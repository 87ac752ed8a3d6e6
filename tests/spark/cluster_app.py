"""A Spark application the cluster tests run as a program of its own (driver Python + JVM).

    python tests/spark/cluster_app.py --driver-port P --master spark://... --url URL
        --destination queue://q --work DIR batch|stream [--key] [--rows N] [--partitions N]

``batch`` writes ``--rows`` rows in ``--partitions`` partitions; ``stream`` reads the JSON
files of DIR/in, one per micro-batch, checkpointing in DIR/checkpoint. Bodies are
``row-N|...`` (tests/spark/udfs.py). With ``--key`` the row id (as text) is the key, else
ids come from the rows' content. Every row passes a UDF that sleeps ``--row-delay``
seconds and, at a task's ``--mark-after``-th row, writes DIR/marks/<batch>-<partition>-
<attempt> holding its Python worker's pid: the test's sign that the task is sending, and
how it finds the executor to kill. The driver appends each batch's report to
DIR/commits.jsonl (the sink's ``commit_log``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

USER, PASSWORD = "app", "secret"
RECORDS_PER_ARROW_BATCH = 250


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["batch", "stream"])
    parser.add_argument("--driver-port", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--destination", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--key", action="store_true")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--row-delay", type=float, default=0.0)
    parser.add_argument("--mark-after", type=int, default=500)
    args = parser.parse_args()

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention
    from pyspark.sql.types import StringType

    from hafailover.spark import register
    from tests.spark.cluster import QUICK_JVM
    from tests.spark.udfs import slow_and_marked

    spark = (
        SparkSession.builder.master(args.master)
        .appName("hafailover-cluster-test")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.port", str(args.driver_port))
        .config("spark.executor.memory", "512m")
        .config("spark.driver.extraJavaOptions", QUICK_JVM)
        .config("spark.executor.extraJavaOptions", QUICK_JVM)
        .config("spark.executor.cores", "1")
        .config("spark.task.maxFailures", "4")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", str(ROOT)))
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(RECORDS_PER_ARROW_BATCH))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    marks = args.work / "marks"
    marks.mkdir(parents=True, exist_ok=True)
    delay, mark_after = args.row_delay, args.mark_after
    passing = F.udf(
        lambda row_id: slow_and_marked(row_id, delay, mark_after, str(marks)), StringType()
    )

    def shaped(df: Any) -> Any:
        columns = [passing("id").alias("body")]
        if args.key:
            columns.append(F.col("id").cast("string").alias("key"))
        return df.select(*columns)

    options = {
        "url": args.url,
        "user": USER,
        "password": PASSWORD,
        "destination": args.destination,
        "commit_log": str(args.work / "commits.jsonl"),
    }
    if args.mode == "batch":
        writer = shaped(spark.range(args.rows, numPartitions=args.partitions)).write
        writer.format("hafailover").options(**options).mode("append").save()
    else:
        source = (
            spark.readStream.schema("id long")
            .option("maxFilesPerTrigger", 1)
            .json(str(args.work / "in"))
        )
        query = (
            shaped(source)
            .writeStream.format("hafailover")
            .options(**options)
            .option("checkpointLocation", str(args.work / "checkpoint"))
            .start()
        )
        query.processAllAvailable()
        query.stop()
    spark.stop()
    print("application done", flush=True)


if __name__ == "__main__":
    main()
