"""One SparkSession for every Spark test, and a broker pair to write into.

The session runs ``local[2,3]``: two cores, as the project's machines have, and up to three
attempts per task so a test can make a task fail once and see its retry. Starting Spark
costs seconds, so the session is shared by the whole test run and stopped at its end.
Python workers run this interpreter (with pyarrow and hafailover) and can import the
test helpers from the repository root.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reference_broker.pair import BrokerPair
from tests.spark.broker import PASSWORD, USER

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        message = "Spark needs Java (JDK 17): none on PATH and JAVA_HOME is not set"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)  # in CI a missing service is a failure
        pytest.skip(message)
    from pyspark.sql import SparkSession

    from hafailover.spark import register

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("hafailover-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    """A pair shared by a module's tests; each test writes to a destination of its own."""
    with BrokerPair(
        tmp_path_factory.mktemp("pair"), user=USER, password=PASSWORD, heartbeat_timeout=1.0
    ) as started:
        yield started
