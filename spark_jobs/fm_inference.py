"""Batched FM inference for one interval: the selected pairs through the FM and the autoencoder's encoder on
executors, into the pair-embedding contract. Output: offline ``pair_embeddings`` for the interval."""
from __future__ import annotations

import logging
import time

import pandas as pd

logger = logging.getLogger(__name__)


def run(spark, job, cfg) -> dict:
    from solaris_jobs import offline as off
    from solaris_jobs import precompute as pc
    from solaris_jobs.spark import read_events
    t0 = time.perf_counter()
    T = pd.Timestamp(job.end)
    fm_path, ae_path = job.model("fm"), job.model("ae")
    version = pc.embedding_version(fm_path, ae_path)
    selected = off.read_interval(spark, job.offline, "selection", T).where("selected").select("user_id", "item_id")
    prior = pc.prior_events(read_events(spark, job.data, end=T), T, cfg.lookback_days)
    uc, ic = pc.counters(prior)
    pairs = pc.with_counters(selected, uc, ic).join(pc.user_histories(prior, cfg.history_len), "user_id", "left")
    parts = max(spark.sparkContext.defaultParallelism, 1)
    pairs = pairs.repartition(parts, "user_id").sortWithinPartitions("user_id", "item_id")
    emb = pc.embed_pairs(pairs, fm_path, ae_path, T, cfg, version)
    path = off.write_interval(emb, job.offline, "pair_embeddings", T)
    n = spark.read.parquet(path).count()
    seconds = time.perf_counter() - t0
    stats = {"interval_end": T.isoformat(), "pairs": n, "model_version": version, "seconds": round(seconds, 2),
             "pairs_per_s": round(n / seconds, 1) if seconds else None, "batch_size": cfg.batch_size}
    off.write_stats(spark, path, stats)
    logger.info("fm inference %s: %d pairs in %.1fs (%.0f pairs/s, includes reading and writing)", T, n, seconds,
                n / seconds if seconds else 0)
    return stats


if __name__ == "__main__":
    from spark_jobs.common import entry
    entry(run, __doc__)
