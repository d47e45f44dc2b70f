"""The refresh's Spark steps as library functions: ``select``, ``embed``, ``aggregate``, ``neighbours``, each
``step(spark, settings, start, end, *, events=None, models=None, clock=None) -> stats``, and ``run`` for several
in one session. The Airflow tasks (in-process or through ``spark_jobs/*.py`` under spark-submit), the CLI, the
backfill and a replay all call these.

A run prepares the interval ``[start, end)`` after it closes; T = ``end`` is the cutoff: everything is computed
from events before T and stamped with T. Doors for replays and tests:

- ``events``: where the events come from (``event_source``): None reads the log under ``settings.data``; a table
  or DataFrame read once can serve many intervals.
- ``models``: a ``model_refs.ModelSet`` resolved once (None: resolved from ``settings.models`` at the step's
  start). ``embed`` records the refs it used in its stats, and ``aggregate`` and ``neighbours`` of the same
  interval follow them, so one interval's outputs never mix model versions even if the models folder is switched
  (``solaris_train``'s publish) between its steps.
- ``clock``: what "now" is for the timestamps written beside the outputs (``_PUBLISHED``, stats); the outputs
  themselves depend only on the interval, the events and the models.

Each step writes its output for the interval to a fresh folder and publishes it atomically
(``solaris_jobs.core.offline``); a rerun replaces it.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.events import to_utc
from solaris_jobs.core.settings import Settings
from solaris_jobs.pipeline import model_refs
from solaris_jobs.pipeline import precompute as pc
from solaris_jobs.pipeline.event_source import event_source

logger = logging.getLogger(__name__)

SPARK_STEPS = ("select", "embed", "aggregate", "neighbours")
Clock = Callable[[], pd.Timestamp]


def wall_clock() -> pd.Timestamp:
    return pd.Timestamp.now(tz="UTC")


def interval(start, end) -> tuple[pd.Timestamp, pd.Timestamp]:
    """The interval as UTC timestamps (naive times are UTC).

    Raises:
        ValueError: ``end`` is not after ``start``.
    """
    start, end = to_utc(start), to_utc(end)
    if end <= start:
        raise ValueError(f"interval end {end.isoformat()} is not after its start {start.isoformat()}")
    return start, end


def session(s: Settings, app: str = "solaris"):
    """The Spark session the settings describe."""
    from solaris_jobs.pipeline.spark import spark_session
    return spark_session(f"solaris-{app}", s.spark_master, driver_memory=s.spark_driver_memory,
                         log_level=s.spark_log_level)


def _publish(staged: off.Staged, stats: dict, clock: Clock | None) -> str:
    now = (clock or wall_clock)()
    return staged.publish({**stats, "written_at": now.isoformat()}, published_at=now)


def _models_of_interval(s: Settings, end: pd.Timestamp) -> model_refs.ModelSet:
    """The FM and autoencoder ``embed`` used for this interval (its stats), else those of ``settings.models``."""
    stats = off.read_stats(s.offline, "pair_embeddings", end) or {}
    if "models" in stats:
        return model_refs.ModelSet.from_dict(stats["models"])
    return model_refs.resolve(s.models, ("fm", "ae"), s.precompute.history_len)


def _with_history_len(s: Settings, models: model_refs.ModelSet):
    """The precompute settings with the FM's history length (checked against the configured one)."""
    return replace(s.precompute, history_len=models.check_history_len(s.precompute.history_len))


def _releases_caches(step):
    """Gives the step a ``cache(df)`` that caches a DataFrame and unpersists it when the step returns or fails: a
    long-lived Spark (a Spark Connect server the tasks share) would otherwise keep a failed task's caches."""
    @functools.wraps(step)
    def run(spark, s: Settings, start, end, **kw) -> dict:
        held = []

        def cache(df):
            held.append(df.cache())
            return held[-1]
        try:
            return step(spark, s, start, end, cache=cache, **kw)
        finally:
            for df in held:
                try:
                    df.unpersist()
                except Exception:          # the session is gone: nothing is held any more
                    logger.debug("unpersist failed", exc_info=True)
    return run


def read_from(T: pd.Timestamp, lookback_days: float | None, start=None) -> pd.Timestamp | None:
    """The earliest event time a step reads for the cutoff T: the lookback's start (None: the whole log), or the
    interval's ``start`` when that is earlier (the selection sets the interval's bad rows aside)."""
    if lookback_days is None:
        return None
    first = T - pd.Timedelta(days=lookback_days)
    return min(first, to_utc(start)) if start is not None else first


