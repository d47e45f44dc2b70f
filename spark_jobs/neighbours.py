"""Neighbours for one interval: FM user embeddings of every user with history (on executors), FAISS top-k
(on the driver: the index is one piece), and each user's neighbour embedding = similarity-weighted mean of the
neighbours' user aggregates. Outputs: offline ``user_embeddings`` and ``neighbours`` for the interval."""
from __future__ import annotations

import logging
import time

import numpy as np
import pandas as pd

logger = logging.getLogger(__name__)


def run(spark, job, cfg) -> dict:
    from solaris_jobs import offline as off
    from solaris_jobs import precompute as pc
    from solaris_jobs.neighbours import knn
    from solaris_jobs.spark import read_events
    t0 = time.perf_counter()
    T = pd.Timestamp(job.end)
    fm_path = job.model("fm")
    version = pc.embedding_version(fm_path, job.model("ae"))
    prior = pc.prior_events(read_events(spark, job.data, end=T), T, cfg.lookback_days)
    uemb = pc.embed_users(pc.user_histories(prior, cfg.history_len), fm_path, T, cfg)
    upath = off.write_interval(uemb, job.offline, "user_embeddings", T)
    # The FAISS index is the one piece held whole on the driver: N x d float32 (1M users x 128 = 512 MB).
    table = spark.read.parquet(upath).toArrow()
    ids = table.column("user_id").to_numpy()
    vectors = (np.stack(table.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32) if len(ids)
               else np.zeros((0, 1), np.float32))
    del table
    nbr, sim, kstats = knn(ids, vectors, cfg.knn_k, cfg.knn_exact_max)
    nb = spark.createDataFrame(pd.DataFrame({"user_id": ids, "neighbour_ids": list(nbr), "similarities": list(sim)}),
                               "user_id long, neighbour_ids array<long>, similarities array<float>")
    agg = off.read_interval(spark, job.offline, "user_aggregates", T)
    out = pc.neighbour_embeddings(nb, agg, T, version)
    path = off.write_interval(out, job.offline, "neighbours", T)
    n = spark.read.parquet(path).count()
    stats = {"interval_end": T.isoformat(), "users_with_history": int(len(ids)), "users_with_neighbour_embedding": n,
             "knn": kstats, "model_version": version, "seconds": round(time.perf_counter() - t0, 2)}
    off.write_stats(spark, path, stats)
    logger.info("neighbours %s: %d users embedded, %d with a neighbour embedding, index %s", T, len(ids), n, kstats)
    return stats


if __name__ == "__main__":
    from spark_jobs.common import entry
    entry(run, __doc__)
