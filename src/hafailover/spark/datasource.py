"""The Python Data Source ``hafailover``: batch and streaming writers (Spark 4.1+).

Spark creates the data source and its writer on the driver (in a Python process of its
own), where the options and the DataFrame's columns are checked, so a bad option or column
fails ``save()`` or the query's start before any task sends a message. The writer is then
pickled to the executors, where each task writes its partition through the worker's shared
connection (``_worker``) and returns a ``SinkCommit``; the driver logs the batch's summary
in ``commit``/``abort``.

Batch ids: a streaming task reads its micro-batch id from the task's local properties (the
stream writer's ``write`` is not given it). A batch write's rows are numbered under the
``batch_id`` option (the foreachBatch helper passes Spark's) or ``write``, and a sink id that
is fresh per ``save()`` unless the ``sink_id`` option names one, in which case running the
same write again is dropped by the broker as a duplicate (a rerun of a failed job completes
it without duplicating).

The writers use the Arrow variants: rows reach ``write`` as Arrow record batches, converted
column by column, which is several times cheaper than Spark's Row objects.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from hafailover.errors import ConfigurationError, IllegalStateError
from hafailover.spark._options import SinkOptions
from hafailover.spark._report import (
    BatchReport,
    SinkCommit,
    log_report,
    warn_if_order_matters,
    warn_if_retention_unknown,
)
from hafailover.spark._rows import ColumnPlan, plan_columns
from hafailover.spark._worker import BATCH_ID_PROPERTY, QUERY_ID_PROPERTY, local_property
from hafailover.spark._worker import write_partition as _write_partition

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["BATCH_WRITE_ID", "HaFailoverDataSource", "register"]

# The batch id of a (non-streaming) batch write's rows.
BATCH_WRITE_ID = "write"


class HaFailoverDataSource(DataSource):
    """``format("hafailover")``: writes each row as one persistent message."""

    @classmethod
    def name(cls) -> str:
        return "hafailover"

    def _checked(self, schema: StructType) -> tuple[SinkOptions, ColumnPlan]:
        options = SinkOptions.parse(self.options)
        plan = plan_columns(schema, options)
        warn_if_order_matters(options, plan)
        warn_if_retention_unknown(options)
        return options, plan

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        if overwrite:
            raise ConfigurationError(
                'mode "overwrite" cannot apply to a message destination: sent messages '
                'cannot be taken back; use mode "append"'
            )
        options, plan = self._checked(schema)
        # Short: the id is part of every message's duplicate id, which the window weighs.
        sink_id = options.sink_id or f"w{uuid.uuid4().hex[:16]}"
        return BatchWriter(options, plan, sink_id)

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:  # noqa: N802 - Spark's name
        # "overwrite" is set in complete output mode: every batch then sends the whole
        # result again, as new messages (as Spark's Kafka sink does).
        options, plan = self._checked(schema)
        if options.batch_id is not None:
            raise ConfigurationError(
                'option "batch_id" is for batch writes: a streaming query numbers its batches'
            )
        return StreamWriter(options, plan)


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("hafailover")``: one job, every task sends its partition."""

    def __init__(self, options: SinkOptions, plan: ColumnPlan, sink_id: str) -> None:
        self.options = options
        self.plan = plan
        self.sink_id = sink_id
        self.batch_id = options.batch_id or BATCH_WRITE_ID

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:
        return SinkCommit(
            _write_partition(iterator, self.options, self.plan, self.sink_id, self.batch_id)
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        report = BatchReport.from_commits(messages, committed=True, batch_id=self.batch_id)
        log_report(report, self.options.commit_log, in_worker=True)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        report = BatchReport.from_commits(messages, committed=False, batch_id=self.batch_id)
        log_report(report, self.options.commit_log, in_worker=True)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("hafailover")``: every micro-batch as one batch of sends."""

    def __init__(self, options: SinkOptions, plan: ColumnPlan) -> None:
        self.options = options
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:
        batch_id = local_property(BATCH_ID_PROPERTY)
        if batch_id is None:
            raise IllegalStateError(
                f"no micro-batch id in the task's local property {BATCH_ID_PROPERTY!r}: "
                "the hafailover stream writer runs in micro-batch queries only"
            )
        sink_id = self.options.sink_id or local_property(QUERY_ID_PROPERTY)
        if sink_id is None:
            raise IllegalStateError(
                f"no query id in the task's local property {QUERY_ID_PROPERTY!r}: "
                'give the sink a stable .option("sink_id", ...)'
            )
        return SinkCommit(_write_partition(iterator, self.options, self.plan, sink_id, batch_id))

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        report = BatchReport.from_commits(messages, committed=True, batch_id=str(batchId))
        log_report(report, self.options.commit_log, in_worker=True)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        report = BatchReport.from_commits(messages, committed=False, batch_id=str(batchId))
        log_report(report, self.options.commit_log, in_worker=True)


def register(spark: SparkSession) -> None:
    """Make ``format("hafailover")`` available in this Spark session."""
    spark.dataSource.register(HaFailoverDataSource)
