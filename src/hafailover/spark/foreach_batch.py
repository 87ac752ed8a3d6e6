"""The foreachBatch helper: ``query.foreachBatch(ForeachBatchSink(url, destination))``.

For users who prefer ``foreachBatch`` (to write one micro-batch to several sinks, say).
Each call writes the batch's partitions with the same worker code as the data source, so
the guarantee is the same: a row's duplicate id derives from the sink id, the batch id
Spark passes in, and the row's key or position. The partition writers report back to this
driver process, which logs the batch's summary and returns it as a ``BatchReport``.

The sink id defaults to the streaming query's id (kept in its checkpoint, so the same
after a restart); outside a streaming query give ``sink_id``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING

import pyarrow as pa

from hafailover.errors import ConfigurationError
from hafailover.spark._options import SinkOptions
from hafailover.spark._report import BatchReport, log_report
from hafailover.spark._rows import ColumnPlan, plan_columns
from hafailover.spark._worker import QUERY_ID_PROPERTY, PartitionResult, write_partition

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["ForeachBatchSink"]

_RESULT_SCHEMA = "result string"


def _write_partitions(
    options: SinkOptions,
    plan: ColumnPlan,
    sink_id: str,
    batch_id: str,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    result = write_partition(batches, options, plan, sink_id, batch_id)
    yield pa.record_batch([pa.array([json.dumps(asdict(result))])], names=["result"])


class ForeachBatchSink:
    """A ``foreachBatch`` function that sends every row of each micro-batch exactly once.

    Options are the data source's, as keyword arguments (``sink_id``, ``key_column``,
    ``heartbeat``, ...); they are checked here, before the query starts.
    """

    def __init__(
        self, url: str, destination: str | None = None, **options: str | int | float
    ) -> None:
        given: dict[str, str] = {k: str(v) for k, v in options.items()}
        given["url"] = url
        if destination is not None:
            given["destination"] = destination
        self.options = SinkOptions.parse(given)
        self.last_report: BatchReport | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> BatchReport:
        plan = plan_columns(df.schema, self.options)
        sink_id = self.options.sink_id or df.sparkSession.sparkContext.getLocalProperty(
            QUERY_ID_PROPERTY
        )
        if not sink_id:
            raise ConfigurationError(
                "no streaming query id to use as the sink id: outside a streaming query "
                "give ForeachBatchSink(..., sink_id=...)"
            )
        write = functools.partial(_write_partitions, self.options, plan, sink_id, str(batch_id))
        rows = df.mapInArrow(write, _RESULT_SCHEMA).collect()
        results = [PartitionResult(**json.loads(row["result"])) for row in rows]
        report = BatchReport.from_results(
            results, committed=True, batch_id=str(batch_id), sink_id=sink_id
        )
        log_report(report, self.options.commit_log, in_worker=False)
        self.last_report = report
        return report
