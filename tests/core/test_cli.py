"""The command line: the demo walk-through and URL checking."""

from __future__ import annotations

import json

import pytest

from hafailover import demo
from hafailover.cli import main
from hafailover.errors import ErrorCode


def test_demo_walks_through_reattach_and_reconnect() -> None:
    lines: list[str] = []
    report = demo.run(lines.append)
    text = "\n".join(lines)
    assert "replay 9 commands (#591..#599)" in text
    assert "commit() -> TRANSACTION_ROLLED_BACK" in text
    assert report.code is ErrorCode.FAILOVER
    assert report.transactions_rolled_back == (1,)
    assert len(report.resent) == 9 and report.in_doubt == ()


def test_url_command_prints_normalized_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["url", "failover:(stomp://u:pw@a,stomp://b)?heartbeat=2000"]) == 0
    assert capsys.readouterr().out.strip() == (
        "failover:(stomp://u:***@a:61613,stomp://b:61613)?heartbeat=2s"
    )
    assert main(["url", "--json", "amqp://h?retry_jitter=0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["protocol"] == "amqp" and summary["options"] == {"retry_jitter": "0.0"}


def test_url_command_bad_input_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["url", "stomp://h?colour=red"]) == 2
    assert "unknown option 'colour'" in capsys.readouterr().err
