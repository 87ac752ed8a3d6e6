"""The foreachBatch helper: ``query.foreachBatch(ForeachBatchSink(url, destination))``.

For users who prefer ``foreachBatch`` (to write one micro-batch to several sinks, say).
Each call writes the micro-batch through the ``hafailover`` data source as a batch write
whose batch id is the one Spark passes in, so the guarantee is the data source's: a row's
duplicate id derives from the sink id, that batch id, and the row's key or content, and a
re-run of the batch (after a restart from the checkpoint) is dropped by the broker. The call
returns the batch's ``BatchReport``, read back from the commit log the driver wrote.

The sink id defaults to the streaming query's id (kept in its checkpoint, so the same
after a restart); outside a streaming query give ``sink_id``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hafailover.errors import ConfigurationError
from hafailover.spark._options import SinkOptions
from hafailover.spark._report import BatchReport
from hafailover.spark._worker import QUERY_ID_PROPERTY
from hafailover.spark.datasource import HaFailoverDataSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["ForeachBatchSink"]


class ForeachBatchSink:
    """A ``foreachBatch`` function that sends every row of each micro-batch exactly once.

    Options are the data source's, as keyword arguments (``sink_id``, ``key_column``,
    ``heartbeat``, ...); they are checked here, before the query starts.
    """

    def __init__(
        self, url: str, destination: str | None = None, **options: str | int | float
    ) -> None:
        given: dict[str, str] = {k.lower(): str(v) for k, v in options.items()}
        given["url"] = url
        if destination is not None:
            given["destination"] = destination
        if "batch_id" in given:
            raise ConfigurationError("ForeachBatchSink takes its batch ids from Spark")
        SinkOptions.parse(given)  # refuse bad options now, not at the first batch
        self._given = given
        self.last_report: BatchReport | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> BatchReport:
        session = df.sparkSession
        sink_id = self._given.get("sink_id") or session.sparkContext.getLocalProperty(
            QUERY_ID_PROPERTY
        )
        if not sink_id:
            raise ConfigurationError(
                "no streaming query id to use as the sink id: outside a streaming query "
                "give ForeachBatchSink(..., sink_id=...)"
            )
        # foreachBatch runs on a thread of its own, whose session may not know the source.
        session.dataSource.register(HaFailoverDataSource)
        with tempfile.TemporaryDirectory(prefix="hafailover-") as scratch:
            commit_log = self._given.get("commit_log") or str(Path(scratch) / "commits.jsonl")
            writer = df.write.format(HaFailoverDataSource.name()).mode("append")
            options = {**self._given, "sink_id": sink_id, "batch_id": str(batch_id)}
            options["commit_log"] = commit_log
            for name, value in options.items():
                writer = writer.option(name, value)
            writer.save()
            last = Path(commit_log).read_text(encoding="utf-8").splitlines()[-1]
        report = BatchReport(**json.loads(last))
        self.last_report = report
        return report
