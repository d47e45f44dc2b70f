"""The fallback tiers' embeddings: per-user aggregates of pair embeddings, and each user's neighbours'
similarity-weighted aggregate."""
from __future__ import annotations

import pandas as pd


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
