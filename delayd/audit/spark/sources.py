"""PySpark data sources for the delay server's logs (pyspark >= 4, the ``audit`` extra).

    spark.read.format("delayd.schedule_log").load("/var/lib/delayd")
    spark.read.format("delayd.dispatch_log").option("server", "eu-1").load(path)
    spark.read.format("delayd.message_log").load(path)

``path`` is a data directory (the ``--data`` of ``delayd serve``). Each file — a
schedule_log or dispatch_log bucket, a message_log segment — is read whole by one task,
up to the size it had when the query was planned. With ``partitionBytes=0`` every file
is an input partition of its own; by default small files are packed into partitions of
about 64 MiB (partitions.pack says why). Readers yield Arrow record batches
decoded by read/messages.py and read/dispatch.py, which use the logs' own codecs. Problems
are rows too (``problem``, ``detail``; see schemas.py): a damaged file never fails the
query, and nothing is dropped without a row saying so.

A narrower schema, ``.schema("bucket timestamp, offset long, problem string")``, reads
only those columns (``problem`` must be one of them); Python data sources have no
column pruning of their own, and converting columns nobody reads costs as much as
decoding them.

Options: ``server`` (default: the path as given) fills the ``server`` column, so that
several data directories can be read into one table; ``verify`` is ``head`` (default)
or ``full`` (decode every record with the codec, properties included; slower);
``partitionBytes`` as above; ``minPartitions`` (default 1): pack smaller partitions, down
to 4 MiB, when ``partitionBytes`` would leave fewer than that many — the job passes
Spark's default parallelism, so that every core has files to read
(partitions.split_bytes); ``files``, comma-separated file names, reads only those files
of the log.

``delayd.reconciled`` is what the audit job reads (judge/bucket_runs.py): each bucket's
schedule_log and dispatch_log files read by one task and reconciled there: the buckets'
counts, findings and problems, and what crosses buckets (schemas.RECONCILED; no narrower
schema). Its options: ``cutoffMs`` and ``lateMs`` (required: what is judged
and what is late, config.AuditConfig), ``records`` (rows per record too:
bucket_runs.RECORD_MODES), ``verify``, ``partitionBytes`` (a bucket's two files count
together), ``files`` (bucket names: the audit reads again the few buckets that hold
candidates of duplicate ids).

The files are read with plain file I/O where the tasks run: on a cluster every
executor must see the data directories at the same path (a shared mount), and have
delayd installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from delayd.audit import schemas
from delayd.audit.judge.bucket_runs import NONE, RECORD_MODES, reconciled_batches
from delayd.audit.judge.pairing import BucketFiles, bucket_pairs
from delayd.audit.kinds import HEAD, VERIFY_MODES
from delayd.audit.read import partitions
from delayd.audit.read.batches import ReadOptions
from delayd.audit.read.dispatch import dispatch_batches
from delayd.audit.read.messages import message_batches, schedule_batches
from delayd.logs import log_files
from delayd.logs.log_files import LogFile
from delayd.replay.recovery import scanned_buckets
from storage.fs import REAL_FS

FORMAT_PREFIX = "delayd."


class FilesPartition(InputPartition):
    """Log files (or buckets' pairs of them) read by one task, with the sizes they had
    when the query was planned."""

    def __init__(self, log_files: list[LogFile] | list[BucketFiles]) -> None:
        super().__init__(log_files)
        self.files = log_files


@dataclass(frozen=True)
class _Options:
    """What a read was asked for (the options of the module docstring, checked)."""

    data_dir: str
    server: str
    verify: str
    partition_bytes: int
    min_partitions: int
    columns: list[str]
    only: frozenset[str] | None  # the ``files`` option: these file names, or all

    @classmethod
    def parse(cls, name: str, options: Mapping[str, str], columns: list[str]) -> _Options:
        """Raises ValueError naming the source and the option."""
        path = options.get("path")
        if not path:
            raise ValueError(f"{name}: give the data directory: .load(PATH)")
        verify = options.get("verify", HEAD)
        if verify not in VERIFY_MODES:
            raise ValueError(f"{name}: verify must be one of {', '.join(VERIFY_MODES)}")
        try:
            partition_bytes = int(options.get("partitionBytes", partitions.DEFAULT_PARTITION_BYTES))
        except ValueError:
            raise ValueError(f"{name}: partitionBytes must be a number of bytes") from None
        try:
            min_partitions = int(options.get("minPartitions", 1))
        except ValueError:
            raise ValueError(f"{name}: minPartitions must be a number") from None
        only = options.get("files")
        return cls(
            data_dir=path,
            server=options.get("server") or path,
            verify=verify,
            partition_bytes=partition_bytes,
            min_partitions=min_partitions,
            columns=columns,
            only=None if only is None else frozenset(n for n in only.split(",") if n),
        )

    def pack(self, files: list[partitions.Part]) -> list[list[partitions.Part]]:
        """``files`` as input partitions: packed up to ``partitionBytes``, less when
        that leaves fewer than ``minPartitions`` (partitions.split_bytes)."""
        target = partitions.split_bytes(files, self.partition_bytes, self.min_partitions)
        return partitions.pack(files, target)


def list_log(data_dir: str, log: str) -> list[LogFile]:
    """The files of ``log`` in ``data_dir``, listed on the driver, each with what its
    damage is judged by as recovery judges it: for schedule_log, the buckets the
    replayer's recovery would scan (delayd.logs.log_files says why)."""
    scanned = scanned_buckets(REAL_FS, data_dir) if log == log_files.SCHEDULE_LOG else None
    return log_files.list_files(data_dir, log, REAL_FS, scanned)


class _LogReader(DataSourceReader):
    """Lists a log's files on the driver; decodes them on the executors."""

    def __init__(
        self, log: str, options: _Options, decode: Callable[..., Iterator[pa.RecordBatch]]
    ) -> None:
        self.log = log
        self.options = options
        self.decode = decode

    def partitions(self) -> list[InputPartition]:
        listed = list_log(self.options.data_dir, self.log)
        if self.options.only is not None:
            listed = [f for f in listed if f.name in self.options.only]
        return [FilesPartition(group) for group in self.options.pack(listed)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        options = self.options
        read = ReadOptions(options.verify, columns=options.columns)
        # Spark runs one empty partition when there are no files.
        for file in getattr(partition, "files", ()):
            yield from self.decode(file, options.server, read)


class _LogSource(DataSource):
    """The part common to the three sources; subclasses name the log and its reader."""

    log: str
    arrow_schema: pa.Schema
    decode: Callable[..., Iterator[pa.RecordBatch]]

    @classmethod
    def name(cls) -> str:
        return FORMAT_PREFIX + cls.log

    def schema(self) -> StructType:
        return spark_schema(self.arrow_schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        """``schema`` is the source's own, or the narrower one given with
        ``.schema(...)``: only its columns are decoded and sent to Spark."""
        columns = schema.fieldNames()
        try:
            wanted = spark_schema(schemas.select(self.arrow_schema, columns))
        except ValueError as exc:
            raise ValueError(f"{self.name()}: {exc}") from None
        if wanted != schema:
            raise ValueError(
                f"{self.name()}: the columns have these types: {wanted.simpleString()}"
            )
        options = _Options.parse(self.name(), self.options, columns)
        return _LogReader(self.log, options, type(self).decode)


class ScheduleLogSource(_LogSource):
    """``delayd.schedule_log``: one row per SCHEDULED record (schemas.SCHEDULE_LOG)."""

    log = log_files.SCHEDULE_LOG
    arrow_schema = schemas.SCHEDULE_LOG
    decode = staticmethod(schedule_batches)


class DispatchLogSource(_LogSource):
    """``delayd.dispatch_log``: one row per entry (schemas.DISPATCH_LOG)."""

    log = log_files.DISPATCH_LOG
    arrow_schema = schemas.DISPATCH_LOG
    decode = staticmethod(dispatch_batches)


class MessageLogSource(_LogSource):
    """``delayd.message_log``: one row per record, message or tombstone (schemas.MESSAGE_LOG)."""

    log = log_files.MESSAGE_LOG
    arrow_schema = schemas.MESSAGE_LOG
    decode = staticmethod(message_batches)


SOURCES = {
    source.log: source for source in (ScheduleLogSource, DispatchLogSource, MessageLogSource)
}


class _ReconciledReader(DataSourceReader):
    """Pairs the two logs' files by bucket on the driver; reads and reconciles each run
    of buckets on the executors."""

    def __init__(self, options: _Options, cutoff_ms: int, late_ms: int, records: str) -> None:
        self.options = options
        self.cutoff_ms = cutoff_ms
        self.late_ms = late_ms
        self.records = records

    def partitions(self) -> list[InputPartition]:
        data_dir = self.options.data_dir
        buckets = bucket_pairs(
            list_log(data_dir, log_files.SCHEDULE_LOG), list_log(data_dir, log_files.DISPATCH_LOG)
        )
        if self.options.only is not None:
            buckets = [b for b in buckets if b.name in self.options.only]
        return [FilesPartition(group) for group in self.options.pack(buckets)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # Spark runs one empty partition when there are no files.
        yield from reconciled_batches(
            getattr(partition, "files", []),
            cutoff_ms=self.cutoff_ms,
            late_ms=self.late_ms,
            verify=self.options.verify,
            records=self.records,
        )


class ReconciledSource(DataSource):
    """``delayd.reconciled``: every bucket's records judged where its two files are read
    (judge/bucket_runs.py; schemas.RECONCILED)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_PREFIX + "reconciled"

    def schema(self) -> StructType:
        return spark_schema(schemas.RECONCILED)

    def reader(self, schema: StructType) -> DataSourceReader:
        if schema != self.schema():
            raise ValueError(f"{self.name()}: takes no schema of its own")
        options = _Options.parse(self.name(), self.options, schema.fieldNames())
        try:
            cutoff_ms, late_ms = (int(self.options[name]) for name in ("cutoffMs", "lateMs"))
        except (KeyError, ValueError):
            raise ValueError(f"{self.name()}: give cutoffMs and lateMs, in ms") from None
        records = self.options.get("records", NONE)
        if records not in RECORD_MODES:
            raise ValueError(f"{self.name()}: records must be one of {', '.join(RECORD_MODES)}")
        return _ReconciledReader(options, cutoff_ms, late_ms, records)


def spark_schema(arrow_schema: pa.Schema) -> StructType:
    """The Spark schema of a source (TimestampType for the UTC bucket timestamp)."""
    return from_arrow_schema(arrow_schema, prefer_timestamp_ntz=False)


def register(spark: SparkSession) -> None:
    """Make the formats available to ``spark.read.format(...)``."""
    for source in (*SOURCES.values(), ReconciledSource):
        spark.dataSource.register(source)
