"""The refresh's last Spark step, ``neighbours``: FM user embeddings (executors), FAISS top-k (the driver: the
index is one piece), and each user's neighbour embedding = similarity-weighted mean of the neighbours' aggregates.

Its phases: which users to embed (``_histories``), their FM user vectors (``_embed_users``), the index to query
(built now, or the last full interval's: ``_build_index``, ``_load_index``), the query (``_query``), the users kept
from the previous interval (``_carried``, ``_carry``), then the outputs (``_write_user_embeddings``,
``_stage_neighbours``).
"""
from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core import offline as off
from solaris_jobs.core import uris
from solaris_jobs.core.settings import PrecomputeConfig, Settings
from solaris_jobs.pipeline import aggregates, history, inference, interval_state
from solaris_jobs.pipeline.event_source import event_source
from solaris_jobs.pipeline.step_common import interval, models_of_interval, publish, releases_caches, with_history_len
from solaris_jobs.pipeline.windows import prior_events, read_from

logger = logging.getLogger(__name__)

KNN_STATE_SETTINGS = ("knn_k", "knn_exact_max", "knn_hnsw_m", "knn_ef_search", "history_len", "lookback_days")


@dataclass(frozen=True)
class KnnBase:
    """What an ``active`` interval builds on: the previous interval's end and the end of the full interval whose
    index it queries."""
    previous: pd.Timestamp
    index_at: pd.Timestamp


@dataclass
class Users:
    """The users with a vector this interval (those embedded now first, in user order): ids, (N, d) vectors, when
    each was computed (epoch microseconds), and once queried, their neighbour ids and similarities (N, k)."""
    ids: np.ndarray
    vectors: np.ndarray
    at: np.ndarray
    states: pa.Array | None = None           # each vector through the autoencoder's user coder (list<float>; null)
    neighbour_ids: np.ndarray | None = None
    similarities: np.ndarray | None = None


@dataclass(frozen=True)
class Index:
    """The FAISS index queried (None: nobody to index), the user id of each of its rows, its interval, its kind."""
    index: object | None
    ids: np.ndarray
    at: pd.Timestamp
    kind: str | None


@releases_caches
def neighbours(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
               cache=None) -> dict:
    """FM user embeddings, FAISS top-k and neighbour embeddings. Outputs: ``user_embeddings`` (vector, when it was
    computed, neighbour list), ``neighbours``, and at a full interval ``knn_index``.

    ``knn_requery = all``: every interval is full (every user with history embedded, indexed and queried).
    ``active``: only users with an event since the previous interval are embedded and queried, against the index
    of the last full interval; the others keep their vector and neighbour list; users whose whole history left the
    lookback drop out. A full interval comes every ``knn_rebuild_hours`` (so a kept vector is at most that old)
    and whenever the previous state cannot be used (``_knn_base``)."""
    t0 = time.perf_counter()
    _, T = interval(start, end)
    models = models if models is not None and models.fm is not None else models_of_interval(s, T)
    cfg = with_history_len(s, models)
    version = models.embedding_version
    source = event_source(events, s.data)

    def prior(first=read_from(T, cfg.lookback_days)):
        return prior_events(source.spark(spark, start=first, end=T), T, cfg.lookback_days)
    base, full_because = _knn_base(s, cfg, T, version)
    state = interval_state.read_state(spark, s, cfg, T)
    hist, changed = _histories(state, prior, base, cfg, cache)
    new, n_bad = _embed_users(hist, models, T, cfg, cache)
    prev = off.read_table(s.offline, "user_embeddings", base.previous) if base is not None else None
    # The vector width: of this interval's vectors, else (an active interval where nobody changed) the kept ones.
    widths = [len(t.column("vector")[0]) for t in (new, prev) if t is not None and t.num_rows]
    dim = widths[0] if widths else 0
    new_ids = new.column("user_id").to_numpy()
    users = Users(new_ids, _matrix(new.column("vector"), dim, np.float32), np.full(len(new_ids), T.value // 1000,
                                                                                   np.int64),
                  _states(new))
    del new
    if base is None:
        index, carried = _build_index(users, cfg, T), None
    else:
        live = (state.user_counters if state is not None else prior()).select("user_id").distinct()
        carried = _carried(prev, _ids(live), np.concatenate([_ids(changed), new_ids]))
        index = _load_index(s, base.index_at)
    del prev
    kstats = _query(users, index, cfg, full=base is None)
    n_carried = _carry(users, carried, dim, kstats["k"])
    path = _write_user_embeddings(s, users, index, base is None, cfg, version, T, clock, {
        "embedded": int(len(new_ids)), "carried": n_carried,
        "rejected": {inference.NONFINITE_USER: n_bad} if n_bad else {}})
    n_states = _publish_user_states(spark, s, path, T, version, clock)
    staged, n = _stage_neighbours(spark, s, path, T, version)
    stats = {"interval_end": T.isoformat(), "users_with_history": int(len(users.ids)),
             "users_embedded": int(len(new_ids)), "users_carried": n_carried, "users_with_neighbour_embedding": n,
             "users_with_state": n_states,
             "users_rejected": n_bad, "full": base is None, "full_because": full_because,
             "histories_reused": state is not None, "user_batch_size": cfg.user_batch_size, "knn": kstats,
             "model_version": version, "seconds": round(time.perf_counter() - t0, 2)}
    publish(staged, stats, clock)
    if n_bad:
        logger.warning("neighbours %s: %d users set aside: %s", T, n_bad, inference.NONFINITE_USER)
    logger.info("neighbours %s: %d users embedded, %d carried, %d with a neighbour embedding, index %s", T,
                len(new_ids), n_carried, n, kstats)
    return stats


