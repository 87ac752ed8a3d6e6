"""The client commands against the bundled pair, without failover: records, summaries, the
browser and perf; and the progress line, which only a terminal gets."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafailover.cli import main
from hafailover.tools import Progress
from reference_broker.pair import BrokerPair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path_factory.mktemp("pair"), user="app", password="secret") as pair:
        yield pair


def summary(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    out = capsys.readouterr().out.strip().splitlines()
    result: dict[str, object] = json.loads(out[-1])
    return result


@pytest.mark.broker
@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_produce_browse_consume(
    pair: BrokerPair, protocol: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = pair.stomp_url if protocol == "stomp" else pair.amqp_url
    queue = f"queue://clients-{protocol}"
    record = tmp_path / "produced.jsonl"
    argv = ["--url", url, "--destination", queue, "--json"]
    assert main(["producer", *argv, "--count", "25", "--message-size", "64",
                 "--record", str(record)]) == 0  # fmt: skip
    produced = summary(capsys)
    assert produced["confirmed"] == 25 and produced["failovers"] == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["seq"] for line in lines] == list(range(25))
    assert {line["outcome"] for line in lines} == {"confirmed"}
    assert all(line["message_id"] for line in lines)

    assert main(["browser", *argv]) == 0
    browsed = summary(capsys)
    assert browsed["count"] == 25
    assert [m["seq"] for m in browsed["messages"]] == list(range(25))  # type: ignore[attr-defined]
    assert {m["size"] for m in browsed["messages"]} == {64}  # type: ignore[attr-defined]

    record = tmp_path / "consumed.jsonl"
    assert main(["consumer", *argv, "--count", "25", "--ack-mode", "client", "--batch", "7",
                 "--record", str(record)]) == 0  # fmt: skip
    consumed = summary(capsys)
    assert consumed["received"] == 25 and consumed["acknowledges"] == 4
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(line["seq"] for line in lines) == list(range(25))


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_perf_prints_throughput_and_latency(
    pair: BrokerPair, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", pair.stomp_url, "--destination", "queue://perf", "--json"]
    assert main(["perf", "producer", *argv, "--count", "500", "--pipeline", "100"]) == 0
    produced = summary(capsys)
    assert produced["command"] == "perf producer" and produced["confirmed"] == 500
    assert produced["messages_per_second"] > 0 and "p99" in produced["latency_ms"]  # type: ignore[operator]
    assert main(["perf", "consumer", *argv, "--count", "500"]) == 0
    consumed = summary(capsys)
    assert consumed["command"] == "perf consumer" and consumed["received"] == 500


@pytest.mark.broker
@pytest.mark.timeout(60)
def test_text_summary_and_idle_timeout(
    pair: BrokerPair, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--url", pair.stomp_url, "--destination", "queue://idle"]
    assert main(["producer", *argv, "--count", "3", "--tx-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "confirmed: 3" in out and "commits: 2" in out
    assert main(["consumer", *argv, "--idle-timeout", "0.5"]) == 0
    assert "received: 3" in capsys.readouterr().out


def test_progress_only_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    piped, terminal = io.StringIO(), Terminal()
    for stream in (piped, terminal):
        progress = Progress(stream)
        progress.update("producer: 5/10 sent", force=True)
        progress.close()
    assert piped.getvalue() == ""
    assert terminal.getvalue().startswith("\rproducer: 5/10 sent")
