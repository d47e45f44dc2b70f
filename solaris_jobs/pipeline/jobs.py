"""The refresh's Spark steps as library functions: ``select`` (``select_step``), ``embed``, ``aggregate``,
``neighbours`` (``neighbours_step``), each ``step(spark, settings, start, end, *, events=None, models=None,
clock=None) -> stats``, and ``run`` for several in one session. The Airflow tasks (in-process or through
``spark_jobs/*.py`` under spark-submit), the CLI, the backfill and a replay all call these.

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

import logging
import time

import numpy as np
import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import Settings
from solaris_jobs.pipeline import aggregates, history, inference, interval_state, model_refs
from solaris_jobs.pipeline.event_source import event_source
from solaris_jobs.pipeline.interval_state import StateKey
from solaris_jobs.pipeline.neighbours_step import neighbours
from solaris_jobs.pipeline.select_step import select
from solaris_jobs.pipeline.step_common import interval, models_of_interval, publish, releases_caches, with_history_len
from solaris_jobs.pipeline.windows import prior_events, read_from, recent_pairs, union_all

logger = logging.getLogger(__name__)

SPARK_STEPS = ("select", "embed", "aggregate", "neighbours")


def session(s: Settings, app: str = "solaris"):
    """The Spark session the settings describe."""
    from solaris_jobs.pipeline.spark import spark_session
    return spark_session(f"solaris-{app}", s.spark_master, driver_memory=s.spark_driver_memory,
                         log_level=s.spark_log_level)


@releases_caches
def embed(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
          cache=None) -> dict:
    """Batched FM inference: the selected pairs through the FM and the autoencoder's encoder on executors.
    Outputs: ``pair_embeddings`` and, for outputs that are not finite (counted per reason), ``embedding_rejects``."""
    from pyspark.sql import functions as F

    from solaris_jobs.pipeline.spark import parallelism
    t0 = time.perf_counter()
    _, T = interval(start, end)
    if models is None or models.fm is None or models.ae is None:
        models = model_refs.of_settings(s, ("fm", "ae"))
    cfg = with_history_len(s, models)
    version = models.embedding_version
    selected = off.read_interval(spark, s.offline, "selection", T).where("selected").select("user_id", "item_id")
    state = interval_state.read_state(spark, s, cfg, T)
    state_from = "select" if state is not None else "log"
    if state is None:
        state = _state_from_log(spark, s, cfg, T, events, cache, clock)
    hist, uc, ic = state.frames()
    users = inference.pairs_by_user(history.with_counters(selected, uc, ic)).join(hist, "user_id", "left")
    users = users.repartition(parallelism(spark), "user_id").sortWithinPartitions("user_id")
    out = cache(inference.embed_pairs(users, models, T, cfg))
    good = out.where(F.col("reject_reason").isNull()).drop("reject_reason", "model_s")
    bad = out.where(F.col("reject_reason").isNotNull()).select("user_id", "item_id",
                                                               F.col("reject_reason").alias("reason"))
    staged = off.stage(good, s.offline, "pair_embeddings", T)
    staged_bad = off.stage(bad, s.offline, "embedding_rejects", T)
    n = spark.read.parquet(staged.path).count()
    rejected = {r["reason"]: r["count"] for r in spark.read.parquet(staged_bad.path).groupBy("reason").count()
                .collect()}
    model_s = out.agg(F.sum("model_s")).first()[0] or 0.0
    publish(staged_bad, {"interval_end": T.isoformat(), "rows": sum(rejected.values()), "rejected": rejected},
             clock)
    seconds = time.perf_counter() - t0
    stats = {"interval_end": T.isoformat(), "pairs": n, "model_version": version, "seconds": round(seconds, 2),
             "pairs_per_s": round(n / seconds, 1) if seconds else None, "batch_size": cfg.batch_size,
             # The FM and the encoder inside the executors (summed over tasks), apart from reading and writing.
             "model_seconds": round(model_s, 3), "model_pairs_per_s": round(n / model_s, 1) if model_s else None,
             "rejected": rejected, "state_from": state_from, "models": models.to_dict()}
    publish(staged, stats, clock)
    if rejected:
        logger.warning("fm inference %s: set aside %s (not finite): %s", T, rejected,
                       off.interval_uri(s.offline, "embedding_rejects", T))
    logger.info("fm inference %s: %d pairs in %.1fs (%.0f pairs/s, includes reading and writing; the model %.1fs "
                "of task time, %.0f pairs/s)", T, n, seconds, n / seconds if seconds else 0, model_s,
                n / model_s if model_s else 0)
    return stats


def _state_from_log(spark, s: Settings, cfg, T: pd.Timestamp, events, cache, clock) -> interval_state.State:
    """No state from the selection with these settings: the log is read here, and the state written for the
    neighbours step."""
    source = event_source(events, s.data)
    first = read_from(T, cfg.lookback_days)
    fingerprint = source.fingerprints([(first, T)])[0]
    prior = cache(prior_events(source.spark(spark, start=first, end=T), T, cfg.lookback_days))
    state = interval_state.State(*history.interval_state(prior, cfg.history_len))
    key = StateKey(cfg.history_len, cfg.lookback_days, interval_state.selection_run(s, T), cfg.label_delay_minutes)
    interval_state.write_state(spark, s.offline, T, state, key, clock, fingerprint=fingerprint, full_at=T)
    return interval_state.read_state(spark, s, cfg, T)


def _fallback_targets(spark, s: Settings, T: pd.Timestamp, events):
    """(user_id, item_id) of the pairs an item-aware fallback is made for: those ranked in ``[T - recent_hours, T)``,
    missed in ``[T - miss_hours, T)``, or in the interval's selection but not selected (the candidates the per-user
    share left out; under a recency budget these are recent or missed pairs already)."""
    cfg = s.precompute
    parts = []
    if off.is_complete(s.offline, "selection", T):
        parts.append(off.read_interval(spark, s.offline, "selection", T).where("NOT selected")
                     .select("user_id", "item_id"))
    if cfg.recent_hours > 0:
        raw = event_source(events, s.data).spark(spark, start=T - pd.Timedelta(hours=cfg.recent_hours), end=T)
        parts.append(recent_pairs(prior_events(raw, T, cfg.lookback_days), T, cfg.recent_hours)
                     .select("user_id", "item_id"))
    missed = off.read_misses(spark, s.offline, T - pd.Timedelta(hours=cfg.miss_hours), T)
    if missed is not None:
        parts.append(missed.select("user_id", "item_id"))
    if not parts:
        return spark.createDataFrame([], "user_id long, item_id long")
    return union_all(parts).distinct()


def aggregate(spark, s: Settings, start, end, *, events=None, models=None, clock=None) -> dict:
    """User aggregates: per user, the mean of their pair embeddings of the trailing window and their count, of the
    interval's embedding version only; and the item-aware fallbacks (``aggregates.item_aware_fallbacks``) of the
    pairs ranked, missed or left out by the selection lately that have no pair embedding. Outputs:
    ``user_aggregates``, ``pair_fallbacks``."""
    t0 = time.perf_counter()
    _, T = interval(start, end)
    models = models if models is not None and models.fm is not None else models_of_interval(s, T)
    version = models.embedding_version
    window = pd.Timedelta(hours=s.precompute.aggregate_hours)
    ends = [e for e in off.list_intervals(s.offline, "pair_embeddings", since=T - window, before=T + pd.Timedelta(1))
            if e > T - window]
    if T not in ends:
        raise FileNotFoundError(f"no pair embeddings for the interval ending {T}: run embed first")
    latest = aggregates.latest_pairs(off.read_intervals(spark, s.offline, "pair_embeddings", ends), T,
                                     s.precompute.aggregate_hours, version).cache()
    try:
        staged = off.stage(aggregates.user_aggregates(latest, T, version), s.offline,
                           "user_aggregates", T)
        n = spark.read.parquet(staged.path).count()
        # The pairs likely to be ranked soon (recently ranked or missed, or candidates the selection left out) that
        # have no pair embedding of the window: their item-aware fallback.
        targets = (_fallback_targets(spark, s, T, events)
                   .join(latest.select("user_id", "item_id"), ["user_id", "item_id"], "left_anti"))
        with_codes = targets.join(latest.select("user_id").distinct(), "user_id")
        items = [r[0] for r in with_codes.select("item_id").union(latest.select("item_id")).distinct().collect()]
        ids, vecs = inference.item_vectors(models.fm, np.array(items, np.int64))
        fb = aggregates.item_aware_fallbacks(with_codes, latest, ids, vecs, T, version,
                                             s.precompute.item_aware_temperature)
        staged_fb = off.stage(fb, s.offline, "pair_fallbacks", T)
        n_fb = spark.read.parquet(staged_fb.path).count()
    finally:
        latest.unpersist()
    stats = {"interval_end": T.isoformat(), "users": n, "intervals_read": len(ends), "model_version": version,
             "seconds": round(time.perf_counter() - t0, 2)}
    publish(staged_fb, {**stats, "pairs": n_fb, "items": len(ids),
                        "temperature": s.precompute.item_aware_temperature}, clock)
    publish(staged, stats, clock)
    logger.info("user aggregates %s: %d users from %d intervals; %d item-aware fallbacks", T, n, len(ends), n_fb)
    return {**stats, "item_aware_pairs": n_fb}


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
        models = model_refs.of_settings(s, [k for k in model_refs.KINDS if k in kinds]) if kinds else None
    if events is not None:
        events = event_source(events)
    return {st: JOBS[st](spark, s, start, end, events=events, models=models, clock=clock) for st in steps}
