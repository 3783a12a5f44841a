"""How the job asks Spark: DataFrame methods with SQL expressions as text.

Every Column built in Python (``F.col``, ``==``, ``F.when``, …) is a round trip to the
JVM, and ``F.col`` alone is about ten of them: a query written with ``functions`` costs
hundreds, about a millisecond each on a small machine, on the driver, between Spark
jobs — an audit of a small directory is mostly such gaps. ``selectExpr("a + 1 AS b")``
and ``where("a > 1")`` are one call each.

Not ``spark.sql(text, rows=frame)``: it names ``frame`` as a temporary view for the
query and drops the view afterwards, which uncaches ``frame`` if it is cached — and the
job's records are.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

IN_LIST_ROWS = 10_000  # up to this many values are written into the query (where_in)


def literal(text: str) -> str:
    """``text`` as a Spark SQL string literal (quotes and backslashes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def where_in(spark: SparkSession, frame: DataFrame, column: str, values: pa.Array) -> DataFrame:
    """The rows of ``frame`` whose ``column`` (integers) is one of ``values``: a filter
    with the values written in when they are few, else a semi join with them sent to
    every task."""
    if len(values) <= IN_LIST_ROWS:
        listed = ", ".join(str(int(v)) for v in values.to_pylist()) or "NULL"
        return frame.where(f"{column} IN ({listed})")
    wanted = spark.createDataFrame(pa.table({column: values}))
    # A join on a column name puts that column first: keep the frame's order.
    return frame.join(F.broadcast(wanted), column, "left_semi").select(*frame.columns)


def fetch(frame: DataFrame) -> pa.Table:
    """``frame`` computed and brought to the driver, every column nullable (Spark marks
    literals and some keys not null, which Arrow would not let mix with other tables)."""
    table = frame.toArrow()
    return table.cast(pa.schema([field.with_nullable(True) for field in table.schema]))
