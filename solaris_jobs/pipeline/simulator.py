"""The request simulator in Spark: what ``solaris_jobs.data.requests.RequestSimulator`` gives each active user
(co-visitation with the user's latest items, then recent popularity), and the state that lets the next interval
update it instead of recounting: the lookback's co-visit counts and each user's latest items (seeds).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from solaris_jobs.core.settings import SimulatorConfig
from solaris_jobs.pipeline.windows import last_hours, union_all

# A partition of the simulated sets' step holds at most about this many co-visit rows in memory.
SETS_ROWS = 4_000_000


def popular_items(prior, cutoff, cfg: SimulatorConfig, totals=None):
    """The ``n_candidates`` most popular items (small: one row per item), as ``RequestSimulator.popular``.
    ``totals``: (item_id, count) of the whole lookback when the caller has them (the item counters); ``prior`` then
    needs to hold only the last ``popularity_hours``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    recent = last_hours(prior, cutoff, cfg.popularity_hours)
    totals = prior.groupBy("item_id").count() if totals is None else totals.select("item_id", "count")
    counts = recent.groupBy("item_id").count().withColumn("tier", F.lit(0)).unionByName(
        totals.withColumn("tier", F.lit(1)))
    first = Window.partitionBy("item_id").orderBy("tier")
    order = Window.orderBy("tier", F.desc("count"), "item_id")
    return (counts.withColumn("k", F.row_number().over(first)).where("k = 1")
            .withColumn("rank", F.row_number().over(order) - 1).where(F.col("rank") < cfg.n_candidates)
            .select("item_id", "rank"))


def covisit_counts(events, window: int, later: str | None = None, earlier: str | None = None):
    """How often each ordered (seed, item_id) pair of distinct items is co-visited: both directions of every pair of
    a user's events within ``window`` positions when ordered by (time, item). Events with equal time and item are
    the same item, so the pairs do not depend on how such ties are broken.

    Args:
        events: (user_id, item_id, event_timestamp) and the columns named below.
        later: a boolean column: only pairs whose later event has it true (the pairs a new hour adds).
        earlier: a boolean column: only pairs whose earlier event has it true (the pairs an hour leaving takes).

    Returns:
        (seed, item_id, count).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    w = Window.partitionBy("user_id").orderBy("event_timestamp", "item_id")
    ks = range(1, window + 1)
    lagged = events.select("item_id", *([later] if later else []),
                           *[F.lag("item_id", k).over(w).alias(f"_lag{k}") for k in ks],
                           *([F.lag(earlier, k).over(w).alias(f"_ok{k}") for k in ks] if earlier else []))
    if later:
        lagged = lagged.where(F.col(later))

    def pair(a, b, k):
        ok = [F.coalesce(F.col(f"_ok{k}"), F.lit(False)).alias("ok")] if earlier else []
        return F.struct(F.col(a).alias("seed"), F.col(b).alias("item_id"), *ok)
    # Both directions of every pair from one pass over the sorted events (a union of two projections would sort
    # and window the events twice).
    both = F.array(*[pair(a, b, k) for k in ks for a, b in (("item_id", f"_lag{k}"), (f"_lag{k}", "item_id"))])
    pairs = (lagged.select(F.explode(both).alias("p")).select("p.*")
             .where(F.col("seed").isNotNull() & F.col("item_id").isNotNull() & (F.col("seed") != F.col("item_id"))))
    if earlier:
        pairs = pairs.where("ok")
    return pairs.groupBy("seed", "item_id").count()


def covisit_top(counts, top: int):
    """The ``top`` most co-visited items per seed (ties: the smaller item id) of ``covisit_counts``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    w = Window.partitionBy("seed").orderBy(F.desc("count"), "item_id")
    return counts.withColumn("k", F.row_number().over(w)).where(F.col("k") <= top).drop("k")


def covisitation(prior, cfg: SimulatorConfig):
    """Top ``covisit_top`` co-visited items per seed item (pairs within ``covisit_window`` positions of a user's
    events ordered by time, then item; counted in both directions)."""
    return covisit_top(covisit_counts(prior, cfg.covisit_window), cfg.covisit_top)


