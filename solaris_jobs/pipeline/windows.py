"""The log's time windows as Spark transforms: the events a step may read for a cutoff T (valid, before T, within
the lookback), the rows of the last hours before T, the users active in them and the pairs ranked in them, and
the union that merges parts of one shape.

Time: a run prepares interval ``[start, end)`` after it closes; T = ``end`` is the cutoff. Everything is computed
from events with ``event_timestamp < T`` (and ``>= T - lookback_days`` where a bound is set).
"""
from __future__ import annotations

import functools

import pandas as pd

from solaris_jobs.core.events import to_utc


def split_bad_events(events):
    """Splits events into (good, bad); bad rows get a ``reason`` (null or non-positive id, null time, label
    other than 0/1/null). Logs written by SOLARIS never have them; logs written by other pipelines may."""
    from pyspark.sql import functions as F

    from solaris_jobs.core.events import BAD_EVENT_REASONS as R
    reason = (F.when(F.col("user_id").isNull() | (F.col("user_id") <= 0), F.lit(R[0]))
              .when(F.col("item_id").isNull() | (F.col("item_id") <= 0), F.lit(R[1]))
              .when(F.col("event_timestamp").isNull(), F.lit(R[2]))
              .when(F.col("label").isNotNull() & ~F.col("label").isin(0, 1), F.lit(R[3])))
    marked = events.withColumn("reason", reason)
    return marked.where(F.col("reason").isNull()).drop("reason"), marked.where(F.col("reason").isNotNull())


# The event columns the steps read (the log's others, ``request_id`` and the logged ``vm_score``, are not cached).
PRIOR_COLS = ("user_id", "item_id", "event_timestamp", "label", "rating")


def lookback_start(cutoff, lookback_days: float | None) -> pd.Timestamp | None:
    """The first event time the lookback of ``cutoff`` holds, in whole microseconds as the log's times are (None:
    the whole log)."""
    if lookback_days is None:
        return None
    return pd.Timestamp(pd.Timestamp(cutoff).to_pydatetime() - pd.Timedelta(days=lookback_days).to_pytimedelta())


def prior_events(events, cutoff, lookback_days: float | None):
    """Valid events strictly before ``cutoff`` (and not older than ``lookback_days``), ``PRIOR_COLS`` only; see
    ``split_bad_events`` for what is set aside (the selection job counts and writes those)."""
    from pyspark.sql import functions as F
    out = split_bad_events(events)[0].where(F.col("event_timestamp") < F.lit(pd.Timestamp(cutoff).to_pydatetime()))
    first = lookback_start(cutoff, lookback_days)
    if first is not None:
        out = out.where(F.col("event_timestamp") >= F.lit(first.to_pydatetime()))
    return out.select(*PRIOR_COLS)


def read_from(cutoff, lookback_days: float | None, start=None) -> pd.Timestamp | None:
    """The earliest event time a step reads for ``cutoff``: the lookback's start (None: the whole log), or the
    interval's ``start`` when that is earlier (the selection sets the interval's bad rows aside)."""
    first = lookback_start(cutoff, lookback_days)
    if first is None:
        return None
    return min(first, to_utc(start)) if start is not None else first


def last_hours(events, cutoff, hours: float):
    """The rows of ``events`` with ``event_timestamp`` in ``[cutoff - hours, cutoff)`` (those before ``cutoff``:
    the caller's ``prior_events``)."""
    from pyspark.sql import functions as F
    first = pd.Timestamp(cutoff).to_pydatetime() - pd.Timedelta(hours=hours).to_pytimedelta()
    return events.where(F.col("event_timestamp") >= F.lit(first))


def union_all(parts):
    """The union by column name of DataFrames of one shape."""
    return functools.reduce(lambda a, b: a.unionByName(b), parts)


def active_users(prior, cutoff, hours: float, misses=None):
    """Users with an event in ``[cutoff - hours, cutoff)``, plus users of recorded misses."""
    users = last_hours(prior, cutoff, hours).select("user_id")
    if misses is not None:
        users = users.unionByName(misses.select("user_id"))
    return users.distinct()


def recent_pairs(prior, cutoff, hours: float):
    """Pairs ranked for their user in ``[cutoff - hours, cutoff)``: (user_id, item_id, last_seen), the time of the
    pair's latest ranking. A user's rankings stay stable over short periods, so these come back soon."""
    from pyspark.sql import functions as F
    return last_hours(prior, cutoff, hours).groupBy("user_id", "item_id").agg(
        F.max("event_timestamp").alias("last_seen"))

