"""hafailover.spark: write DataFrames and streams to a queue or topic, exactly once.

Install with the ``spark`` extra (PySpark 4.1 or later, pyarrow). ``import hafailover``
never imports this package; this package imports PySpark.

    from hafailover.spark import register
    register(spark)
    df.write.format("hafailover").option("url", url).option("destination", "queue://q").save()

See docs/spark.md for the columns, the options and what "exactly once" rests on.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401 - the writers receive Arrow record batches
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "hafailover.spark needs PySpark and pyarrow: pip install 'hafailover[spark]'"
    ) from exc

from hafailover.spark._options import DeliveryGuarantee, SinkOptions
from hafailover.spark._report import BatchReport, SinkCommit
from hafailover.spark._worker import PartitionResult, close_connections
from hafailover.spark.datasource import HaFailoverDataSource, register
from hafailover.spark.foreach_batch import ForeachBatchSink

__all__ = [
    "BatchReport",
    "DeliveryGuarantee",
    "ForeachBatchSink",
    "HaFailoverDataSource",
    "PartitionResult",
    "SinkCommit",
    "SinkOptions",
    "close_connections",
    "register",
]
