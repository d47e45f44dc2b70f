"""The candidate pool and what goes to the FM: one pool (simulator candidates, recently ranked pairs, misses),
negative exclusion, and the selection, either the top share per user (or global) by the verifier's score or a
budget of pairs ranked by priority.
"""
from __future__ import annotations

import math

import pandas as pd

from solaris_jobs.pipeline.windows import last_hours, union_all

# Which source names a pair found by several: the strongest evidence that it will be ranked soon first.
POOL_SOURCES = ("recent", "miss", "covisit", "popular")
_MINUTE_US = 60_000_000


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
    pool = union_all(parts)
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
    rows = last_hours(prior, cutoff, window_hours).count()
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