def _knn_base(s: Settings, cfg: PrecomputeConfig, T: pd.Timestamp, version: str):
    """What an ``active`` interval builds on (``KnnBase``), or None and why this interval is a full one."""
    if cfg.knn_requery == "all":
        return None, "knn_requery all"
    prev = off.list_intervals(s.offline, "user_embeddings", before=T, last=1)
    if not prev:
        return None, "no earlier interval"
    state = (off.read_stats(s.offline, "user_embeddings", prev[0]) or {}).get("knn_state") or {}
    if state.get("model_version") != version or state.get("settings") != {k: getattr(cfg, k) for k in
                                                                           KNN_STATE_SETTINGS}:
        return None, f"the interval ending {prev[0].isoformat()} has another model version or KNN settings"
    index_at = pd.Timestamp(state["index_from"])
    if T - index_at >= pd.Timedelta(hours=cfg.knn_rebuild_hours):
        return None, f"the index of {index_at.isoformat()} is {cfg.knn_rebuild_hours:g} h old or more"
    if not off.is_complete(s.offline, "knn_index", index_at):
        return None, f"the index of {index_at.isoformat()} is gone"
    return KnnBase(prev[0], index_at), None


def _histories(state: interval_state.State | None, prior, base: KnnBase | None, cfg: PrecomputeConfig, cache):
    """The histories of the users to embed: every user's (the interval's state when it was made with these
    settings, else the log), only those with an event since the previous interval when there is a base. Returns
    (histories, the users with such an event (cached; None without a base))."""
    hist = state.histories if state is not None else history.user_histories(prior(), cfg.history_len)
    if base is None:
        return hist, None
    changed = cache(prior(base.previous).select("user_id").distinct())
    return hist.join(changed, "user_id", "left_semi"), changed


def _embed_users(hist, models, T: pd.Timestamp, cfg: PrecomputeConfig, cache) -> tuple[pa.Table, int]:
    """The FM user vectors of ``hist``'s users and their user-state codes (executors), in user order: the index's
    rows (and so FAISS's order among equal similarities) do not depend on where the histories came from. Returns
    (user_id, vector, state) and the number of users set aside (a vector or state that is not finite)."""
    from pyspark.sql import functions as F
    uemb = cache(inference.embed_users(hist, models.fm, T, cfg, models.ae))
    n_bad = uemb.where(F.col("reject_reason").isNotNull()).count()
    new = (uemb.where(F.col("reject_reason").isNull()).select("user_id", "vector", "state").toArrow()
           .sort_by("user_id"))
    uemb.unpersist()
    return new, n_bad