@_releases_caches
def select(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
           cache=None) -> dict:
    """Candidate selection: active users (+ missed), request-simulator candidates, negative exclusion, verifier
    scores, top share selected. Outputs: ``rejects`` and ``selection`` for the interval."""
    from pyspark.sql import functions as F
    t0 = time.perf_counter()
    start, T = interval(start, end)
    cfg = s.precompute
    vm = (models.vm if models is not None and models.vm is not None
          else model_refs.resolve(s.models, ("vm",)).vm)
    source = event_source(events, s.data)
    ev = source.spark(spark, start=read_from(T, cfg.lookback_days, start), end=T)
    prior = cache(pc.prior_events(ev, T, cfg.lookback_days))
    # Bad rows of the interval itself are set aside with their reason (earlier ones were, by earlier runs).
    _, bad = pc.split_bad_events(ev.where(F.col("event_timestamp") >= F.lit(start.to_pydatetime())))
    staged = off.stage(bad, s.offline, "rejects", T)
    n_bad = spark.read.parquet(staged.path).count()
    rejects_path = _publish(staged, {"interval_end": T.isoformat(), "rows": n_bad}, clock)
    if n_bad:
        logger.warning("set aside %d bad event rows of the interval: %s", n_bad, rejects_path)
    misses = off.read_misses(spark, s.offline, T - pd.Timedelta(hours=cfg.miss_hours), T)
    budgeted = cfg.budget_per_row is not None
    users = cache(pc.active_users(prior, T, cfg.active_hours, misses))
    recent = pc.recent_pairs(prior, T, cfg.recent_hours) if cfg.recent_hours > 0 else None
    n_budget = expected = None
    if budgeted:
        n_budget, expected = pc.budget_pairs(prior, start, T, cfg.budget_per_row, cfg.budget_window_hours)
    # One pool: under a budget the misses are candidates like the others (inside the budget); without one they
    # are forced in on top of the verifier's share.
    simulated = pc.candidate_pairs(prior, users, T, cfg.simulator)
    skipped_simulator = False
    if budgeted and cfg.select_priority == "recency" and not cfg.exclusion_runs and recent is not None:
        # Ranked by recency, the simulator's candidates (never ranked) come after every recently ranked or missed
        # pair: when those alone fill the budget, no simulator candidate can be selected, so none is computed.
        known = cache(pc.candidate_pool(simulated.limit(0), recent, misses))
        if known.count() >= n_budget:
            simulated, skipped_simulator = simulated.limit(0), True
        known.unpersist()
    cands = cache(pc.candidate_pool(simulated, recent, misses if budgeted else None))
    past = off.list_intervals(s.offline, "selection", before=T, last=cfg.exclusion_runs) if cfg.exclusion_runs \
        else []
    bottoms = None
    if len(past) == cfg.exclusion_runs and past:
        bottoms = off.read_intervals(spark, s.offline, "selection", past).where("bottom") \
            .select(F.col("run"), "user_id", "item_id")
    kept, excluded = pc.exclude_negatives(cands, bottoms, cfg.exclusion_runs)
    uc, ic = pc.counters(prior)
    scored = pc.score_pairs(pc.with_counters(kept, uc, ic), vm, cfg).drop(*pc.COUNTER_COLS)
    budget = {}
    if budgeted:
        sel = pc.select_budget(scored, n_budget, cfg.select_priority, cfg.exclusion_share)
        budget = {"budget_per_row": cfg.budget_per_row, "budget_pairs": n_budget, "expected_rows": expected,
                  "select_priority": cfg.select_priority, "simulator_skipped": skipped_simulator}
    else:
        considered = cands.groupBy("user_id").agg(F.count("*").alias("n_considered"))
        sel = pc.select_pairs(scored, cfg.select_share, cfg.select_scope, cfg.exclusion_share, considered)
        sel = pc.force_misses(sel, misses)
    sel = sel.withColumn("run", F.lit(T.to_pydatetime()).cast("timestamp"))
    n_users, n_cands, n_excl = users.count(), cands.count(), excluded.count()
    staged = off.stage(sel, s.offline, "selection", T)
    written = spark.read.parquet(staged.path)
    agg = written.agg(F.count("vm_score").alias("scored"), F.sum(F.col("selected").cast("int")).alias("selected"),
                      F.sum((F.col("source") == "miss").cast("int")).alias("misses")).first()
    by_source = {r["source"]: {"pool": r["pool"], "selected": r["selected"]} for r in written.groupBy("source").agg(
        F.count("*").alias("pool"), F.sum(F.col("selected").cast("int")).alias("selected")).collect()}
    stats = {"interval_end": T.isoformat(), "rejected_events": n_bad, "users": n_users, "pairs_considered": n_cands,
             "pairs_excluded": n_excl, "exclusion_history_runs": len(past), "pairs_scored": agg["scored"],
             "pairs_selected": agg["selected"] or 0,
             "forced_misses": 0 if budgeted else agg["misses"], "by_source": by_source, **budget,
             "select_share": cfg.select_share, "select_scope": cfg.select_scope, "verifier": vm.version,
             "seconds": round(time.perf_counter() - t0, 2)}
    _publish(staged, stats, clock)
    logger.info("selection %s: %d users, %d pairs considered, %d excluded by negative exclusion (VM scoring "
                "saved), %d selected for the FM%s", T, n_users, n_cands, n_excl, agg["selected"] or 0,
                f" (budget {budget['budget_pairs']})" if budget else "")
    return stats


