"""examples/spark_pipeline.py runs as the README says, with the live killed halfway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_spark_pipeline_example_delivers_once_through_a_failover() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "spark_pipeline.py"),
            "--seconds",
            "8",
            "--kill-live",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "exactly once: yes" in result.stdout
    assert "0 duplicates" in result.stdout
