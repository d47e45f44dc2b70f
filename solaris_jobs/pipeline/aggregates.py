"""The fallback tiers' embeddings: per-user aggregates of pair embeddings, item-aware fallbacks (a user's pair
embeddings weighted by their items' similarity to the target item), and each user's neighbours' similarity-weighted
aggregate."""
from __future__ import annotations

import numpy as np
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


def latest_pairs(pair_embeddings, cutoff, hours: float, version: str):
    """Each pair's latest embedding stamped in ``(cutoff - hours, cutoff]``, ``version`` rows only."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    recent = pair_embeddings.where(
        (F.col("event_timestamp") > F.lit(t - pd.Timedelta(hours=hours).to_pytimedelta()))
        & (F.col("event_timestamp") <= F.lit(t)) & (F.col("model_version") == version))
    return (recent.withColumn("k", F.row_number().over(Window.partitionBy("user_id", "item_id")
                                                       .orderBy(F.desc("event_timestamp"))))
            .where("k = 1").drop("k"))


def user_aggregates(latest, cutoff, version: str):
    """User aggregates: mean of each user's pair embeddings ``latest`` (``latest_pairs``: those stamped in the
    window, a pair embedded by several runs in the window counted once, by its latest embedding; ``version`` rows).

    Returns:
        (user_id, embedding, n_pairs, event_timestamp = cutoff, model_version).
    """
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
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


def item_weights(target_vecs: np.ndarray, cached_vecs: np.ndarray, temperature: float) -> np.ndarray:
    """(n_targets, n_cached) weights, each row summing to 1: a softmax over the cached pairs' items of their cosine
    similarity to the target item (``*_vecs`` L2-normalised rows) divided by ``temperature``."""
    z = target_vecs @ cached_vecs.T / temperature
    z -= z.max(1, keepdims=True)
    w = np.exp(z)
    return w / w.sum(1, keepdims=True)


def item_aware_fallbacks(targets, latest, item_ids: np.ndarray, item_vecs: np.ndarray, cutoff, version: str,
                         temperature: float):
    """The item-aware fallback of each target pair (u, j): the mean of u's latest pair embeddings (u, i) weighted by
    the similarity of item i to item j (``item_weights``); computed in the refresh, no FM inference.

    Args:
        targets: (user_id, item_id) pairs to compute it for (pairs ranked, missed or left out by the selection
            lately without a pair embedding).
        latest: the users' latest pair embeddings (``latest_pairs``: user_id, item_id, embedding).
        item_ids, item_vecs: sorted item ids and their L2-normalised vectors (the FM's item embeddings); an item
            not among them has the zero vector (equal weights).

    Returns:
        (user_id, item_id, embedding, n_pairs (the cached pairs behind it), event_timestamp = cutoff,
        model_version); targets whose user has no cached pair get no row.
    """
    from pyspark.sql import functions as F
    t = pd.Timestamp(cutoff).to_pydatetime()
    schema = "user_id long, item_id long, embedding array<float>, n_pairs int"
    dim = item_vecs.shape[1]

    def vectors(items: np.ndarray) -> np.ndarray:
        at = np.clip(np.searchsorted(item_ids, items), 0, max(len(item_ids) - 1, 0))
        known = (item_ids[at] == items) if len(item_ids) else np.zeros(len(items), bool)
        out = np.zeros((len(items), dim), np.float32)
        out[known] = item_vecs[at[known]]
        return out

    def per_user(want: pd.DataFrame, have: pd.DataFrame) -> pd.DataFrame:
        if want.empty or have.empty:
            return pd.DataFrame({"user_id": pd.Series([], dtype="int64"), "item_id": pd.Series([], dtype="int64"),
                                 "embedding": pd.Series([], dtype=object), "n_pairs": pd.Series([], dtype="int32")})
        codes = np.stack(have["embedding"].to_numpy()).astype(np.float32)
        w = item_weights(vectors(want["item_id"].to_numpy()), vectors(have["item_id"].to_numpy()), temperature)
        emb = (w @ codes).astype(np.float32)
        return pd.DataFrame({"user_id": want["user_id"].to_numpy(np.int64),
                             "item_id": want["item_id"].to_numpy(np.int64),
                             "embedding": list(emb), "n_pairs": np.full(len(want), len(have), np.int32)})

    out = (targets.select("user_id", "item_id").groupBy("user_id")
           .cogroup(latest.select("user_id", "item_id", "embedding").groupBy("user_id"))
           .applyInPandas(per_user, schema))
    return out.withColumn("event_timestamp", F.lit(t).cast("timestamp")).withColumn("model_version", F.lit(version))
