"""Every script in examples/ runs as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_failover_url_example() -> None:
    result = run_example("failover_url.py")
    assert result.returncode == 0, result.stderr
    assert "attempt 1: stomp://live:61613 after 0.000s" in result.stdout
    assert "attempt 2: stomp://backup:61613 after 0.100s" in result.stdout
    assert "attempt 4: stomp://backup:61613 after 0.400s" in result.stdout


def test_failover_url_example_rejects_bad_input() -> None:
    result = run_example("failover_url.py", "failover:(stomp://a,amqp://b)")
    assert result.returncode == 2
    assert "mixes protocols" in result.stdout and "[option: brokers]" in result.stdout
