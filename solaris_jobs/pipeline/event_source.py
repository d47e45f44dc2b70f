"""Where a refresh reads its events from: the hour-partitioned log under a data root (``EventLog``, the default),
or events already read (``EventTable``: a pyarrow table, a pandas frame or a Spark DataFrame), so that a replay
reads the log once and runs many intervals over it.

Both give the same rows for the same bounds (``start <= event_timestamp < end``), to Spark (``spark``) and to the
steps outside Spark (``table``, sorted by time, user, item like ``events.read_events``).
"""
from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.compute as pc

from solaris_jobs.core import events as ev


class EventLog:
    """The event log under a data root, read on each call (only the days an interval's bounds need)."""

    def __init__(self, root: str | os.PathLike):
        self.root = str(root)

    def describe(self) -> str:
        return f"{self.root}/events"

    def spark(self, spark, start=None, end=None):
        from solaris_jobs.pipeline.spark import read_events_df
        return read_events_df(spark, self.root, start, end)

    def table(self, start=None, end=None, columns: list[str] | None = None) -> pa.Table:
        return ev.read_events(self.root, start, end, columns)

    def fingerprints(self, ranges) -> list[str]:
        """For each ``(start, end)``, what the rows of those hours are, to tell later whether they changed: a
        digest of the log's files there, all from one listing (``events.log_fingerprints``)."""
        return ["log:" + d for d in ev.log_fingerprints(self.root, ranges)]


class EventTable:
    """Events already read: a pyarrow Table or pandas DataFrame (conformed to the event contract), or a Spark
    DataFrame with the contract's columns. The Spark copy of an Arrow table is made once and cached."""

    def __init__(self, events, name: str = "<events in memory>"):
        self.name = name
        # Events in memory do not change, but another table may come under the same name: only this object's
        # own earlier reads are known to be these rows.
        self.token = uuid.uuid4().hex
        self._arrow: pa.Table | None = None
        self._df = None
        if hasattr(events, "sparkSession"):
            self._df = events.select(*ev.EVENT_SCHEMA.names)
        else:
            self._arrow = ev.conform(events, name, allow_nulls=True)

    def describe(self) -> str:
        return self.name

    def spark(self, spark, start=None, end=None):
        from pyspark.sql import functions as F
        if self._df is None:
            from solaris_jobs.pipeline.spark import parallelism
            # One partition per core: Arrow's record batches would otherwise become hundreds of small partitions
            # (10,000 rows each), and every step that scans the cached events pays a task per batch.
            self._df = spark.createDataFrame(self._arrow).coalesce(parallelism(spark)).cache()
        df = self._df
        if start is not None:
            df = df.where(F.col("event_timestamp") >= F.lit(ev.to_utc(start).to_pydatetime()))
        if end is not None:
            df = df.where(F.col("event_timestamp") < F.lit(ev.to_utc(end).to_pydatetime()))
        return df

    def fingerprints(self, ranges) -> list[str]:
        """This table's rows are fixed: the same token for any bounds, valid in this process only."""
        return ["table:" + self.token for _ in ranges]

    def unpersist(self) -> None:
        """Drops the cached Spark copy of an Arrow table (a replay calls this when it is done)."""
        if self._df is not None and self._arrow is not None:
            self._df.unpersist()
            self._df = None

    def table(self, start=None, end=None, columns: list[str] | None = None) -> pa.Table:
        if self._arrow is None:
            t = ev.conform(self.spark(None, start, end).toArrow(), self.name, allow_nulls=True)
        else:
            t = self._arrow
            ts = ev.EVENT_SCHEMA.field("event_timestamp").type
            mask = None
            if start is not None:
                mask = pc.greater_equal(t["event_timestamp"], pa.scalar(ev.to_utc(start).to_pydatetime(), ts))
            if end is not None:
                m = pc.less(t["event_timestamp"], pa.scalar(ev.to_utc(end).to_pydatetime(), ts))
                mask = m if mask is None else pc.and_(mask, m)
            if mask is not None:
                t = t.filter(mask)
        t = t.sort_by([("event_timestamp", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")])
        return t.select(columns) if columns else t


def event_source(events, root=None) -> EventLog | EventTable:
    """An event source from a data root, a table or DataFrame of events, or an event source (returned as is);
    None: the log under ``root``."""
    if events is None:
        events = root
    if isinstance(events, (EventLog, EventTable)):
        return events
    if isinstance(events, (str, os.PathLike)):
        return EventLog(events)
    return EventTable(events)
