"""The duplicate window's file (consumer_dedup_file) when a write fails: logged once, never
raised into the receive that remembered the id (the message is handed out regardless)."""

from __future__ import annotations

import logging

import pytest

from hafailover.driver.dedup_file import DedupFile


def test_a_write_to_a_full_disk_is_logged_once_and_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal = DedupFile("/dev/full")  # every write fails with ENOSPC
    try:
        with caplog.at_level(logging.WARNING, logger="hafailover.driver.dedup_file"):
            journal.append(b"+id-1\n")
            journal.append(b"+id-2\n")
        warnings = [r for r in caplog.records if "cannot write it" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert "/dev/full" in warnings[0].getMessage()
    finally:
        journal.close()
