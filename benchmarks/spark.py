"""Rows per second through the Spark sink against raw stomp.py in foreachPartition, one run.

Run: .venv/bin/python benchmarks/spark.py [--rows N] [--repeats R] [--master M ...]

Both sides publish the same cached DataFrame (2 partitions, 100-byte string bodies) as
persistent messages to the bundled pair (live + synchronized backup), and both wait until the
broker confirmed every row:
- sink: df.write.format("hafailover"), exactly-once, without a key: a duplicate id per row
  from the row's content (a digest each);
- sink, positional ids: the same with positional_ids=true (no digest), to show what content
  ids cost;
- baseline: df.foreachPartition with one raw stomp.py connection per partition to the live,
  a receipt on every send, at most --window unconfirmed (as benchmarks/broker.py).
Each --master is measured in turn in the same run (default: local[2], then
local-cluster[2,1,1024]: two executor processes of one core, as on a real cluster). The
figure is the best of --repeats for each side, the sides interleaved. Target: sink >= 0.8 x
baseline.
Then, on each master, one more sink run during which the live is SIGKILLed (after 40% of the
best sink run's time): the backup takes over and the tasks fail over and replay; its rate
includes the takeover. The killed node comes back as the new backup before the next master.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import stomp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reference_broker.pair import BrokerPair  # noqa: E402

USER, PASSWORD = "bench", "bench"


class _Receipts(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.count = 0
        self.condition = threading.Condition()

    def on_receipt(self, frame: Any) -> None:
        with self.condition:
            self.count += 1
            self.condition.notify_all()


def publish_raw(port: int, destination: str, window: int, rows: Iterator[Any]) -> None:
    """foreachPartition body: one raw stomp.py connection, receipts on every send."""
    connection = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0))
    listener = _Receipts()
    connection.set_listener("bench", listener)
    connection.connect(USER, PASSWORD, wait=True)
    sent = 0
    try:
        for row in rows:
            with listener.condition:
                while sent - listener.count >= window:
                    listener.condition.wait(30)
            connection.send(
                destination, row.body, headers={"persistent": "true", "receipt": f"r-{sent}"}
            )
            sent += 1
        with listener.condition:
            while listener.count < sent:
                if not listener.condition.wait(30):
                    raise TimeoutError(f"{sent - listener.count} receipts missing")
    finally:
        connection.disconnect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=1_000)
    parser.add_argument(
        "--master", action="append", help="Spark master(s) to measure on, in turn (repeatable)"
    )
    args = parser.parse_args()
    masters = args.master or ["local[2]", "local-cluster[2,1,1024]"]

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    import pyspark

    # local-cluster starts its executors with the distribution's scripts: pip's PySpark is one.
    os.environ.setdefault("SPARK_HOME", str(Path(pyspark.__file__).parent))
    with (
        tempfile.TemporaryDirectory() as scratch,
        # A long heartbeat timeout: on a busy machine a starved live must not be failed over
        # in the middle of a run (the raw side talks to the live only).
        BrokerPair(scratch, user=USER, password=PASSWORD, heartbeat_timeout=5.0) as pair,
    ):
        results = [(master, measure(master, pair, args)) for master in masters]

    for master, best in results:
        print(
            f"rows: {args.rows:,} in 2 partitions, 100-byte bodies, {master}, "
            f"best of {args.repeats}"
        )
        print(f"  foreachPartition + raw stomp.py:     {best['raw']:,.0f} rows/s")
        print(f"  hafailover sink (content ids):       {best['sink']:,.0f} rows/s")
        print(f"  hafailover sink (positional ids):    {best['positional']:,.0f} rows/s")
        print(f"  sink / raw: {best['sink'] / best['raw']:.2f} (target >= 0.8)")
        print(f"  content / positional ids: {best['sink'] / best['positional']:.2f}")
        print(
            f"  hafailover sink, live SIGKILLed mid-write: {best['failover']:,.0f} rows/s "
            f"(/ sink: {best['failover'] / best['sink']:.2f}, / raw: "
            f"{best['failover'] / best['raw']:.2f}; the backup's takeover and the tasks' "
            "failover included)"
        )


def measure(master: str, pair: BrokerPair, args: argparse.Namespace) -> dict[str, float]:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F  # noqa: N812 - PySpark's own convention

    from hafailover.spark import register

    spark = (
        SparkSession.builder.master(master)
        .appName("hafailover-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    port = pair.live.stomp_port

    def sink(df: Any, queue: str, **options: str) -> None:
        writer = (
            df.write.format("hafailover")
            .option("url", pair.stomp_url)
            .option("user", USER)
            .option("password", PASSWORD)
            .option("destination", f"queue://{queue}")
        )
        for name, value in options.items():
            writer = writer.option(name, value)
        writer.mode("append").save()

    def positional(df: Any, queue: str) -> None:
        sink(df, queue, positional_ids="true")

    def baseline(df: Any, queue: str) -> None:
        window = args.window
        df.foreachPartition(lambda rows: publish_raw(port, f"/queue/{queue}", window, rows))

    def frame(rows: int) -> Any:
        df = spark.range(rows, numPartitions=2).select(
            F.format_string("%0100d", "id").alias("body")
        )
        df.cache().count()
        return df

    tag = "".join(c for c in master if c.isalnum())
    try:
        # Warm up: Python workers started, connections made, code imported.
        warm = frame(2_000)
        sink(warm, f"warm-sink-{tag}")
        baseline(warm, f"warm-raw-{tag}")

        df = frame(args.rows)
        best = {"sink": 0.0, "positional": 0.0, "raw": 0.0}
        for repeat in range(args.repeats):
            for name, run in (("raw", baseline), ("sink", sink), ("positional", positional)):
                started = time.perf_counter()
                run(df, f"bench-{tag}-{name}-{repeat}")
                rate = args.rows / (time.perf_counter() - started)
                best[name] = max(best[name], rate)
                print(f"  {master} {name:10} run {repeat + 1}: {rate:,.0f} rows/s", flush=True)
        best["failover"] = _through_a_kill(
            pair, args.rows / best["sink"] * 0.4, args.rows, tag, df, sink
        )
        print(f"  {master} sink, live killed: {best['failover']:,.0f} rows/s", flush=True)
        return best
    finally:
        spark.stop()


def _through_a_kill(
    pair: BrokerPair, delay: float, rows: int, tag: str, df: Any, sink: Any
) -> float:
    """One sink run with the live SIGKILLed ``delay`` seconds in; its rows per second. The
    killed node is restarted as the backup and synchronized before this returns."""
    victim = pair.live
    killed_at: list[float] = []

    def kill() -> None:
        pair.kill(victim)
        killed_at.append(time.perf_counter())

    killer = threading.Timer(delay, kill)
    started = time.perf_counter()
    killer.start()
    sink(df, f"bench-{tag}-failover")
    ended = time.perf_counter()
    killer.join()
    if killed_at[0] > ended:
        raise SystemExit(
            f"the sink wrote {rows:,} rows in {ended - started:.2f}s, before the kill at "
            f"{delay:.2f}s: this run did not go through a failover"
        )
    pair.restart(victim)
    pair.wait_synchronized(60)
    return rows / (ended - started)


if __name__ == "__main__":
    main()
