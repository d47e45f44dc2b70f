"""Speculative precomputation as Spark transforms: candidates, verifier, negative exclusion, selection, FM
inference, user aggregates and neighbour embeddings.

Every transform takes DataFrames and scalars (never a session or a path) so that it is testable on a few rows;
the jobs in ``solaris_jobs.pipeline.jobs`` do the reading and writing. Time: a run prepares interval ``[start, end)``
after it closes; T = ``end`` is the cutoff. Everything is computed from events with ``event_timestamp < T``
(and ``>= T - lookback_days`` where a bound is set); embeddings are stamped with T.

Model scoring runs on executors with ``mapInPandas``: each Python worker loads a checkpoint once (the version the
run resolved, checked: ``solaris_jobs.pipeline.model_refs``) and scores Arrow batches; nothing is collected to the
driver except the FAISS step in ``solaris_jobs.pipeline.knn``.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Iterator

import numpy as np
import pandas as pd

from solaris_jobs.core.settings import PrecomputeConfig, SimulatorConfig
from solaris_jobs.pipeline.model_refs import ModelRef, ModelSet, load

logger = logging.getLogger(__name__)

# Why an FM output is set aside instead of written (embed counts them per reason in its stats).
NONFINITE_REASONS = ("FM output is not finite", "autoencoder code is not finite")
NONFINITE_USER = "FM user embedding is not finite"


# ----------------------------------------------------------------------------------------------- events

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


def active_users(prior, cutoff, hours: float, misses=None):
    """Users with an event in ``[cutoff - hours, cutoff)``, plus users of recorded misses."""
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    users = prior.where(F.col("event_timestamp") >= F.lit(t - pd.Timedelta(hours=hours).to_pytimedelta())) \
        .select("user_id")
    if misses is not None:
        users = users.unionByName(misses.select("user_id"))
    return users.distinct()


# ----------------------------------------------------------------------------------------------- candidates

def popular_items(prior, cutoff, cfg: SimulatorConfig, totals=None):
    """The ``n_candidates`` most popular items (small: one row per item), as ``RequestSimulator.popular``.
    ``totals``: (item_id, count) of the whole lookback when the caller has them (the item counters); ``prior`` then
    needs to hold only the last ``popularity_hours``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    recent = prior.where(F.col("event_timestamp") >= F.lit(t - pd.Timedelta(hours=cfg.popularity_hours)
                                                           .to_pytimedelta()))
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
    both = functools.reduce(lambda a, b: a.unionByName(b), parts).repartition("seed")
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


SETS_ROWS = 4_000_000


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


# ----------------------------------------------------------------------------------------------- counters

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
    both = functools.reduce(lambda a, b: a.unionByName(b), parts)
    return both.groupBy(key).agg(*[F.sum(c).cast("long").alias(c) for c in cols]).where(F.col(cols[0]) > 0)


def with_counters(pairs, user_counts, item_counts):
    zero = {f"{p}_{k}": 0 for p in ("user", "item") for k in ("cnt", "known", "pos")}
    return pairs.join(user_counts, "user_id", "left").join(item_counts, "item_id", "left").fillna(zero)


USER_COUNTER_COLS = [f"user_{k}" for k in ("cnt", "known", "pos")]
ITEM_COUNTER_COLS = [f"item_{k}" for k in ("cnt", "known", "pos")]
COUNTER_COLS = USER_COUNTER_COLS + ITEM_COUNTER_COLS


# ----------------------------------------------------------------------------------------------- models on executors