def _ids(users) -> np.ndarray:
    """The user ids of a (small) DataFrame of users, on the driver."""
    return users.toArrow().column(0).to_numpy()


def _carried(prev: pa.Table, live: np.ndarray, changed: np.ndarray) -> pa.Table:
    """The previous interval's rows kept as they are: users still in the lookback (``live``) with no event since
    (not ``changed``, nor embedded now)."""
    prev_ids = prev.column("user_id").to_numpy()
    return prev.filter(pa.array(np.isin(prev_ids, live) & ~np.isin(prev_ids, changed)))


def _build_index(users: Users, cfg: PrecomputeConfig, T: pd.Timestamp) -> Index:
    """The FAISS index of this interval's vectors, the one piece held whole on the driver: N x d float32 (1M users x
    128 = 512 MB)."""
    from solaris_jobs.pipeline import knn
    if not len(users.ids):
        return Index(None, users.ids, T, "none")
    index, kind = knn.build_index(users.vectors, cfg.knn_exact_max, cfg.knn_hnsw_m)
    return Index(index, users.ids, T, kind)


def _load_index(s: Settings, index_at: pd.Timestamp) -> Index:
    """The index of the last full interval, as published."""
    from solaris_jobs.pipeline import knn
    folder = off.require(s.offline, "knn_index", index_at)
    index = knn.deserialize(off.read_bytes(uris.join(folder, "index.faiss")))
    ids = np.load(io.BytesIO(off.read_bytes(uris.join(folder, "ids.npy"))))
    return Index(index, ids, index_at, (off.read_stats(s.offline, "knn_index", index_at) or {}).get("index"))


def _query(users: Users, index: Index, cfg: PrecomputeConfig, full: bool) -> dict:
    """Each user's ``knn_k`` nearest other users in the index (``users.neighbour_ids``, ``similarities``); a user
    in the index is not their own neighbour. Returns the query's stats."""
    from solaris_jobs.pipeline import knn
    kk = min(cfg.knn_k, max(len(index.ids) - 1, 0))
    t_knn = time.perf_counter()
    ids = users.ids
    if kk and len(ids):
        order = np.argsort(index.ids, kind="stable")
        pos = np.minimum(np.searchsorted(index.ids, ids, sorter=order), len(order) - 1)
        own = np.where(index.ids[order[pos]] == ids, order[pos], -1)
        rows, sim = knn.search(index.index, users.vectors, own, kk, cfg.knn_ef_search)
    else:
        rows, sim = np.full((len(ids), kk), -1, np.int64), np.zeros((len(ids), kk), np.float32)
    users.neighbour_ids, users.similarities = knn.to_ids(index.ids, rows), sim
    kstats = {"index": index.kind, "users": int(len(index.ids)), "k": kk, "queried": int(len(ids)),
              "seconds": round(time.perf_counter() - t_knn, 2), "index_from": index.at.isoformat()}
    if full and index.kind == "hnsw":
        q = np.random.default_rng(0).choice(len(ids), min(1000, len(ids)), replace=False)
        kstats["recall_at_k"] = knn.recall_at_k(index.index, users.vectors, rows[q], q, kk)
    return kstats


def _carry(users: Users, carried: pa.Table | None, dim: int, k: int) -> int:
    """Appends the carried rows to ``users``; returns how many."""
    if carried is None or not carried.num_rows:
        return 0
    users.ids = np.concatenate([users.ids, carried.column("user_id").to_numpy()])
    users.vectors = np.concatenate([users.vectors, _matrix(carried.column("vector"), dim, np.float32)])
    users.at = np.concatenate([users.at, carried.column("embedded_at").cast(pa.int64()).to_numpy()])
    users.states = pa.concat_arrays([users.states, _states(carried)])
    users.neighbour_ids = np.concatenate([users.neighbour_ids, _matrix(carried.column("neighbour_ids"), k, np.int64)])
    users.similarities = np.concatenate([users.similarities, _matrix(carried.column("similarities"), k, np.float32)])
    return int(carried.num_rows)


