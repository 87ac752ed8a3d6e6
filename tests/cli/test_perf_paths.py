"""`hafailover perf paths`: every path applications use, measured on one broker URL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafailover.cli import main
from reference_broker.pair import BrokerPair

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

PATHS = [
    "send(), one at a time",
    "send_async().result(), one at a time",
    "send_async + flush, pipelined",
    "create_consumer(), one at a time",
    "commit of 1",
    "commit of 10",
    "commit of 100",
    *(
        f"receive {mode}, prefetch {prefetch}"
        for prefetch in (100, 1000)
        for mode in ("auto", "client", "dups-ok")
    ),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    directory: Path = tmp_path_factory.mktemp("perf-paths") / "pair"
    with BrokerPair(directory, start_backup=False) as started:
        yield started


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_perf_paths_measures_every_path(
    pair: BrokerPair, protocol: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = pair.stomp_url if protocol == "stomp" else pair.amqp_url
    assert main(["perf", "paths", "--url", url, "--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["path"] for row in rows] == PATHS
    assert all(row["rate"] > 0 for row in rows)
    for row in rows:
        if row["path"].startswith(("send(", "send_async().", "commit", "create_consumer")):
            assert 0 < row["p50_ms"] <= row["p99_ms"]


def test_perf_paths_prints_a_table_and_refuses_a_bad_url(
    pair: BrokerPair, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["perf", "paths", "--url", pair.stomp_url, "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == PATHS
    assert "msg/s" in lines[0] and "p50" in lines[0]
    assert main(["perf", "paths", "--url", "stomp://h:1?nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