def score_pairs(pairs, vm: ModelRef, cfg: PrecomputeConfig):
    """Adds ``vm_score`` (the verifier: the current VM without FM features) to pairs with counter columns. Only the
    model's inputs go to Python and only the score comes back (a pandas UDF), not the pairs' other columns."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    batch_size, device, threads = cfg.batch_size, cfg.device, cfg.torch_threads
    names = ("user", "item", *COUNTER_COLS)

    def score(batches: Iterator[tuple[pd.Series, ...]]) -> Iterator[pd.Series]:
        import torch

        from models import batch_to_tensors
        model, _, dev = load(vm, device, threads)
        for cols in batches:
            arrays = [c.to_numpy(np.int64 if k < 2 else np.float32) for k, c in enumerate(cols)]
            scores = np.empty(len(arrays[0]), np.float32)
            with torch.inference_mode():
                for s in range(0, len(scores), batch_size):
                    b = {name: a[s: s + batch_size] for name, a in zip(names, arrays)}
                    scores[s: s + batch_size] = torch.sigmoid(model(batch_to_tensors(b, dev))["logit"]).cpu().numpy()
            yield pd.Series(scores)

    udf = F.pandas_udf(score, FloatType())
    return pairs.withColumn("vm_score", udf("user_id", "item_id", *COUNTER_COLS))


# ----------------------------------------------------------------------------------------------- exclusion, selection

def exclude_negatives(scored_pairs, past_bottoms, runs: int):
    """Negative exclusion filtering: drops pairs that were in their user's bottom share in each of the last
    ``runs`` runs.

    Args:
        scored_pairs: candidate pairs of this run (before scoring).
        past_bottoms: (run, user_id, item_id) of the bottom pairs of the last ``runs`` runs (None: no history).
        runs: K; 0 disables.

    Returns:
        (kept pairs, excluded pairs (user_id, item_id)).
    """
    from pyspark.sql import functions as F
    if not runs or past_bottoms is None:
        return scored_pairs, scored_pairs.limit(0).select("user_id", "item_id")
    always = (past_bottoms.groupBy("user_id", "item_id").agg(F.countDistinct("run").alias("n"))
              .where(F.col("n") >= runs).select("user_id", "item_id"))
    excluded = scored_pairs.join(always, ["user_id", "item_id"], "left_semi").select("user_id", "item_id")
    return scored_pairs.join(always, ["user_id", "item_id"], "left_anti"), excluded


def _rank_within_user(scored, bottom_share: float):
    """Adds, per user, ``n`` (the user's scored pairs), ``rank`` (by the verifier's score, ties by item id) and
    ``bottom`` (the lowest ``bottom_share`` of them)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    by_user = Window.partitionBy("user_id")
    ranked = (scored.withColumn("n", F.count("*").over(by_user))
              .withColumn("rank", F.row_number().over(by_user.orderBy(F.desc("vm_score"), "item_id"))))
    return ranked.withColumn("bottom", F.col("rank") > F.col("n") - F.floor(F.col("n") * F.lit(bottom_share)))


def select_pairs(scored, share: float, scope: str, bottom_share: float, considered=None):
    """Marks the pairs sent to the FM (``selected``) and those in the user's bottom share (``bottom``).

    The FM budget is a share of the pairs *considered*, so negative exclusion saves verifier work without
    shrinking the FM's: per user, the top ``ceil(share * n)`` scored pairs (at least one), n = the user's
    candidates before exclusion (``considered``: (user_id, n_considered); None = the scored ones). Global: the
    ``share * considered / scored`` top quantile of all scores. ``bottom``: the lowest ``bottom_share`` of the
    user's scored pairs. Ties break by item id.
    """
    from pyspark.sql import functions as F
    ranked = _rank_within_user(scored, bottom_share)
    if considered is not None:
        ranked = ranked.join(considered, "user_id", "left") \
            .withColumn("n_budget", F.coalesce(F.col("n_considered"), F.col("n"))).drop("n_considered")
    else:
        ranked = ranked.withColumn("n_budget", F.col("n"))
    if scope == "user":
        sel = F.col("rank") <= F.greatest(F.lit(1), F.ceil(F.col("n_budget") * F.lit(share)))
    else:
        q = share
        if considered is not None:
            n_scored = scored.count()
            n_total = considered.agg(F.sum("n_considered")).first()[0] or 0
            q = min(1.0, share * n_total / n_scored) if n_scored else share
        threshold = scored.approxQuantile("vm_score", [1.0 - q], 1e-4)
        sel = F.col("vm_score") >= F.lit(threshold[0] if threshold else 0.0)
    return ranked.withColumn("selected", sel).drop("n", "n_budget")


