"""Fixtures of the integration tests: a fresh bundled pair per test, both protocols."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_broker import BrokerPair

from .apis import api  # noqa: F401 - the fixture that runs a rule test through both APIs


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user="app", password="secret") as started:
        started.wait_synchronized(30)
        yield started