def _write_user_embeddings(s: Settings, users: Users, index: Index, built: bool, cfg: PrecomputeConfig,
                           version: str, T: pd.Timestamp, clock, counts: dict) -> str:
    """Publishes ``user_embeddings`` in user order with the KNN state the next interval reads, after the index
    itself when this interval ``built`` one that an active interval will query. Returns the published path."""
    from solaris_jobs.pipeline import knn
    order = np.argsort(users.ids, kind="stable")
    table = pa.table({"user_id": pa.array(users.ids[order], pa.int64()),
                      "vector": _lists(users.vectors[order], pa.float32()),
                      "embedded_at": pa.array(users.at[order], pa.timestamp("us", tz="UTC")),
                      "state": users.states.take(pa.array(order)),
                      "neighbour_ids": _lists(users.neighbour_ids[order], pa.int64()),
                      "similarities": _lists(users.similarities[order], pa.float32())})
    users.vectors = None
    state = {"model_version": version, "settings": {k: getattr(cfg, k) for k in KNN_STATE_SETTINGS},
             "index_from": index.at.isoformat()}
    if built and index.index is not None and cfg.knn_requery == "active":
        # The index is published before the state that names it, so a state never points at a missing index (and
        # only where an active interval will read it: under `all` nothing does).
        publish(off.stage_files(s.offline, "knn_index", T, {"index.faiss": knn.serialize(index.index),
                                                            "ids.npy": _npy(index.ids)}),
                {"interval_end": T.isoformat(), "index": index.kind, "users": int(len(index.ids)),
                 "model_version": version}, clock)
    staged = off.stage_table(table, s.offline, "user_embeddings", T)
    del table
    return publish(staged, {"interval_end": T.isoformat(), "users": int(len(users.ids)), **counts,
                            "knn_state": state}, clock)


def _publish_user_states(spark, s: Settings, user_embeddings: str, T: pd.Timestamp, version: str, clock) -> int:
    """Publishes ``user_states`` (the user-state tier's view: each user's FM user embedding through the
    autoencoder's user coder, stamped with when the embedding was computed, so that the TTL counts from then) before
    the neighbours that complete the step; returns its rows."""
    from pyspark.sql import functions as F
    ue = spark.read.parquet(user_embeddings).where(F.col("state").isNotNull())
    states = ue.select("user_id", F.col("state").alias("embedding"), F.col("embedded_at").alias("event_timestamp"),
                       F.lit(version).alias("model_version"))
    staged = off.stage(states, s.offline, "user_states", T)
    n = spark.read.parquet(staged.path).count()
    publish(staged, {"interval_end": T.isoformat(), "users": n, "model_version": version}, clock)
    return n


def _stage_neighbours(spark, s: Settings, user_embeddings: str, T: pd.Timestamp, version: str):
    """Stages each user's neighbour embedding (``aggregates.neighbour_embeddings``); returns it and its rows."""
    nb = spark.read.parquet(user_embeddings).select("user_id", "neighbour_ids", "similarities")
    agg = off.read_interval(spark, s.offline, "user_aggregates", T)
    staged = off.stage(aggregates.neighbour_embeddings(nb, agg, T, version), s.offline, "neighbours", T)
    return staged, spark.read.parquet(staged.path).count()


def _states(t: pa.Table) -> pa.Array:
    """The user-state codes of a user table (list<float>; nulls where it has none: an autoencoder without a user
    coder, or a table written before it had them)."""
    if "state" not in t.column_names:
        return pa.nulls(t.num_rows, pa.list_(pa.float32()))
    return t.column("state").combine_chunks().cast(pa.list_(pa.float32()))


def _matrix(col: pa.ChunkedArray, width: int, dtype) -> np.ndarray:
    """A list column whose lists all have ``width`` values as an (N, width) array."""
    flat = pa.concat_arrays([c.flatten() for c in col.chunks]) if col.num_chunks else pa.array([], pa.float32())
    return np.asarray(flat.to_numpy(zero_copy_only=False), dtype).reshape(len(col), width)


def _lists(m: np.ndarray, typ) -> pa.Array:
    """An (N, width) array as a list column (the inverse of ``_matrix``)."""
    offsets = np.arange(len(m) + 1, dtype=np.int64) * m.shape[1]
    if offsets[-1] >= 2**31:
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(m.reshape(-1), typ))
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(m.reshape(-1), typ))


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()