def recent_pairs(prior, cutoff, hours: float):
    """Pairs ranked for their user in ``[cutoff - hours, cutoff)``: (user_id, item_id, last_seen), the time of the
    pair's latest ranking. A user's rankings stay stable over short periods, so these come back soon."""
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    return (prior.where(F.col("event_timestamp") >= F.lit(t - pd.Timedelta(hours=hours).to_pytimedelta()))
            .groupBy("user_id", "item_id").agg(F.max("event_timestamp").alias("last_seen")))


# Which source names a pair found by several: the strongest evidence that it will be ranked soon first.
POOL_SOURCES = ("recent", "miss", "covisit", "popular")


def candidate_pool(simulated, recent=None, misses=None):
    """One candidate pool: the request simulator's candidates, recently ranked pairs and missed pairs, one row per
    pair with the ``source`` that found it first in ``POOL_SOURCES`` order, its retrieval score (simulator
    candidates; null otherwise) and ``last_seen`` (latest ranking or miss; null for pairs never ranked).

    Args:
        simulated: (user_id, item_id, source, retrieval_score) from ``candidate_pairs`` (a pair once), or None (then
            ``recent`` or ``misses`` is given).
        recent: (user_id, item_id, last_seen) from ``recent_pairs``, or None.
        misses: (user_id, item_id, missed_at), or None.
    """
    from pyspark.sql import functions as F
    parts = [simulated.withColumn("last_seen", F.lit(None).cast("timestamp"))] if simulated is not None else []
    if recent is not None:
        parts.append(recent.select("user_id", "item_id", F.lit("recent").alias("source"),
                                   F.lit(None).cast("float").alias("retrieval_score"), "last_seen"))
    if misses is not None:
        parts.append(misses.groupBy("user_id", "item_id").agg(F.max("missed_at").alias("last_seen"))
                     .select("user_id", "item_id", F.lit("miss").alias("source"),
                             F.lit(None).cast("float").alias("retrieval_score"), "last_seen"))
    if len(parts) == 1:         # each part holds a pair once: nothing to merge
        return parts[0].select("user_id", "item_id", "source", "retrieval_score", "last_seen")
    pool = functools.reduce(lambda a, b: a.unionByName(b), parts)
    order = F.array_position(F.array(*[F.lit(x) for x in POOL_SOURCES]), F.col("source"))
    # One hash aggregation per pair (a window over (user, item) would sort the whole pool); a source appears at
    # most once per pair, so the first in POOL_SOURCES order is the one with the smallest position.
    return (pool.withColumn("_o", order).groupBy("user_id", "item_id")
            .agg(F.min_by("source", "_o").alias("source"), F.max("retrieval_score").alias("retrieval_score"),
                 F.max("last_seen").alias("last_seen")))


def budget_pairs(prior, start, cutoff, budget_per_row: float, window_hours: float) -> tuple[int, float]:
    """The FM budget of the interval ``[start, cutoff)``: ``ceil(budget_per_row x`` expected rows), the expected rows
    being the log's rows per interval length over ``[cutoff - window_hours, cutoff)``.

    Returns:
        (pairs, expected rows).
    """
    import math

    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    window = pd.Timedelta(hours=window_hours)
    rows = prior.where(F.col("event_timestamp") >= F.lit(t - window.to_pytimedelta())).count()
    expected = expected_rows(rows, start, cutoff, window_hours)
    return int(math.ceil(budget_per_row * expected)), expected


def expected_rows(rows: int, start, cutoff, window_hours: float) -> float:
    """``rows`` served over ``window_hours``, scaled to the interval ``[start, cutoff)``: in Python integers of
    nanoseconds, exact at any size (``rows x`` an hour's ``Timedelta`` overflows int64 nanoseconds past 2.56M rows
    in the window)."""
    length = (pd.Timestamp(cutoff) - pd.Timestamp(start)).value
    return float(int(rows) * length / pd.Timedelta(hours=window_hours).value)


