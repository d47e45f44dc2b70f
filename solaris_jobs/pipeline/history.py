"""The interval state's transforms: every user's last events (``user_histories``, the FM's input), the user and
item counters (the VM's and the FM's), each made from the lookback's events or updated from the previous
interval's with the events since.
"""
from __future__ import annotations

import pandas as pd

from solaris_jobs.pipeline.windows import union_all

USER_COUNTER_COLS = [f"user_{k}" for k in ("cnt", "known", "pos")]
ITEM_COUNTER_COLS = [f"item_{k}" for k in ("cnt", "known", "pos")]
COUNTER_COLS = USER_COUNTER_COLS + ITEM_COUNTER_COLS
HIST_COLS = ["hist_ts", "hist_item", "hist_label", "hist_rating"]


def hide_recent_labels(events, T: pd.Timestamp, delay_minutes: float):
    """``events`` with the label and rating of those at or after ``T - delay_minutes`` set to null: what the log
    knows at T when an event's label arrives ``delay_minutes`` after it (its impression at once)."""
    from pyspark.sql import functions as F
    if not delay_minutes:
        return events
    recent = F.col("event_timestamp") >= F.lit((T - pd.Timedelta(minutes=delay_minutes)).to_pydatetime())
    return events.withColumns({c: F.when(recent, F.lit(None).cast(events.schema[c].dataType)).otherwise(F.col(c))
                               for c in ("label", "rating")})


def counters(prior):
    """Per-user and per-item (events, labelled events, positives) before T: the VM's and FM's counters, as exact
    integer counts (the models read them as float32)."""
    from pyspark.sql import functions as F

    def agg(key, prefix):
        return prior.groupBy(key).agg(F.count("*").alias(f"{prefix}_cnt"),
                                      F.count("label").alias(f"{prefix}_known"),
                                      F.sum(F.when(F.col("label") == 1, 1).otherwise(0)).cast("long")
                                      .alias(f"{prefix}_pos"))
    return agg("user_id", "user"), agg("item_id", "item")


def merge_counters(prev, new, expired=None):
    """The counters at T from those at the previous cutoff: ``prev`` + the counters of the events since - those of
    the events that left the lookback (``expired``, None: nothing left), keys whose count fell to 0 dropped; equal
    to ``counters`` of the lookback's events. All three: (key, <prefix>_cnt, _known, _pos), one ``counters`` side."""
    from pyspark.sql import functions as F
    key, *cols = prev.columns
    parts = [prev, new.select(key, *cols)]
    if expired is not None:
        parts.append(expired.select(key, *[(-F.col(c)).alias(c) for c in cols]))
    both = union_all(parts)
    return both.groupBy(key).agg(*[F.sum(c).cast("long").alias(c) for c in cols]).where(F.col(cols[0]) > 0)


def with_counters(pairs, user_counts, item_counts):
    zero = {f"{p}_{k}": 0 for p in ("user", "item") for k in ("cnt", "known", "pos")}
    return pairs.join(user_counts, "user_id", "left").join(item_counts, "item_id", "left").fillna(zero)


def user_histories(prior, history_len: int):
    """Each user's last ``history_len`` events before T as parallel arrays sorted by time (oldest first): the last
    in the order of the arrays themselves (time, item, label (null: -1), rating (as int, null: 0)), so that the
    history at T is the last of the history at an earlier cutoff and the events since (``merge_histories``)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    fields = {"ts": F.unix_micros("event_timestamp"), "item": F.col("item_id"),
              "label": F.coalesce(F.col("label").cast("int"), F.lit(-1)),
              "rating": F.coalesce(F.col("rating").cast("int"), F.lit(0))}
    cols = prior.select("user_id", *[v.alias(k) for k, v in fields.items()])
    w = Window.partitionBy("user_id").orderBy(*[F.desc(k) for k in fields])
    last = cols.withColumn("k", F.row_number().over(w)).where(F.col("k") <= history_len)
    rows = F.sort_array(F.collect_list(F.struct(*fields)))
    return last.groupBy("user_id").agg(rows.alias("h")).select(
        "user_id", *[F.col("h")[f].alias(f"hist_{f}") for f in ("ts", "item", "label", "rating")])


def interval_state(prior, history_len: int):
    """The interval's state rebuilt from the lookback's events: (``user_histories``, user counters, item
    counters)."""
    return (user_histories(prior, history_len), *counters(prior))


def merge_histories(prev, new_events, history_len: int, since=None, until=None):
    """Every user's history at T from the histories at the previous cutoff (``user_histories`` there) and the
    events since, all later than any event of ``prev``: the user's last ``history_len`` of both, the new events'
    own ordering as ``user_histories``'s. ``since``: entries of ``prev`` older than it (they left the lookback) are
    dropped first; ``until``: entries of ``prev`` at or after it are dropped too (``new_events`` holds them again,
    with the labels that arrived since); users left with none get no row. Equal to ``user_histories`` of all the
    lookback's events: a user's history at the previous cutoff holds every one of their events more recent than its
    oldest entry."""
    from pyspark.sql import functions as F
    L = int(history_len)
    new = user_histories(new_events, L)
    old = prev.select("user_id", *[F.col(c).alias(f"_o{c}") for c in HIST_COLS])
    if since is not None or until is not None:
        us = lambda t: F.lit(pd.Timestamp(t).value // 1000)
        # Each array is sorted by time: the entries that left the lookback are a prefix, those re-read a suffix.
        n_out = F.size(F.filter("_ohist_ts", lambda x: x < us(since))) if since is not None else F.lit(0)
        n_to = F.size(F.filter("_ohist_ts", lambda x: x < us(until))) if until is not None else F.lit(L)
        n_keep = F.greatest(n_to - n_out, F.lit(0))
        old = old.select("user_id", *[F.when(n_keep > 0, F.slice(f"_o{c}", n_out + 1, n_keep))
                                      .otherwise(F.array().cast(prev.schema[c].dataType)).alias(f"_o{c}")
                                      for c in HIST_COLS])
    both = old.join(new, "user_id", "full_outer")
    types = dict(new.dtypes)
    empty = {c: F.array().cast(types[c]) for c in HIST_COLS}
    n_new = F.size(F.coalesce(F.col("hist_ts"), empty["hist_ts"]))
    n_old = F.size(F.coalesce(F.col("_ohist_ts"), empty["hist_ts"]))
    keep = F.least(n_old, F.lit(L) - n_new)
    merged = both.select("user_id", *[F.concat(F.slice(F.coalesce(F.col(f"_o{c}"), empty[c]), n_old - keep + 1, keep),
                                               F.coalesce(F.col(c), empty[c])).alias(c) for c in HIST_COLS])
    return merged.where(F.size("hist_ts") > 0)
