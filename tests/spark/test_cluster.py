"""The sink on a Spark standalone cluster: executors and the application SIGKILLed mid-write.

One cluster for the module (a master and two one-core workers, separate processes started
with the pip-installed PySpark's spark-class); each test runs its Spark application as a
program of its own (tests/spark/cluster_app.py) against a broker pair of its own. Rows pass
a slow UDF that marks when a task is midway, so a kill lands while the task is sending:
- a batch and a streaming write lose one executor JVM and then the live broker: Spark
  retries the executor's tasks elsewhere and the sink fails over; every row arrives once;
- a streaming application (driver Python and JVM) is SIGKILLed in the middle of its first
  micro-batch and started again from its checkpoint, with and without a key: the re-run
  batch sends under the same ids and every row arrives once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from reference_broker.pair import BrokerPair
from tests.spark.broker import PASSWORD, USER, consume_all
from tests.spark.cluster import App, StandaloneCluster, executor_of
from tests.spark.udfs import row_of

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.timeout(900)]

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        message = "Spark needs Java (JDK 17): none on PATH and JAVA_HOME is not set"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    started = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture
def own_pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user=USER, password=PASSWORD, heartbeat_timeout=1.0) as p:
        yield p


def start_app(
    cluster: StandaloneCluster, pair: BrokerPair, work: Path, mode: str, *extra: str
) -> App:
    work.mkdir(parents=True, exist_ok=True)
    args = [mode, "--master", cluster.master_url, "--url", pair.stomp_url, "--work", str(work)]
    return App([*args, "--destination", f"queue://{work.name}", *extra], work / "app.log")


def wait_for_mark(app: App, marks: Path, name: str | None = None, timeout: float = 600) -> Path:
    """The first mark file (or the one named): a task is midway through its rows."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(marks.glob(name or "*")) if marks.exists() else []
        if found and found[0].read_text():
            return found[0]
        if app.process.poll() is not None:
            raise AssertionError(f"the application ended before the mark: {app.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no task got midway in {timeout}s: {app.output()}")
        time.sleep(0.05)


def finish(app: App, timeout: float = 600) -> None:
    try:
        assert app.wait(timeout) == 0, app.output()
    finally:
        if app.process.poll() is None:
            app.kill()


def reports(work: Path) -> list[dict[str, Any]]:
    path = work / "commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_each_row_once(pair: BrokerPair, work: Path, total: int) -> None:
    messages = consume_all(pair, f"/queue/{work.name}", expected=total, idle=2.0, limit=120)
    counts = Counter(row_of(m.body) for m in messages)
    missing = {f"row-{n}" for n in range(total)} - set(counts)
    assert not missing, f"{len(missing)} rows lost, e.g. {sorted(missing)[:5]}"
    doubled = {body: n for body, n in counts.items() if n > 1}
    assert not doubled, f"{len(doubled)} rows doubled, e.g. {sorted(doubled)[:5]}"
    assert len(messages) == total


def kill_executor_then_live(app: App, pair: BrokerPair, mark: Path) -> int:
    """SIGKILL the executor JVM running the marked task, then the live broker."""
    executor = executor_of(int(mark.read_text()))
    assert executor is not None and executor in app.executors(), (executor, app.executors())
    os.kill(executor, signal.SIGKILL)
    time.sleep(0.5)
    pair.kill(pair.live)
    return executor


def retried_elsewhere(marks: Path, killed: int) -> list[str]:
    """The marks of task attempts after the first, made outside the killed executor."""
    return [
        m.name
        for m in marks.glob("*")
        if not m.name.endswith("-0") and executor_of(int(m.read_text())) != killed
    ]


def write_files(directory: Path, files: int, rows: int) -> int:
    directory.mkdir(parents=True)
    for number in range(files):
        ids = range(number * rows, (number + 1) * rows)
        text = "".join(json.dumps({"id": i}) + "\n" for i in ids)
        (directory / f"part-{number:03d}.json").write_text(text)
    return files * rows


def test_batch_write_loses_an_executor_and_the_live(
    cluster: StandaloneCluster, own_pair: BrokerPair, tmp_path: Path
) -> None:
    work, total = tmp_path / "cluster-batch", 8_000
    # 3 ms a row: a task takes about 6 s, so the other executor's task is still sending
    # when the live dies, whatever the machine's load did to the two tasks' start.
    app = start_app(
        cluster, own_pair, work, "batch", "--rows", str(total), "--partitions", "4",
        "--row-delay", "0.003", "--mark-after", "600",
    )  # fmt: skip
    try:
        killed = kill_executor_then_live(app, own_pair, wait_for_mark(app, work / "marks"))
    finally:
        finish(app)
    assert_each_row_once(own_pair, work, total)
    [report] = reports(work)
    assert report["committed"] and report["rows"] == total
    assert report["retried_tasks"] >= 1 and report["failovers"] >= 1, report
    assert retried_elsewhere(work / "marks", killed), sorted(os.listdir(work / "marks"))


def test_streaming_write_loses_an_executor_and_the_live(
    cluster: StandaloneCluster, own_pair: BrokerPair, tmp_path: Path
) -> None:
    work = tmp_path / "cluster-stream"
    total = write_files(work / "in", files=2, rows=1_500)
    app = start_app(
        cluster, own_pair, work, "stream", "--row-delay", "0.001", "--mark-after", "500"
    )
    try:
        mark = wait_for_mark(app, work / "marks", "0-*-0")
        killed = kill_executor_then_live(app, own_pair, mark)
    finally:
        finish(app)
    assert_each_row_once(own_pair, work, total)
    done = reports(work)
    assert [r["batch_id"] for r in done] == ["0", "1"], done
    assert sum(r["retried_tasks"] for r in done) >= 1 and sum(r["rows"] for r in done) == total
    assert retried_elsewhere(work / "marks", killed), sorted(os.listdir(work / "marks"))


@pytest.mark.parametrize("key", [False, True], ids=["content-ids", "key"])
def test_streaming_application_sigkilled_mid_batch_restarts_from_its_checkpoint(
    cluster: StandaloneCluster, pair: BrokerPair, tmp_path: Path, key: bool
) -> None:
    work = tmp_path / f"cluster-restart-{'key' if key else 'content'}"
    total = write_files(work / "in", files=2, rows=1_500)
    keyed = ["--key"] if key else []
    app = start_app(
        cluster, pair, work, "stream", "--row-delay", "0.001", "--mark-after", "700", *keyed
    )
    try:
        wait_for_mark(app, work / "marks", "0-*-0")
    finally:
        app.kill()  # mid-batch 0: the driver's Python and JVM at once
    # The batch's offsets were in the checkpoint before it ran; its commit was not.
    assert reports(work) == []
    assert (work / "checkpoint" / "offsets" / "0").exists()

    finish(start_app(cluster, pair, work, "stream", *keyed))
    assert_each_row_once(pair, work, total)
    assert [r["batch_id"] for r in reports(work)] == ["0", "1"]