def select_budget(scored, n_pairs: int, priority: str, bottom_share: float, within_user: bool = True):
    """Budgeted selection: one global ranking of the whole pool, the top ``n_pairs`` selected.

    ``priority``: ``verifier`` (by the verifier's score) or ``recency`` (most recently ranked or missed first, then
    the verifier's score; pairs never ranked last). Ties break by user and item id. Adds ``priority_rank`` (1 = first
    in line for the FM), ``rank`` and ``bottom`` within the user (as ``select_pairs``; null unless ``within_user``:
    ``scored`` is then only the part of the pool the budget can reach, ``budget_reach``) and ``selected``.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    if within_user:
        ranked = _rank_within_user(scored, bottom_share)
    else:
        ranked = scored.select("*", F.lit(None).cast("int").alias("rank"), F.lit(None).cast("boolean").alias("bottom"))
    keys = [F.desc_nulls_last("last_seen")] if priority == "recency" else []
    keys += [F.desc("vm_score"), "user_id", "item_id"]
    ranked = ranked.withColumn("priority_rank", F.row_number().over(Window.orderBy(*keys)))
    return ranked.withColumn("selected", F.col("priority_rank") <= F.lit(n_pairs)).drop("n")


_MINUTE_US = 60_000_000


def budget_reach(pool, n_pairs: int) -> int | None:
    """Under a budget ranked by recency: where the budget's reach in the pool begins, as the start of a minute of
    ``last_seen`` in epoch microseconds (None: the whole pool, when fewer than ``n_pairs`` pairs have a
    ``last_seen``).

    Every pair a budget of ``n_pairs`` can select has ``last_seen`` at or after the minute that holds the
    ``n_pairs``-th latest one, and so does every pair ahead of such a pair in the ranking. The pairs of that part of
    the pool therefore get the priority ranks and the selection of a ranking of the whole pool, and the verifier's
    scores of the rest (they only order pairs the budget cannot reach) need not be computed. One Spark job: a count
    per minute."""
    from pyspark.sql import functions as F
    minute = F.floor(F.unix_micros("last_seen") / _MINUTE_US)
    counts = sorted(((r["m"], r["count"]) for r in pool.where(F.col("last_seen").isNotNull())
                     .groupBy(minute.alias("m")).count().collect()), reverse=True)
    if counts and n_pairs <= 0:
        return (int(counts[0][0]) + 1) * _MINUTE_US          # no budget: nothing to score
    total = 0
    for m, n in counts:
        total += n
        if total >= n_pairs:
            return int(m) * _MINUTE_US
    return None


def within_reach(pool, reach: int | None):
    """The pool's pairs from ``budget_reach`` on (all of it for None)."""
    from pyspark.sql import functions as F
    return pool if reach is None else pool.where(F.unix_micros("last_seen") >= F.lit(reach))


def force_misses(selection, misses):
    """Adds missed pairs (user_id, item_id) to the selection as ``source = 'miss'``, selected."""
    from pyspark.sql import functions as F
    if misses is None:
        return selection
    extra = (misses.select("user_id", "item_id").distinct()
             .join(selection.where("selected").select("user_id", "item_id"), ["user_id", "item_id"], "left_anti"))
    base = selection.join(extra, ["user_id", "item_id"], "left_anti")
    forced = extra.join(selection.drop("selected"), ["user_id", "item_id"], "left")
    forced = (forced.withColumn("source", F.lit("miss")).withColumn("selected", F.lit(True))
              .withColumn("bottom", F.coalesce(F.col("bottom"), F.lit(False))))
    return base.unionByName(forced, allowMissingColumns=True)


# ----------------------------------------------------------------------------------------------- FM inference

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


HIST_COLS = ["hist_ts", "hist_item", "hist_label", "hist_rating"]


def interval_state(prior, history_len: int):
    """The interval's state rebuilt from the lookback's events: (``user_histories``, user counters, item
    counters)."""
    return (user_histories(prior, history_len), *counters(prior))


