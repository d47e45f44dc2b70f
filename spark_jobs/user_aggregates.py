"""User aggregates for one interval: per user, the mean of their pair embeddings of the trailing window (24 h by
default) and their count. Output: offline ``user_aggregates`` for the interval."""
from __future__ import annotations

import logging
import time

import pandas as pd

logger = logging.getLogger(__name__)


def run(spark, job, cfg) -> dict:
    from solaris_jobs import offline as off
    from solaris_jobs import precompute as pc
    t0 = time.perf_counter()
    T = pd.Timestamp(job.end)
    version = pc.embedding_version(job.model("fm"), job.model("ae"))
    window = pd.Timedelta(hours=cfg.aggregate_hours)
    ends = [e for e in off.list_intervals(spark, job.offline, "pair_embeddings") if T - window < e <= T]
    if T not in ends:
        raise FileNotFoundError(f"no pair embeddings for the interval ending {T}: run fm_inference first")
    agg = pc.user_aggregates(off.read_intervals(spark, job.offline, "pair_embeddings", ends), T,
                             cfg.aggregate_hours, version)
    path = off.write_interval(agg, job.offline, "user_aggregates", T)
    n = spark.read.parquet(path).count()
    stats = {"interval_end": T.isoformat(), "users": n, "intervals_read": len(ends), "model_version": version,
             "seconds": round(time.perf_counter() - t0, 2)}
    off.write_stats(spark, path, stats)
    logger.info("user aggregates %s: %d users from %d intervals", T, n, len(ends))
    return stats


if __name__ == "__main__":
    from spark_jobs.common import entry
    entry(run, __doc__)
