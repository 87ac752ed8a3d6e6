"""Fixtures of the driver tests: the scripted broker, started and stopped per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .fake import FakeBroker


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker()
    started.start()
    yield started
    started.stop()
