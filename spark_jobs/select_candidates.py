"""Candidate selection for one interval: active users (+ missed), request-simulator candidates, negative
exclusion, verifier scores, top share selected. Output: offline ``selection`` for the interval.

    spark-submit --master spark://HOST:7077 spark_jobs/select_candidates.py --data D --offline O --models M \
        --start 2026-01-05T00:00Z --end 2026-01-05T01:00Z
"""
from __future__ import annotations

import logging
import time

import pandas as pd

logger = logging.getLogger(__name__)


def run(spark, job, cfg) -> dict:
    from pyspark.sql import functions as F

    from solaris_jobs import offline as off
    from solaris_jobs import precompute as pc
    from solaris_jobs.spark import read_events
    t0 = time.perf_counter()
    T = pd.Timestamp(job.end)
    events = read_events(spark, job.data, end=T)
    prior = pc.prior_events(events, T, cfg.lookback_days).cache()
    # Bad rows of the interval itself are set aside with their reason (earlier ones were, by earlier runs).
    _, bad = pc.split_bad_events(events.where(F.col("event_timestamp") >= F.lit(pd.Timestamp(job.start)
                                                                                  .to_pydatetime())))
    rejects_path = off.write_interval(bad, job.offline, "rejects", T)
    n_bad = spark.read.parquet(rejects_path).count()
    if n_bad:
        logger.warning("set aside %d bad event rows of the interval: %s", n_bad, rejects_path)
    misses = off.read_misses(spark, job.offline, T - pd.Timedelta(hours=cfg.miss_hours), T)
    users = pc.active_users(prior, T, cfg.active_hours, misses).cache()
    cands = pc.candidate_pairs(prior, users, T, cfg.simulator).cache()
    past = [e for e in off.list_intervals(spark, job.offline, "selection") if e < T][-cfg.exclusion_runs:] \
        if cfg.exclusion_runs else []
    bottoms = None
    if len(past) == cfg.exclusion_runs and past:
        bottoms = off.read_intervals(spark, job.offline, "selection", past).where("bottom") \
            .select(F.col("run"), "user_id", "item_id")
    kept, excluded = pc.exclude_negatives(cands, bottoms, cfg.exclusion_runs)
    uc, ic = pc.counters(prior)
    scored = pc.score_pairs(pc.with_counters(kept, uc, ic), job.model("vm"), cfg).drop(*pc.COUNTER_COLS)
    considered = cands.groupBy("user_id").agg(F.count("*").alias("n_considered"))
    sel = pc.select_pairs(scored, cfg.select_share, cfg.select_scope, cfg.exclusion_share, considered)
    sel = pc.force_misses(sel, misses).withColumn("run", F.lit(T.to_pydatetime()).cast("timestamp"))
    n_users, n_cands, n_excl = users.count(), cands.count(), excluded.count()
    path = off.write_interval(sel, job.offline, "selection", T)
    out = spark.read.parquet(path)
    agg = out.agg(F.count("vm_score").alias("scored"), F.sum(F.col("selected").cast("int")).alias("selected"),
                  F.sum((F.col("source") == "miss").cast("int")).alias("forced_misses")).first()
    stats = {"interval_end": T.isoformat(), "rejected_events": n_bad, "users": n_users, "pairs_considered": n_cands,
             "pairs_excluded": n_excl, "exclusion_history_runs": len(past), "pairs_scored": agg["scored"],
             "pairs_selected": agg["selected"], "forced_misses": agg["forced_misses"],
             "select_share": cfg.select_share, "select_scope": cfg.select_scope,
             "seconds": round(time.perf_counter() - t0, 2)}
    off.write_stats(spark, path, stats)
    logger.info("selection %s: %d users, %d pairs considered, %d excluded by negative exclusion (VM scoring "
                "saved), %d selected for the FM", T, n_users, n_cands, n_excl, agg["selected"])
    prior.unpersist(), users.unpersist(), cands.unpersist()
    return stats


if __name__ == "__main__":
    from spark_jobs.common import entry
    entry(run, __doc__)