def history_events(hist, last: int, since=None):
    """The entries of ``user_histories`` as events (user_id, item_id, event_timestamp): each user's ``last`` most
    recent (None: all) of those not older than ``since``."""
    from pyspark.sql import functions as F
    e = hist.select("user_id", F.size("hist_ts").alias("_n"),
                    F.posexplode(F.arrays_zip("hist_ts", "hist_item")).alias("_pos", "_e"))
    keep = F.lit(True) if last is None else F.col("_pos") >= F.col("_n") - last
    if since is not None:
        keep = keep & (F.col("_e.hist_ts") >= F.lit(pd.Timestamp(since).value // 1000))
    return e.where(keep).select("user_id", F.col("_e.hist_item").alias("item_id"),
                                F.timestamp_micros(F.col("_e.hist_ts")).alias("event_timestamp"))


def covisit_added(before, new_events, window: int):
    """The co-visit counts that ``new_events`` add to those of the events ``before`` them: pairs whose later event
    is new. ``before``: at least each user's last ``window`` events before the new ones (``history_events``)."""
    from pyspark.sql import functions as F
    new = new_events.select("user_id", "item_id", "event_timestamp")
    ctx = before.join(new.select("user_id").distinct(), "user_id", "left_semi")
    return covisit_counts(new.withColumn("_new", F.lit(True)).unionByName(ctx.withColumn("_new", F.lit(False))),
                          window, later="_new")


def covisit_gone(leaving, after, window: int):
    """The co-visit counts that the events ``leaving`` the lookback take away: pairs whose earlier event leaves.
    ``after``: each leaving user's first ``window`` events after the leaving ones (all of them if fewer)."""
    from pyspark.sql import functions as F
    out = leaving.select("user_id", "item_id", "event_timestamp")
    return covisit_counts(out.withColumn("_out", F.lit(True)).unionByName(
        after.select("user_id", "item_id", "event_timestamp").withColumn("_out", F.lit(False))),
        window, earlier="_out")


def first_events(events, n: int):
    """Each user's first ``n`` events ordered by (time, item) (user_id, item_id, event_timestamp)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    w = Window.partitionBy("user_id").orderBy("event_timestamp", "item_id")
    return (events.select("user_id", "item_id", "event_timestamp").withColumn("_k", F.row_number().over(w))
            .where(F.col("_k") <= n).drop("_k"))


def merge_covisit(prev, added, gone=None):
    """Co-visit counts at T from those at the previous cutoff, plus what the new events added, less what the
    events that left the lookback took (None: nothing left); pairs whose count fell to 0 dropped. Equal to
    ``covisit_counts`` of the lookback's events."""
    from pyspark.sql import functions as F
    parts = [prev.select("seed", "item_id", "count"), added.select("seed", "item_id", "count")]
    if gone is not None:
        parts.append(gone.select("seed", "item_id", (-F.col("count")).alias("count")))
    # Shuffled by seed alone: the sum per pair and then ``covisit_top``'s window per seed need no second shuffle.
    both = union_all(parts).repartition("seed")
    return both.groupBy("seed", "item_id").agg(F.sum("count").alias("count")).where(F.col("count") > 0)


def user_seeds(prior, n: int):
    """Each user's ``n`` most recently seen distinct items (the request simulator's seeds): (user_id, seed, ts),
    ts the item's last event time in epoch microseconds; ties: the larger item id first."""
    from pyspark.sql import functions as F
    last = prior.groupBy("user_id", F.col("item_id").alias("seed")).agg(
        F.unix_micros(F.max("event_timestamp")).alias("ts"))
    return _latest_seeds(last, n)


def _latest_seeds(last, n: int):
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    w = Window.partitionBy("user_id").orderBy(F.desc("ts"), F.desc("seed"))
    return last.withColumn("_k", F.row_number().over(w)).where(F.col("_k") <= n).drop("_k")


def merge_seeds(prev, new_events, n: int, since=None):
    """The seeds at T from those at the previous cutoff (``user_seeds``) and the events since, all later: an item's
    latest time, the ``n`` latest items. ``since``: seeds older than it (they left the lookback) are dropped first;
    every item that ranked below them is older still. Equal to ``user_seeds`` of the lookback's events."""
    from pyspark.sql import functions as F
    old = prev.select("user_id", "seed", "ts")
    if since is not None:
        old = old.where(F.col("ts") >= F.lit(pd.Timestamp(since).value // 1000))
    both = old.unionByName(user_seeds(new_events, n)).groupBy("user_id", "seed").agg(F.max("ts").alias("ts"))
    return _latest_seeds(both, n)


def simulated_sets(users: np.ndarray, user: np.ndarray, item: np.ndarray, count: np.ndarray, popular: np.ndarray,
                   n_candidates: int, n_popular: int):
    """The request simulator's candidate sets of some users, from their seeds' co-visit rows (one row per seed and
    co-visited item, the users' rows all here): per user, the items by summed count (most first, then the smaller
    id), at most ``n_candidates - n_popular`` of them, then the ``popular`` items (most popular first) that are not
    among them, up to ``n_candidates`` in all.

    Args:
        users: every user that gets a set (those without co-visit rows get the popular items).
        user, item, count: the co-visit rows (int64).
        popular: the popular items, most popular first.

    Returns:
        (user, item, tier, n): tier 0 for co-visited items (n: the summed count), 1 for popular ones (n: the rank).
    """
    users = np.unique(users)
    n_cov = n_candidates - n_popular
    if len(user):
        order = np.lexsort((item, user))
        user, item, count = user[order], item[order], count[order]
        starts = np.flatnonzero(np.r_[True, (user[1:] != user[:-1]) | (item[1:] != item[:-1])])
        user, item, count = user[starts], item[starts], np.add.reduceat(count, starts)
        order = np.lexsort((item, -count, user))
        user, item, count = user[order], item[order], count[order]
        first = np.r_[True, user[1:] != user[:-1]]
        at = np.arange(len(user))
        keep = at - np.maximum.accumulate(np.where(first, at, 0)) < n_cov
        user, item, count = user[keep], item[keep], count[keep]
    row = np.searchsorted(users, user)
    # Which popular item each user already has from co-visitation; the rest fill the set in popularity order.
    taken = np.zeros((len(users), len(popular)), bool)
    if len(popular) and len(item):
        by_id = np.argsort(popular, kind="stable")
        j = np.minimum(np.searchsorted(popular, item, sorter=by_id), len(popular) - 1)
        hit = popular[by_id[j]] == item
        taken[row[hit], by_id[j[hit]]] = True
    room = n_candidates - np.bincount(row, minlength=len(users))
    free = ~taken
    fill_row, rank = np.nonzero(free & (np.cumsum(free, axis=1) <= room[:, None]))
    return (np.concatenate([user, users[fill_row]]), np.concatenate([item, popular[rank]]),
            np.concatenate([np.zeros(len(user), np.int8), np.ones(len(rank), np.int8)]),
            np.concatenate([count, rank.astype(np.int64)]))


def candidate_pairs(prior, users, cutoff, cfg: SimulatorConfig, cov=None, seeds=None, totals=None):
    """The request simulator in Spark: for each user, what ``RequestSimulator(prior, cutoff).candidates`` gives.
    What the caller already has: ``cov`` (``covisitation(prior, cfg)``), ``seeds`` (``user_seeds(prior,
    cfg.history_items)``) and ``totals`` (each item's events in ``prior``: ``popular_items``); with all three,
    ``prior`` needs to hold only the last ``popularity_hours``.

    The seeds' co-visit rows and the users are shuffled by user once; each partition's sets are then made at once
    in numpy (``simulated_sets``), not by windows over the pairs. The popular items (at most ``n_candidates``) are
    collected.

    Returns:
        (user_id, item_id, source, retrieval_score), at most ``n_candidates`` distinct items per user.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import ByteType, LongType, StructField, StructType
    seeds = (user_seeds(prior, cfg.history_items) if seeds is None else seeds).select("user_id", "seed") \
        .join(users, "user_id")
    rows = (seeds.join(covisitation(prior, cfg) if cov is None else cov, "seed")
            .select("user_id", "item_id", F.col("count").cast("long"), F.lit(False).alias("_only"))
            .unionByName(users.select("user_id", F.lit(0).cast("long").alias("item_id"),
                                      F.lit(0).cast("long").alias("count"), F.lit(True).alias("_only"))))
    popular = np.array([r["item_id"] for r in popular_items(prior, cutoff, cfg, totals).orderBy("rank").collect()],
                       np.int64)
    n_candidates, n_popular = cfg.n_candidates, cfg.n_popular

    def sets(frames):
        frames = list(frames)
        if not frames:
            return
        pdf = pd.concat(frames, ignore_index=True)
        if not len(pdf):
            return
        only = pdf["_only"].to_numpy(bool)
        cols = [pdf[c].to_numpy(np.int64)[~only] for c in ("user_id", "item_id", "count")]
        u, i, tier, n = simulated_sets(pdf["user_id"].to_numpy(np.int64)[only], *cols, popular, n_candidates,
                                       n_popular)
        yield pd.DataFrame({"user_id": u, "item_id": i, "_tier": tier, "_n": n})

    schema = StructType([StructField("user_id", LongType()), StructField("item_id", LongType()),
                         StructField("_tier", ByteType()), StructField("_n", LongType())])
    # A partition's rows are in memory at once: enough partitions for about SETS_ROWS co-visit rows each at most
    # (a user has at most history_items x covisit_top of them).
    n_parts = max(1, -(-users.count() * cfg.history_items * cfg.covisit_top // SETS_ROWS))
    out = rows.repartition(n_parts, "user_id").mapInPandas(sets, schema)
    cov_row = F.col("_tier") == 0
    return out.select("user_id", "item_id", F.when(cov_row, "covisit").otherwise("popular").alias("source"),
                      F.when(cov_row, F.log1p(F.col("_n").cast("double")))
                      .otherwise(-F.col("_n") / F.lit(max(len(popular), 1))).cast("float").alias("retrieval_score"))
