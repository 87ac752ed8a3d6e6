"""Per-batch figures: the commit message each task returns and the driver's summary of them.

Each write task returns a ``SinkCommit`` (Spark pickles it back to the driver); the
driver folds a batch's commits into one ``BatchReport``, logs it on the ``hafailover.spark``
logger, and, with the ``commit_log`` option, appends it as one JSON line to a file that
programs can read. Values only, and the one place that formats them.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from hafailover._units import format_duration
from hafailover.spark._options import DeliveryGuarantee, SinkOptions
from hafailover.spark._rows import ColumnPlan
from hafailover.spark._worker import PartitionResult

__all__ = [
    "ORDER_WARNING",
    "RETENTION_WARNING",
    "BatchReport",
    "SinkCommit",
    "log_report",
    "warn_if_order_matters",
    "warn_if_retention_unknown",
]

logger = logging.getLogger("hafailover.spark")


@dataclass(frozen=True)
class SinkCommit(WriterCommitMessage):
    """The commit message of one write task."""

    result: PartitionResult


@dataclass(frozen=True)
class BatchReport:
    """What one batch (a micro-batch, or a whole batch write) did at the broker."""

    sink_id: str
    batch_id: str
    committed: bool  # False: Spark aborted the batch (a task failed for good)
    tasks: int
    failed_tasks: int  # tasks without a commit message (they failed)
    retried_tasks: int  # tasks that succeeded on an attempt after the first
    rows: int
    sent: int
    confirmed: int
    failovers: int
    replayed: int
    resent: int
    in_doubt: int
    # Tasks whose broker does not drop a copy by its duplicate id: a retry stores twice.
    without_duplicate_detection: int = 0

    @classmethod
    def from_results(
        cls,
        results: Sequence[PartitionResult | None],
        *,
        committed: bool,
        batch_id: str | None = None,
        sink_id: str | None = None,
    ) -> BatchReport:
        done = [r for r in results if r is not None]
        first = done[0] if done else None
        return cls(
            sink_id=sink_id or (first.sink_id if first else "?"),
            batch_id=batch_id if batch_id is not None else (first.batch_id if first else "?"),
            committed=committed,
            tasks=len(results),
            failed_tasks=len(results) - len(done),
            retried_tasks=sum(1 for r in done if r.attempt > 0),
            rows=sum(r.rows for r in done),
            sent=sum(r.sent for r in done),
            confirmed=sum(r.confirmed for r in done),
            failovers=sum(r.failovers for r in done),
            replayed=sum(r.replayed for r in done),
            resent=sum(r.resent for r in done),
            in_doubt=sum(r.in_doubt for r in done),
            without_duplicate_detection=sum(1 for r in done if not r.duplicate_detection),
        )

    @classmethod
    def from_commits(
        cls,
        messages: Sequence[WriterCommitMessage | None],
        *,
        committed: bool,
        batch_id: str | None = None,
    ) -> BatchReport:
        results = [m.result if isinstance(m, SinkCommit) else None for m in messages]
        return cls.from_results(results, committed=committed, batch_id=batch_id)

    def summary(self) -> str:
        outcome = "committed" if self.committed else "ABORTED"
        return (
            f"hafailover sink {self.sink_id} batch {self.batch_id} {outcome}: "
            f"{self.rows} rows from {self.tasks - self.failed_tasks}/{self.tasks} tasks "
            f"({self.retried_tasks} retried); sent {self.sent}, confirmed {self.confirmed}, "
            f"failovers {self.failovers}, replayed {self.replayed}, resent {self.resent}, "
            f"in doubt {self.in_doubt}"
            + (
                f"; {self.without_duplicate_detection} tasks wrote to a broker without "
                "duplicate detection: a retry of theirs stores its rows twice"
                if self.without_duplicate_detection
                else ""
            )
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worker_logger() -> logging.Logger:
    # Commits run in a Python process Spark starts next to the driver, whose logging
    # nobody configures: without a handler of its own the summary would be dropped.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger


def log_report(report: BatchReport, commit_log: str | None, *, in_worker: bool) -> None:
    """Log the batch's summary (a warning if it was aborted or left sends in doubt) and
    append it to ``commit_log`` if one is set."""
    log = _worker_logger() if in_worker else logger
    level = logging.INFO
    if not report.committed or report.in_doubt or report.without_duplicate_detection:
        level = logging.WARNING
    log.log(level, report.summary())
    if commit_log:
        with Path(commit_log).open("a", encoding="utf-8") as file:
            file.write(json.dumps(report.as_dict(), sort_keys=True) + "\n")


# The data source is given the schema, never the query plan, so the sink cannot tell whether
# a retry would see the same order: it warns whenever positional ids were chosen.
ORDER_WARNING = (
    "hafailover sink: exactly_once without a key and with positional_ids=true: a row's "
    "duplicate id is its position in its partition, so a task retry or a re-run batch that "
    "sees its rows in another order (any shuffle) sends a row under another row's id and the "
    "broker drops it (one row lost, one stored twice); give a key column, or leave "
    "positional_ids out (ids from the row's content)"
)


def warn_if_order_matters(options: SinkOptions, plan: ColumnPlan) -> None:
    """Log ``ORDER_WARNING`` when this write's ids depend on the order of rows."""
    if (
        options.delivery_guarantee is DeliveryGuarantee.EXACTLY_ONCE
        and plan.key is None
        and options.positional_ids
    ):
        # The writer is made in a Python process Spark starts next to the driver.
        _worker_logger().warning(ORDER_WARNING)


# No broker says how long it keeps duplicate ids, and the bundled pair's retention is its
# operator's choice: unless the user states it, a write cannot know a retry is covered.
RETENTION_WARNING = (
    "hafailover sink: exactly_once rests on the broker still remembering a row's duplicate id "
    "when a task retry or a re-run batch sends the row again, and the sink cannot know how long "
    "it does: the bundled pair keeps ids for --duplicate-id-retention (default 1h) beyond its "
    "newest --duplicate-id-cache-size ids per address; ActiveMQ Artemis keeps only the newest "
    "id-cache-size ids per address (a retry after more later messages stores its rows twice); "
    "a broker without duplicate detection keeps none. Make the broker's retention longer than "
    "the longest retry or restart, then say so with "
    '.option("broker_duplicate_id_retention", "<duration>") to silence this warning'
)


def warn_if_retention_unknown(options: SinkOptions) -> None:
    """Log ``RETENTION_WARNING`` for an exactly-once write whose user did not say how long
    the broker keeps duplicate ids; otherwise log what the write relies on."""
    if options.delivery_guarantee is not DeliveryGuarantee.EXACTLY_ONCE:
        return
    retention = options.broker_duplicate_id_retention
    if retention is None:
        _worker_logger().warning(RETENTION_WARNING)
    else:
        _worker_logger().info(
            "hafailover sink: exactly_once relies on the broker keeping duplicate ids for "
            "%s (broker_duplicate_id_retention; the sink cannot check it): a retry or restart "
            "must come sooner",
            format_duration(retention),
        )