@_releases_caches
def embed(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
          cache=None) -> dict:
    """Batched FM inference: the selected pairs through the FM and the autoencoder's encoder on executors.
    Outputs: ``pair_embeddings`` and, for outputs that are not finite (counted per reason), ``embedding_rejects``."""
    from pyspark.sql import functions as F

    from solaris_jobs.pipeline.spark import parallelism
    t0 = time.perf_counter()
    _, T = interval(start, end)
    if models is None or models.fm is None or models.ae is None:
        models = model_refs.resolve(s.models, ("fm", "ae"), s.precompute.history_len)
    cfg = _with_history_len(s, models)
    version = models.embedding_version
    selected = off.read_interval(spark, s.offline, "selection", T).where("selected").select("user_id", "item_id")
    source = event_source(events, s.data)
    # Read once: the counters and the histories both come from it.
    prior = cache(pc.prior_events(source.spark(spark, start=read_from(T, cfg.lookback_days), end=T), T,
                                  cfg.lookback_days))
    uc, ic = pc.counters(prior)
    users = pc.pairs_by_user(pc.with_counters(selected, uc, ic)).join(pc.user_histories(prior, cfg.history_len),
                                                                       "user_id", "left")
    users = users.repartition(parallelism(spark), "user_id").sortWithinPartitions("user_id")
    out = cache(pc.embed_pairs(users, models, T, cfg))
    good = out.where(F.col("reject_reason").isNull()).drop("reject_reason", "model_s")
    bad = out.where(F.col("reject_reason").isNotNull()).select("user_id", "item_id",
                                                               F.col("reject_reason").alias("reason"))
    staged = off.stage(good, s.offline, "pair_embeddings", T)
    staged_bad = off.stage(bad, s.offline, "embedding_rejects", T)
    n = spark.read.parquet(staged.path).count()
    rejected = {r["reason"]: r["count"] for r in spark.read.parquet(staged_bad.path).groupBy("reason").count()
                .collect()}
    model_s = out.agg(F.sum("model_s")).first()[0] or 0.0
    _publish(staged_bad, {"interval_end": T.isoformat(), "rows": sum(rejected.values()), "rejected": rejected},
             clock)
    seconds = time.perf_counter() - t0
    stats = {"interval_end": T.isoformat(), "pairs": n, "model_version": version, "seconds": round(seconds, 2),
             "pairs_per_s": round(n / seconds, 1) if seconds else None, "batch_size": cfg.batch_size,
             # The FM and the encoder inside the executors (summed over tasks), apart from reading and writing.
             "model_seconds": round(model_s, 3), "model_pairs_per_s": round(n / model_s, 1) if model_s else None,
             "rejected": rejected, "models": models.to_dict()}
    _publish(staged, stats, clock)
    if rejected:
        logger.warning("fm inference %s: set aside %s (not finite): %s", T, rejected,
                       off.interval_uri(s.offline, "embedding_rejects", T))
    logger.info("fm inference %s: %d pairs in %.1fs (%.0f pairs/s, includes reading and writing; the model %.1fs "
                "of task time, %.0f pairs/s)", T, n, seconds, n / seconds if seconds else 0, model_s,
                n / model_s if model_s else 0)
    return stats


