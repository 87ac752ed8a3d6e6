"""`hafailover demo` (what `make demo` runs): the live failover demo ends with nothing lost or
duplicated, well within a minute, and leaves no broker process behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def demo_processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "hafailover-demo-" in command and "reference_broker" in command:
            found.append(command)
    return found


@pytest.mark.broker
@pytest.mark.timeout(90)
def test_make_demo_kills_the_live_and_loses_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hafailover.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "SIGKILL live" in out and "backup  serving as live" in out
    assert "first confirmed send after failover" in out
    assert "lost 0, duplicated 0, unexpected 0  OK" in out
    assert "sent 2000, confirmed 2000" in out
    assert demo_processes() == []


def test_walkthrough_needs_no_network(capsys: pytest.CaptureFixture[str]) -> None:
    from hafailover.cli import main

    assert main(["demo", "--walkthrough"]) == 0
    assert "commit() -> TRANSACTION_ROLLED_BACK" in capsys.readouterr().out