def merge_histories(prev, new_events, history_len: int, since=None):
    """Every user's history at T from the histories at the previous cutoff (``user_histories`` there) and the
    events since, all later than any event of ``prev``: the user's last ``history_len`` of both, the new events'
    own ordering as ``user_histories``'s. ``since``: entries of ``prev`` older than it (they left the lookback) are
    dropped first; users left with none get no row. Equal to ``user_histories`` of all the lookback's events: a
    user's history at the previous cutoff holds every one of their events more recent than its oldest entry."""
    from pyspark.sql import functions as F
    L = int(history_len)
    new = user_histories(new_events, L)
    old = prev.select("user_id", *[F.col(c).alias(f"_o{c}") for c in HIST_COLS])
    if since is not None:
        cut = F.lit(pd.Timestamp(since).value // 1000)
        # Each array is sorted by time, so the entries that left the lookback are a prefix.
        n_out = F.size(F.filter("_ohist_ts", lambda x: x < cut))
        old = old.select("user_id", *[F.slice(f"_o{c}", n_out + 1, L).alias(f"_o{c}") for c in HIST_COLS])
    both = old.join(new, "user_id", "full_outer")
    types = dict(new.dtypes)
    empty = {c: F.array().cast(types[c]) for c in HIST_COLS}
    n_new = F.size(F.coalesce(F.col("hist_ts"), empty["hist_ts"]))
    n_old = F.size(F.coalesce(F.col("_ohist_ts"), empty["hist_ts"]))
    keep = F.least(n_old, F.lit(L) - n_new)
    merged = both.select("user_id", *[F.concat(F.slice(F.coalesce(F.col(f"_o{c}"), empty[c]), n_old - keep + 1, keep),
                                               F.coalesce(F.col(c), empty[c])).alias(c) for c in HIST_COLS])
    return merged.where(F.size("hist_ts") > 0)
PAIR_COLS = ["item_id", *ITEM_COUNTER_COLS]


def _examples(pdf: pd.DataFrame, at_us: int, history_len: int):
    """Examples at one time for the rows of ``pdf`` (user_id, history arrays; item_id where it has one)."""
    from solaris_jobs.core.model_inputs import history_examples
    first = pdf.drop_duplicates("user_id")
    lens = np.array([0 if h is None else len(h) for h in first["hist_item"]], dtype=np.int64)

    def flat(col, dtype):
        parts = [np.asarray(h, dtype) for h in first[col] if h is not None and len(h)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    return history_examples(pdf["user_id"].to_numpy(), pdf["item_id"].to_numpy() if "item_id" in pdf else
                            np.zeros(len(pdf), np.int64), at_us,
                            np.repeat(first["user_id"].to_numpy(), lens), flat("hist_item", np.int64),
                            flat("hist_ts", np.int64), flat("hist_label", np.int64), flat("hist_rating", np.int64),
                            history_len)


def _nonfinite(*finite) -> np.ndarray:
    """Per row, the index of the first of the (N,) "row is finite" masks that is False, else -1."""
    out = np.full(len(finite[0]), -1, np.int64)
    for k, ok in reversed(list(enumerate(finite))):
        out[~np.asarray(ok)] = k
    return out


def pairs_by_user(pairs):
    """One row per user from pairs with counter columns (``with_counters``): user_id, the user's counters, and the
    user's pairs as parallel arrays sorted by item (``PAIR_COLS``: item_id and the item's counters). The FM's
    inference reads each user's history once, so a user's pairs travel together, with the history once."""
    from pyspark.sql import functions as F
    per = F.sort_array(F.collect_list(F.struct(*PAIR_COLS))).alias("p")
    return pairs.groupBy("user_id", *USER_COUNTER_COLS).agg(per).select(
        "user_id", *USER_COUNTER_COLS, *[F.col("p")[c].alias(c) for c in PAIR_COLS])


def user_batches(n_pairs: np.ndarray, batch_size: int) -> list[slice]:
    """Consecutive users in batches of about ``batch_size`` pairs: a user goes to the batch its first pair falls in
    (a batch holds fewer than ``batch_size`` + the user's pairs), never split."""
    if not len(n_pairs):
        return []
    bid = (np.cumsum(n_pairs) - n_pairs) // max(int(batch_size), 1)
    cuts = np.flatnonzero(np.diff(bid)) + 1
    edges = [0, *cuts.tolist(), len(n_pairs)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def embed_pairs(user_pairs, models: ModelSet, cutoff, cfg: PrecomputeConfig):
    """Pair embeddings: FM interaction embedding -> autoencoder code, in the pair-embedding contract.

    Each user's history is encoded once per batch and only target attention and the trunk run per pair
    (``FoundationModel.forward(rows=...)``): the outputs of running the FM on every pair, at a fraction of the work.

    Args:
        user_pairs: one row per user (``pairs_by_user`` joined with ``user_histories``): user_id, the user's
            counters, its pairs' arrays (``PAIR_COLS``) and its history arrays (null: no history).
        models: the run's FM and autoencoder; their ``embedding_version`` is written with each row.
        cfg: ``history_len`` must be the FM's (``model_refs.resolve`` checks it); ``batch_size`` counts pairs.

    Returns:
        (user_id, item_id, embedding array<float>, event_timestamp = cutoff, model_version, reject_reason,
        model_s): the reason (``NONFINITE_REASONS``) is null for rows in the contract, and the job writes the others
        aside; ``model_s`` is the row's share of its batch's time in the FM and the encoder, tensor conversion and
        the copy back included (summed: the model's time inside the executors, apart from reading the rows,
        building the inputs and writing).
    """
    from pyspark.sql.types import (ArrayType, DoubleType, FloatType, LongType, StringType, StructField, StructType,
                                   TimestampType)
    schema = StructType([StructField("user_id", LongType()), StructField("item_id", LongType()),
                         StructField("embedding", ArrayType(FloatType())),
                         StructField("event_timestamp", TimestampType()), StructField("model_version", StringType()),
                         StructField("reject_reason", StringType()), StructField("model_s", DoubleType())])
    at = pd.Timestamp(cutoff)
    at_us = at.value // 1000
    batch_size, device, threads, L = cfg.batch_size, cfg.device, cfg.torch_threads, cfg.history_len
    fm_ref, ae_ref, version = models.fm, models.ae, models.embedding_version
    reasons = np.array([*NONFINITE_REASONS, None], dtype=object)

    def embed(frames):
        import torch

        from models import batch_to_tensors
        fm, _, dev = load(fm_ref, device, threads)
        ae, _, _ = load(ae_ref, device, threads)
        for pdf in frames:
            n_pairs = pdf["item_id"].map(len).to_numpy(np.int64)
            for users in user_batches(n_pairs, batch_size):
                part, n = pdf.iloc[users], n_pairs[users]
                ex = _examples(part.drop(columns="item_id"), at_us, L)
                b = ex.index.history(ex.users, ex.ts, L)                   # (U, L): one history per user
                b["user"] = np.repeat(ex.users, n)
                b.update({c: np.repeat(part[c].to_numpy(np.float32), n) for c in USER_COUNTER_COLS})
                b.update({c: np.concatenate(part[c].to_list()).astype(np.int64 if c == "item_id" else np.float32)
                          for c in PAIR_COLS})
                b["item"] = b.pop("item_id")
                rows = torch.as_tensor(np.repeat(np.arange(len(part)), n), device=dev)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    h = fm(batch_to_tensors(b, dev), rows=rows)["h"]
                    code = ae.encode(h)
                    finite = (torch.isfinite(h).all(1).cpu().numpy(), torch.isfinite(code).all(1).cpu().numpy())
                    code = code.float().cpu().numpy()
                model_s = (time.perf_counter() - t0) / max(len(code), 1)
                yield pd.DataFrame({"user_id": b["user"], "item_id": b["item"], "embedding": list(code),
                                    "event_timestamp": at, "model_version": version,
                                    "reject_reason": reasons[_nonfinite(*finite)], "model_s": model_s})

    return user_pairs.mapInPandas(embed, schema)


def embed_users(users_with_history, fm: ModelRef, cutoff, cfg: PrecomputeConfig):
    """FM user-level embeddings (no target) for (user_id, history arrays): (user_id, vector array<float>,
    reject_reason), the reason ``NONFINITE_USER`` for vectors with a NaN or infinity (else null)."""
    from pyspark.sql.types import ArrayType, FloatType, LongType, StringType, StructField, StructType
    schema = StructType([StructField("user_id", LongType()), StructField("vector", ArrayType(FloatType())),
                         StructField("reject_reason", StringType())])
    at_us = pd.Timestamp(cutoff).value // 1000
    batch_size, device, threads, L = cfg.user_batch_size, cfg.device, cfg.torch_threads, cfg.history_len
    reasons = np.array([NONFINITE_USER, None], dtype=object)

    def embed(frames):
        import torch

        from models import batch_to_tensors
        model, _, dev = load(fm, device, threads)
        for pdf in frames:
            for s in range(0, len(pdf), batch_size):
                part = pdf.iloc[s: s + batch_size]
                b = _examples(part, at_us, L).batch(np.arange(len(part)))
                with torch.inference_mode():
                    vec = model.user_embedding(batch_to_tensors(b, dev)).float().cpu().numpy()
                yield pd.DataFrame({"user_id": part["user_id"].to_numpy(), "vector": list(vec),
                                    "reject_reason": reasons[_nonfinite(np.isfinite(vec).all(1))]})

    return users_with_history.mapInPandas(embed, schema)


# ----------------------------------------------------------------------------------------------- aggregates

def mean_embedding(df, key: str, weight: str | None = None):
    """Per ``key``, the (weighted) element-wise mean of ``embedding`` arrays: (key, embedding, n)."""
    from pyspark.sql import functions as F
    w = F.col(weight) if weight else F.lit(1.0)
    exploded = df.select(key, w.alias("_w"), F.posexplode("embedding").alias("pos", "v"))
    per_pos = (exploded.groupBy(key, "pos")
               .agg((F.sum(F.col("v") * F.col("_w")) / F.sum("_w")).cast("float").alias("v"),
                    F.count("*").alias("n")))
    return per_pos.groupBy(key).agg(
        F.transform(F.sort_array(F.collect_list(F.struct("pos", "v"))), lambda x: x["v"]).alias("embedding"),
        F.max("n").alias("n"))


def user_aggregates(pair_embeddings, cutoff, hours: float, version: str):
    """User aggregates: mean of each user's pair embeddings stamped in ``(cutoff - hours, cutoff]``.

    A pair embedded by several runs in the window counts once (its latest embedding). Only ``version`` rows.

    Returns:
        (user_id, embedding, n_pairs, event_timestamp = cutoff, model_version).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    recent = pair_embeddings.where(
        (F.col("event_timestamp") > F.lit(t - pd.Timedelta(hours=hours).to_pytimedelta()))
        & (F.col("event_timestamp") <= F.lit(t)) & (F.col("model_version") == version))
    latest = (recent.withColumn("k", F.row_number().over(Window.partitionBy("user_id", "item_id")
                                                         .orderBy(F.desc("event_timestamp"))))
              .where("k = 1"))
    agg = mean_embedding(latest, "user_id")
    return agg.select("user_id", "embedding", F.col("n").cast("int").alias("n_pairs"),
                      F.lit(t).cast("timestamp").alias("event_timestamp"), F.lit(version).alias("model_version"))


def neighbour_embeddings(neighbours, aggregates, cutoff, version: str):
    """Similarity-weighted mean of the neighbours' aggregates.

    Args:
        neighbours: (user_id, neighbour_ids array<long>, similarities array<float>).
        aggregates: user aggregates (user_id, embedding, ...), this model version.

    Returns:
        (user_id, neighbour_ids, similarities, embedding, n_neighbours (those with an aggregate),
        event_timestamp = cutoff, model_version); users none of whose neighbours has an aggregate get no row.
    """
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    pairs = neighbours.select("user_id", F.explode(F.arrays_zip("neighbour_ids", "similarities")).alias("z")) \
        .select("user_id", F.col("z.neighbour_ids").alias("nb"), F.col("z.similarities").alias("sim")) \
        .where(F.col("sim") > 0)
    joined = pairs.join(aggregates.select(F.col("user_id").alias("nb"), "embedding"), "nb")
    n = joined.groupBy("user_id").agg(F.count("*").cast("int").alias("n_neighbours"))
    emb = mean_embedding(joined, "user_id", weight="sim").drop("n")
    return (neighbours.join(emb, "user_id").join(n, "user_id")
            .withColumn("event_timestamp", F.lit(t).cast("timestamp")).withColumn("model_version", F.lit(version)))