def aggregate(spark, s: Settings, start, end, *, events=None, models=None, clock=None) -> dict:
    """User aggregates: per user, the mean of their pair embeddings of the trailing window and their count, of the
    interval's embedding version only. Output: ``user_aggregates``."""
    t0 = time.perf_counter()
    _, T = interval(start, end)
    models = models if models is not None and models.fm is not None else _models_of_interval(s, T)
    version = models.embedding_version
    window = pd.Timedelta(hours=s.precompute.aggregate_hours)
    ends = [e for e in off.list_intervals(s.offline, "pair_embeddings", since=T - window, before=T + pd.Timedelta(1))
            if e > T - window]
    if T not in ends:
        raise FileNotFoundError(f"no pair embeddings for the interval ending {T}: run embed first")
    agg = pc.user_aggregates(off.read_intervals(spark, s.offline, "pair_embeddings", ends), T,
                             s.precompute.aggregate_hours, version)
    staged = off.stage(agg, s.offline, "user_aggregates", T)
    n = spark.read.parquet(staged.path).count()
    stats = {"interval_end": T.isoformat(), "users": n, "intervals_read": len(ends), "model_version": version,
             "seconds": round(time.perf_counter() - t0, 2)}
    _publish(staged, stats, clock)
    logger.info("user aggregates %s: %d users from %d intervals", T, n, len(ends))
    return stats


@_releases_caches
def neighbours(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
               cache=None) -> dict:
    """FM user embeddings of every user with history (executors), FAISS top-k (the driver: the index is one
    piece), and each user's neighbour embedding = similarity-weighted mean of the neighbours' aggregates.
    Outputs: ``user_embeddings`` and ``neighbours``."""
    from pyspark.sql import functions as F

    from solaris_jobs.pipeline.knn import knn
    t0 = time.perf_counter()
    _, T = interval(start, end)
    models = models if models is not None and models.fm is not None else _models_of_interval(s, T)
    cfg = _with_history_len(s, models)
    version = models.embedding_version
    source = event_source(events, s.data)
    prior = pc.prior_events(source.spark(spark, start=read_from(T, cfg.lookback_days), end=T), T, cfg.lookback_days)
    uemb = cache(pc.embed_users(pc.user_histories(prior, cfg.history_len), models.fm, T, cfg))
    staged = off.stage(uemb.where(F.col("reject_reason").isNull()).drop("reject_reason"), s.offline,
                       "user_embeddings", T)
    n_bad = uemb.where(F.col("reject_reason").isNotNull()).count()
    uemb.unpersist()
    # The FAISS index is the one piece held whole on the driver: N x d float32 (1M users x 128 = 512 MB).
    table = spark.read.parquet(staged.path).toArrow()
    _publish(staged, {"interval_end": T.isoformat(), "users": table.num_rows,
                      "rejected": {pc.NONFINITE_USER: n_bad} if n_bad else {}}, clock)
    ids = table.column("user_id").to_numpy()
    vectors = (np.stack(table.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32) if len(ids)
               else np.zeros((0, 1), np.float32))
    del table
    nbr, sim, kstats = knn(ids, vectors, cfg.knn_k, cfg.knn_exact_max)
    nb = spark.createDataFrame(pd.DataFrame({"user_id": ids, "neighbour_ids": list(nbr), "similarities": list(sim)}),
                               "user_id long, neighbour_ids array<long>, similarities array<float>")
    agg = off.read_interval(spark, s.offline, "user_aggregates", T)
    out = pc.neighbour_embeddings(nb, agg, T, version)
    staged = off.stage(out, s.offline, "neighbours", T)
    n = spark.read.parquet(staged.path).count()
    stats = {"interval_end": T.isoformat(), "users_with_history": int(len(ids)), "users_with_neighbour_embedding": n,
             "users_rejected": n_bad, "knn": kstats, "model_version": version,
             "seconds": round(time.perf_counter() - t0, 2)}
    _publish(staged, stats, clock)
    if n_bad:
        logger.warning("neighbours %s: %d users set aside: %s", T, n_bad, pc.NONFINITE_USER)
    logger.info("neighbours %s: %d users embedded, %d with a neighbour embedding, index %s", T, len(ids), n, kstats)
    return stats


JOBS = {"select": select, "embed": embed, "aggregate": aggregate, "neighbours": neighbours}


def run(spark, s: Settings, start, end, steps=SPARK_STEPS, *, events=None, models=None, clock=None) -> dict:
    """Several steps of one interval in one session, in order, with the models resolved once for all of them.

    Returns:
        {step: stats}.
    """
    unknown = [st for st in steps if st not in JOBS]
    if unknown:
        raise ValueError(f"unknown Spark steps {unknown}: {SPARK_STEPS}")
    start, end = interval(start, end)
    if models is None:
        kinds = ({"vm"} if "select" in steps else set()) | ({"fm", "ae"} if "embed" in steps else set())
        models = model_refs.resolve(s.models, [k for k in model_refs.KINDS if k in kinds],
                                    s.precompute.history_len) if kinds else None
    if events is not None:
        events = event_source(events)
    return {st: JOBS[st](spark, s, start, end, events=events, models=models, clock=clock) for st in steps}
