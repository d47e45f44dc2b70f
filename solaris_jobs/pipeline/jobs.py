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
import io
import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core import offline as off
from solaris_jobs.core import uris
from solaris_jobs.core.events import to_utc
from solaris_jobs.core.settings import Settings
from solaris_jobs.pipeline import model_refs
from solaris_jobs.pipeline import precompute as pc
from solaris_jobs.pipeline import retention
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
    first = pc.lookback_start(T, lookback_days)
    if first is None:
        return None
    return min(first, to_utc(start)) if start is not None else first


@_releases_caches
def select(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
           cache=None) -> dict:
    """Candidate selection: active users (+ missed), request-simulator candidates, negative exclusion, verifier
    scores, top share selected. Outputs: ``rejects`` and ``selection`` for the interval, and the interval's state
    that ``embed`` and ``neighbours`` read instead of the log, and the next interval's select updates:
    ``user_histories`` (every user's history at T), ``user_counters`` and ``item_counters``. The state is the
    previous interval's updated with the events since when it can be (``_state_base``), else made from this run's
    one read of the lookback."""
    from pyspark.sql import functions as F
    t0 = time.perf_counter()
    start, T = interval(start, end)
    cfg = s.precompute
    vm = (models.vm if models is not None and models.vm is not None
          else model_refs.resolve(s.models, ("vm",)).vm)
    source = event_source(events, s.data)
    history_len = _state_history_len(s, models)
    base, full_because, log = _state_base(s, cfg, source, start, T, history_len)

    def read(first):
        return source.spark(spark, start=first, end=T)
    # With the previous interval's state (the lookback's histories and counters) and either a pool that may do
    # without the request simulator or the simulator's own state to update, only the hours the pool's windows need
    # are read (the whole lookback later only if the simulator runs without its state); else the whole lookback,
    # once.
    lookback = read_from(T, cfg.lookback_days, start)
    sim_why = _simulator_base(s, cfg, T, history_len, base)      # read once: the stats of the previous interval
    near_only = base is not None and (_simulator_may_be_skipped(cfg) or sim_why is None)
    first = min(start, T - pd.Timedelta(hours=_near_hours(cfg))) if near_only else lookback
    ev = read(first)
    near = cache(pc.prior_events(ev, T, cfg.lookback_days))
    whole = (lambda: near) if first == lookback else functools.cache(
        lambda: cache(pc.prior_events(read(lookback), T, cfg.lookback_days)))
    # Bad rows of the interval itself are set aside with their reason (earlier ones were, by earlier runs).
    _, bad = pc.split_bad_events(ev.where(F.col("event_timestamp") >= F.lit(start.to_pydatetime())))
    staged = off.stage(bad, s.offline, "rejects", T)
    n_bad = spark.read.parquet(staged.path).count()
    rejects_path = _publish(staged, {"interval_end": T.isoformat(), "rows": n_bad}, clock)
    if n_bad:
        logger.warning("set aside %d bad event rows of the interval: %s", n_bad, rejects_path)
    misses = off.read_misses(spark, s.offline, T - pd.Timedelta(hours=cfg.miss_hours), T)
    budgeted = cfg.budget_per_row is not None
    users = cache(pc.active_users(near, T, cfg.active_hours, misses))
    # The events that left the lookback since the previous state (read once, for its counters and co-visits).
    leaving = base[2] if base is not None else None
    gone_events = functools.cache(lambda: cache(_log_between(spark, source, *leaving)))
    hist, uc, ic, full_because = _state_of(spark, s, cfg, source, T, history_len, base, near, whole, cache,
                                           full_because, gone_events)
    if full_because is not None:
        base = None
    recent = pc.recent_pairs(near, T, cfg.recent_hours) if cfg.recent_hours > 0 else None
    n_budget = expected = None
    if budgeted:
        n_budget, expected = pc.budget_pairs(near, start, T, cfg.budget_per_row, cfg.budget_window_hours)
    # One pool: under a budget the misses are candidates like the others (inside the budget); without one they
    # are forced in on top of the verifier's share.
    skipped_simulator = False
    if _simulator_may_be_skipped(cfg):
        # Ranked by recency, the simulator's candidates (never ranked) come after every recently ranked or missed
        # pair: when those alone fill the budget, no simulator candidate can be selected, so none is computed.
        known = cache(pc.candidate_pool(None, recent, misses))
        if known.count() >= n_budget:
            skipped_simulator = True
        else:
            known.unpersist()
    # Without simulator candidates the pool is the one just counted (cached): not computed a second time.
    simulator = None
    if not skipped_simulator:
        simulator = _simulator_of(spark, s, cfg, source, T, base, sim_why, near, whole, cache, gone_events)
        counts, seeds, why, _ = simulator
        # The popularity of the last popularity_hours, from the events read or their own read of the log; of the
        # whole lookback, the item counters.
        popular_from = T - pd.Timedelta(hours=cfg.simulator.popularity_hours)
        events = whole() if why is not None else near if first is None or first <= popular_from else \
            pc.prior_events(read(popular_from), T, cfg.lookback_days)
        totals = ic.select("item_id", F.col("item_cnt").alias("count"))
        sim = pc.candidate_pairs(events, users, T, cfg.simulator, pc.covisit_top(counts, cfg.simulator.covisit_top),
                                 seeds, totals)
    cands = known if skipped_simulator else cache(pc.candidate_pool(sim, recent, misses if budgeted else None))
    past = off.list_intervals(s.offline, "selection", before=T, last=cfg.exclusion_runs) if cfg.exclusion_runs \
        else []
    bottoms = None
    if len(past) == cfg.exclusion_runs and past:
        bottoms = off.read_intervals(spark, s.offline, "selection", past).where("bottom") \
            .select(F.col("run"), "user_id", "item_id")
    kept, excluded = pc.exclude_negatives(cands, bottoms, cfg.exclusion_runs)
    # Without simulator candidates, the budget reaches only the most recently ranked part of the pool: the verifier
    # scores and ranks that part alone, with the ranks and the selection of a ranking of the whole pool.
    reach = pc.budget_reach(kept, n_budget) if skipped_simulator else None
    scored = pc.score_pairs(pc.with_counters(pc.within_reach(kept, reach), uc, ic), vm, cfg).drop(*pc.COUNTER_COLS)
    budget = {}
    if budgeted:
        sel = pc.select_budget(scored, n_budget, cfg.select_priority, cfg.exclusion_share, reach is None)
        budget = {"budget_per_row": cfg.budget_per_row, "budget_pairs": n_budget, "expected_rows": expected,
                  "select_priority": cfg.select_priority, "simulator_skipped": skipped_simulator,
                  "budget_reach": None if reach is None else pd.Timestamp(reach, unit="us", tz="UTC").isoformat()}
    else:
        considered = cands.groupBy("user_id").agg(F.count("*").alias("n_considered"))
        sel = pc.select_pairs(scored, cfg.select_share, cfg.select_scope, cfg.exclusion_share, considered)
        sel = pc.force_misses(sel, misses)
    sel = sel.withColumn("run", F.lit(T.to_pydatetime()).cast("timestamp"))
    n_users, n_cands, n_excl = users.count(), cands.count(), excluded.count()
    staged = off.stage(sel, s.offline, "selection", T)
    state = _write_state(spark, s, T, (hist, uc, ic), history_len, off.RUN + staged.run, clock, log=log,
                         full_at=T if base is None else pd.Timestamp(base[1]["full_at"]), simulator=simulator)
    if state is not None:
        state.update(built="full" if base is None else "incremental", full_because=full_because,
                     pruned=retention.prune_state(s.offline, cfg, T))
    written = spark.read.parquet(staged.path)
    agg = written.agg(F.count("*").alias("rows"), F.count("vm_score").alias("scored"),
                      F.sum(F.col("selected").cast("int")).alias("selected"),
                      F.sum((F.col("source") == "miss").cast("int")).alias("misses")).first()
    rows = {r["source"]: (r["pool"], r["selected"]) for r in written.groupBy("source").agg(
        F.count("*").alias("pool"), F.sum(F.col("selected").cast("int")).alias("selected")).collect()}
    # The pool per source: the selection's rows, or under a reach (the selection holds only that part) the pool's.
    pool = {k: n for k, (n, _) in rows.items()} if reach is None else \
        {r["source"]: r["count"] for r in kept.groupBy("source").count().collect()}
    by_source = {k: {"pool": n, "selected": rows.get(k, (0, 0))[1] or 0} for k, n in pool.items()}
    stats = {"interval_end": T.isoformat(), "rejected_events": n_bad, "users": n_users, "pairs_considered": n_cands,
             "pairs_excluded": n_excl, "exclusion_history_runs": len(past), "pairs_scored": agg["scored"],
             "pairs_beyond_reach": n_cands - n_excl - agg["rows"] if reach is not None else 0,
             "pairs_selected": agg["selected"] or 0,
             "forced_misses": 0 if budgeted else agg["misses"], "by_source": by_source, **budget,
             "select_share": cfg.select_share, "select_scope": cfg.select_scope, "verifier": vm.version,
             "state": state, "seconds": round(time.perf_counter() - t0, 2)}
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
    state = _read_state(spark, s, cfg, T)
    state_from = "select" if state is not None else "log"
    if state is None:
        # No state from the selection with these settings: the log is read here, and the state written for the
        # neighbours step.
        source = event_source(events, s.data)
        log = source.fingerprints([(read_from(T, cfg.lookback_days), T)])[0]
        prior = cache(pc.prior_events(source.spark(spark, start=read_from(T, cfg.lookback_days), end=T), T,
                                      cfg.lookback_days))
        _write_state(spark, s, T, pc.interval_state(prior, cfg.history_len), cfg.history_len, _selection_run(s, T),
                     clock, log=log, full_at=T)
        state = _read_state(spark, s, cfg, T)
    hist, uc, ic = state
    users = pc.pairs_by_user(pc.with_counters(selected, uc, ic)).join(hist, "user_id", "left")
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
             "rejected": rejected, "state_from": state_from, "models": models.to_dict()}
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


def _state_key(history_len: int, lookback_days: float | None, selection_run: str | None) -> dict:
    """What an interval's state must match to be read: the settings that made it, and the published selection it
    was written with (a rerun of select that writes no state, or a selection written otherwise, leaves an older
    state behind: it is then not read)."""
    return {"history_len": history_len, "lookback_days": lookback_days, "selection": selection_run}


def _selection_run(s: Settings, T: pd.Timestamp) -> str | None:
    """The run folder name of the interval's published selection (None: none published)."""
    path = off.published(s.offline, "selection", T)
    return path.rstrip("/").rsplit("/", 1)[-1] if path else None


STATE = off.STATE_DATASETS


def _state_history_len(s: Settings, models) -> int | None:
    """The FM's history length, for the state ``select`` writes: of the run's FM, else of the one under
    ``settings.models`` (None: no FM there, or another history length than configured; no state then, and embed
    reads the log)."""
    try:
        fm = models if models is not None and models.fm is not None else model_refs.resolve(s.models, ("fm",))
        return fm.check_history_len(s.precompute.history_len)
    except (FileNotFoundError, ValueError) as e:
        logger.warning("no FM history length (%s): the interval's state is left to embed", e)
        return None


def _write_state(spark, s: Settings, T: pd.Timestamp, state, history_len: int | None, selection_run: str | None,
                 clock, *, log: str, full_at: pd.Timestamp, simulator=None):
    """Writes the interval's state, ``(user_histories`` (every user's last ``history_len`` events),
    ``user_counters``, ``item_counters)``, for the selection run ``selection_run``, with what the next interval
    needs to update it: the fingerprint of the log's files it was read from (``log``) and when it was last rebuilt
    from the whole lookback (``full_at``). ``simulator``: the request simulator's state, when it ran
    (``_simulator_of``), published last with the same key (a state without it is still whole). Returns its
    stats."""
    if history_len is None:
        return None
    key = {"interval_end": T.isoformat(), **_state_key(history_len, s.precompute.lookback_days, selection_run),
           "log": log, "full_at": full_at.isoformat()}
    staged = {d: off.stage(df, s.offline, d, T) for d, df in zip(STATE, state)}
    rows = {d: spark.read.parquet(st.path).count() for d, st in staged.items()}
    for d, st in staged.items():
        _publish(st, {**key, "rows": rows[d]}, clock)
    out = {**key, "users": rows["user_counters"], "users_with_history": rows["user_histories"],
           "items": rows["item_counters"]}
    if simulator is not None:
        *frames, why, sim_full_at = simulator
        staged = {d: off.stage(df, s.offline, d, T) for d, df in zip(SIMULATOR, frames)}
        rows = {d: spark.read.parquet(st.path).count() for d, st in staged.items()}
        for d, st in staged.items():
            _publish(st, {**key, "rows": rows[d], "full_at": sim_full_at.isoformat(),
                          **_simulator_key(s.precompute)}, clock)
        out["simulator"] = {"covisit_pairs": rows[SIMULATOR[0]], "seeds": rows[SIMULATOR[1]],
                            "built": "full" if why else "incremental", "full_because": why,
                            "full_at": sim_full_at.isoformat()}
    return out


def _near_hours(cfg) -> float:
    """The hours before T that the selection's pool reads (active users, recently ranked pairs, the budget's
    window): all it reads of the log when the state is updated and the request simulator does not run."""
    return max(cfg.active_hours, cfg.recent_hours, cfg.budget_window_hours if cfg.budget_per_row else 0.0)


def _simulator_may_be_skipped(cfg) -> bool:
    """Under a budget ranked by recency, without exclusion, with recently ranked pairs in the pool: the request
    simulator's candidates (never ranked) come after every recently ranked or missed pair, and are not computed
    when those alone fill the budget."""
    return (cfg.budget_per_row is not None and cfg.select_priority == "recency" and not cfg.exclusion_runs
            and cfg.recent_hours > 0)


def _leaving(P: pd.Timestamp, T: pd.Timestamp, lookback_days: float | None):
    """The events of the state at P that have left the lookback at T: ``[start, end)``, or None (none can)."""
    if lookback_days is None:
        return None
    first, last = read_from(P, lookback_days), min(read_from(T, lookback_days), P)
    return (first, last) if first < last else None


STATE_FIELDS = ("interval_end", "history_len", "lookback_days", "log", "full_at")


def _state_base(s: Settings, cfg, source, start: pd.Timestamp, T: pd.Timestamp, history_len: int | None):
    """The previous interval's state this interval's is updated from, and the log's fingerprint to record with it.

    One listing of the log, before anything is read, gives every fingerprint (a file that lands after it is in
    no fingerprint: the next interval sees it and rebuilds): of the hours the new state will hold (recorded), of
    those the previous state held (compared with its record), of those that leave the lookback now (compared again
    after they are read, ``_state_of``).

    Returns:
        ((the previous state's end, its stats, the leaving hours and their fingerprint), None, log), or
        (None, why the state is rebuilt from the whole lookback, log); log is None without a state to write.
    """
    if history_len is None:
        return None, "no FM history length", None
    record = (read_from(T, cfg.lookback_days), T)
    prev = off.list_intervals(s.offline, STATE[0], before=T, last=1)
    if not cfg.state_rebuild_hours or not prev:
        return None, "state_rebuild_hours 0" if prev else "no earlier state", source.fingerprints([record])[0]
    P = prev[0]
    leaving = _leaving(P, T, cfg.lookback_days)
    log, held, left = source.fingerprints([record, (read_from(P, cfg.lookback_days), P), leaving or record])
    if P != start:
        return None, f"the last state ends at {P.isoformat()}, not at this interval's start", log
    stats = [off.read_stats(s.offline, d, P) or {} for d in STATE]
    first = {k: stats[0].get(k) for k in STATE_FIELDS}
    if None in (first["log"], first["full_at"]) or any({k: st.get(k) for k in STATE_FIELDS} != first
                                                       for st in stats[1:]):
        return None, f"the state of {P.isoformat()} is incomplete or from an older version", log
    if (first["history_len"], first["lookback_days"]) != (history_len, cfg.lookback_days):
        return None, f"the state of {P.isoformat()} has another history length or lookback", log
    if T - pd.Timestamp(first["full_at"]) >= pd.Timedelta(hours=cfg.state_rebuild_hours):
        return None, f"its last full rebuild ({first['full_at']}) is {cfg.state_rebuild_hours:g} h old or more", log
    if not all(off.is_complete(s.offline, d, P) for d in STATE):
        return None, f"the state of {P.isoformat()} is gone", log
    if held != first["log"]:
        return None, (f"the events the state of {P.isoformat()} was read from changed since (a late event in an "
                      "old hour, a rewritten file, another event source)"), log
    return (P, stats[0], leaving, left), None, log


def _state_of(spark, s: Settings, cfg, source, T, history_len, base, events, whole, cache, full_because,
              gone_events):
    """The interval's state (histories, user counters, item counters) and why it was rebuilt (None: it was
    updated): with no ``base``, of ``whole()`` (the lookback's events); else the previous interval's updated with
    ``events`` since its end and, with a lookback, less the events that left it (``gone_events()``). When the
    leaving hours' files changed between the listing and their read, the update is dropped for a rebuild."""
    if base is not None:
        from pyspark.sql import functions as F
        P, _, leaving, left = base
        hist, uc, ic = (off.read_interval(spark, s.offline, d, P) for d in STATE)
        new = events.where(F.col("event_timestamp") >= F.lit(P.to_pydatetime()))
        gone = (None, None)
        if leaving is not None:
            gone = pc.counters(gone_events())
        uc, ic = (cache(pc.merge_counters(*x)) for x in zip((uc, ic), pc.counters(new), gone))
        if leaving is None:
            return pc.merge_histories(hist, new, history_len, None), uc, ic, None
        uc.count(), ic.count()                          # the leaving hours are read now
        if source.fingerprints([leaving])[0] == left:
            return pc.merge_histories(hist, new, history_len, read_from(T, cfg.lookback_days)), uc, ic, None
        uc.unpersist(), ic.unpersist()
        full_because = (f"the log's files of {leaving[0].isoformat()}-{leaving[1].isoformat()} changed while they "
                        "were read")
        logger.warning("state of %s: %s; rebuilding it from the whole lookback", T, full_because)
    if history_len is None:                             # no state is written: only the counters are used
        return (None, *pc.counters(whole()), full_because)
    return (*pc.interval_state(whole(), history_len), full_because)


SIMULATOR = off.SIMULATOR_STATE


def _simulator_key(cfg) -> dict:
    return {"covisit_window": cfg.simulator.covisit_window, "history_items": cfg.simulator.history_items}


def _simulator_base(s: Settings, cfg, T: pd.Timestamp, history_len: int | None, base) -> str | None:
    """Why the request simulator's state at T (co-visit counts, seeds) cannot be updated from the previous
    interval's (None: it can). It is updated with the state (``_state_base``, and the update not dropped since)
    when the previous select wrote it along with its state and made it from the whole lookback less than
    ``state_rebuild_hours`` ago."""
    if base is None:
        return "the state is rebuilt"
    window = cfg.simulator.covisit_window
    if history_len is None or history_len < window:
        return f"the histories ({history_len}) are shorter than covisit_window ({window})"
    P, first = base[0], base[1]
    stats = [off.read_stats(s.offline, d, P) or {} for d in SIMULATOR]
    same = ("interval_end", "history_len", "lookback_days", "log", "selection")
    if not all(off.is_complete(s.offline, d, P) for d in SIMULATOR) or any(
            {k: st.get(k) for k in (*same, "full_at")} != {**{k: first.get(k) for k in same},
                                                           "full_at": stats[0].get("full_at")} for st in stats):
        return f"no request simulator state written with the state of {P.isoformat()}"
    if any({k: st.get(k) for k in _simulator_key(cfg)} != _simulator_key(cfg) for st in stats):
        return f"the request simulator state of {P.isoformat()} has another covisit_window or history_items"
    if T - pd.Timestamp(stats[0]["full_at"]) >= pd.Timedelta(hours=cfg.state_rebuild_hours):
        return f"its last full build ({stats[0]['full_at']}) is {cfg.state_rebuild_hours:g} h old or more"
    return None


def _simulator_of(spark, s: Settings, cfg, source, T: pd.Timestamp, base, why, events, whole, cache, gone_events):
    """The request simulator's state at T (cached): the lookback's co-visit counts and each user's latest items
    (seeds); why it was made from the whole lookback (None: updated); when it last was. Updated: the previous
    interval's, with ``events`` since its end (the co-visit pairs whose later event is new, with the last
    ``covisit_window`` events before them from the previous histories) and less the co-visit pairs whose earlier
    event left the lookback (``gone_events()``, with each leaving user's next events: from the previous histories
    where they reach back far enough, else from the log); seeds that left the lookback dropped. ``why``:
    ``_simulator_base`` of the state as it was before the state's update (None: the simulator's can be updated);
    ``base`` None: the state's update was dropped since, so this one is rebuilt too."""
    from pyspark.sql import functions as F
    window, n_seeds = cfg.simulator.covisit_window, cfg.simulator.history_items
    if base is None:
        why = "the state is rebuilt"
    if why is not None:
        return cache(pc.covisit_counts(whole(), window)), cache(pc.user_seeds(whole(), n_seeds)), why, T
    P, _, leaving, _ = base
    prev, seeds, hist = (off.read_interval(spark, s.offline, d, P) for d in (*SIMULATOR, STATE[0]))
    since = read_from(T, cfg.lookback_days)
    new = events.where(F.col("event_timestamp") >= F.lit(P.to_pydatetime()))
    added = pc.covisit_added(pc.history_events(hist, window, since), new, window)
    gone = None
    if leaving is not None:
        gone = pc.covisit_gone(gone_events(), _after_leaving(spark, source, hist, gone_events(), leaving[1], P, window),
                               window)
    full_at = pd.Timestamp(off.read_stats(s.offline, SIMULATOR[0], P)["full_at"])
    return (cache(pc.merge_covisit(prev, added, gone)), cache(pc.merge_seeds(seeds, new, n_seeds, since)), None,
            full_at)


def _log_between(spark, source, start: pd.Timestamp, end: pd.Timestamp):
    """The log's valid events in ``[start, end)`` (``pc.PRIOR_COLS``)."""
    return pc.prior_events(source.spark(spark, start=start, end=end), end, None)


def _after_leaving(spark, source, hist, leaving, b: pd.Timestamp, P: pd.Timestamp, window: int):
    """Each leaving user's first ``window`` events in ``[b, P)`` (b: the end of the leaving events, P: the previous
    state's cutoff). The previous histories hold every event of a user from their oldest entry on: the events
    after it come from there, those in ``[b, oldest entry]`` (users with more than a history's worth of events
    since b) from the log, read up to the latest such entry."""
    from pyspark.sql import functions as F
    b_us = pd.Timestamp(b).value // 1000
    oldest = (hist.join(leaving.select("user_id").distinct(), "user_id", "left_semi")
              .select("user_id", F.col("hist_ts")[0].alias("_oldest")))
    held = (pc.history_events(hist.join(oldest.select("user_id"), "user_id", "left_semi"), None)
            .join(oldest, "user_id").where((F.unix_micros("event_timestamp") >= b_us)
                                           & (F.unix_micros("event_timestamp") > F.col("_oldest"))).drop("_oldest"))
    short = oldest.where(F.col("_oldest") >= b_us)
    last = short.agg(F.max("_oldest")).first()[0]
    if last is not None:
        logged = (_log_between(spark, source, b, min(P, pd.Timestamp(last + 1, unit="us", tz="UTC")))
                  .join(F.broadcast(short), "user_id")
                  .where(F.unix_micros("event_timestamp") <= F.col("_oldest")).select(*held.columns))
        held = held.unionByName(logged)
    return pc.first_events(held, window)


def _read_state(spark, s: Settings, cfg, T: pd.Timestamp):
    """(user_histories, user_counters, item_counters) of the interval when they were made with ``cfg``'s history
    length and lookback for the interval's published selection, else None."""
    want = _state_key(cfg.history_len, cfg.lookback_days, _selection_run(s, T))
    for d in STATE:
        stats = off.read_stats(s.offline, d, T) or {}
        if {k: stats.get(k) for k in want} != want:
            return None
    try:
        return tuple(off.read_interval(spark, s.offline, d, T) for d in STATE)
    except FileNotFoundError:                      # replaced or removed since its stats were read
        logger.info("the state of %s is gone: reading the log", T)
        return None


KNN_STATE_SETTINGS = ("knn_k", "knn_exact_max", "knn_hnsw_m", "knn_ef_search", "history_len", "lookback_days")


def _knn_base(s: Settings, cfg, T: pd.Timestamp, version: str):
    """What an ``active`` interval builds on: (the previous interval's end, the end of the full interval whose
    index it queries), or None and why this interval is a full one."""
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
    return (prev[0], index_at), None


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


@_releases_caches
def neighbours(spark, s: Settings, start, end, *, events=None, models=None, clock=None,
               cache=None) -> dict:
    """FM user embeddings (executors), FAISS top-k (the driver: the index is one piece), and each user's neighbour
    embedding = similarity-weighted mean of the neighbours' aggregates. Outputs: ``user_embeddings`` (vector,
    when it was computed, neighbour list), ``neighbours``, and at a full interval ``knn_index``.

    ``knn_requery = all``: every interval is full (every user with history embedded, indexed and queried).
    ``active``: only users with an event since the previous interval are embedded and queried, against the index
    of the last full interval; the others keep their vector and neighbour list; users whose whole history left the
    lookback drop out. A full interval comes every ``knn_rebuild_hours`` (so a kept vector is at most that old)
    and whenever the previous state cannot be used (``_knn_base``)."""
    from pyspark.sql import functions as F

    from solaris_jobs.pipeline import knn
    t0 = time.perf_counter()
    _, T = interval(start, end)
    models = models if models is not None and models.fm is not None else _models_of_interval(s, T)
    cfg = _with_history_len(s, models)
    version = models.embedding_version
    source = event_source(events, s.data)

    def prior(first=read_from(T, cfg.lookback_days)):
        return pc.prior_events(source.spark(spark, start=first, end=T), T, cfg.lookback_days)
    base, full_because = _knn_base(s, cfg, T, version)
    # Every user's history and who has events in the lookback: the interval's state when it was made with these
    # settings, else the log.
    state = _read_state(spark, s, cfg, T)
    reused = state is not None
    hist = state[0] if reused else pc.user_histories(prior(), cfg.history_len)
    if base is not None:
        changed = cache(prior(base[0]).select("user_id").distinct())
        hist = hist.join(changed, "user_id", "left_semi")
    uemb = cache(pc.embed_users(hist, models.fm, T, cfg))
    n_bad = uemb.where(F.col("reject_reason").isNotNull()).count()
    # In user order: the index's rows (and so FAISS's order among equal similarities) do not depend on where the
    # histories came from (the interval's state, or computed here).
    new = uemb.where(F.col("reject_reason").isNull()).select("user_id", "vector").toArrow().sort_by("user_id")
    uemb.unpersist()
    new_ids = new.column("user_id").to_numpy()
    prev = off.read_table(s.offline, "user_embeddings", base[0]) if base is not None else None
    # The vector width: of this interval's vectors, else (an active interval where nobody changed) the kept ones.
    widths = [len(t.column("vector")[0]) for t in (new, prev) if t is not None and t.num_rows]
    dim = widths[0] if widths else 0
    new_vec = _matrix(new.column("vector"), dim, np.float32)
    del new
    ids, vectors, at = new_ids, new_vec, np.full(len(new_ids), T.value // 1000, np.int64)
    carried = 0
    if base is None:
        # The FAISS index is the one piece held whole on the driver: N x d float32 (1M users x 128 = 512 MB).
        index, kind = knn.build_index(vectors, cfg.knn_exact_max, cfg.knn_hnsw_m) if len(ids) else (None, "none")
        index_ids, index_at = ids, T
    else:
        _, index_at = base
        now = (state[1] if reused else prior()).select("user_id").distinct().toArrow().column(0).to_numpy()
        gone = np.concatenate([changed.toArrow().column(0).to_numpy(), new_ids])
        prev_ids = prev.column("user_id").to_numpy()
        keep = np.isin(prev_ids, now) & ~np.isin(prev_ids, gone)
        carried = int(keep.sum())
        prev = prev.filter(pa.array(keep))
        folder = off.require(s.offline, "knn_index", index_at)
        index = knn.deserialize(off.read_bytes(uris.join(folder, "index.faiss")))
        index_ids = np.load(io.BytesIO(off.read_bytes(uris.join(folder, "ids.npy"))))
        kind = (off.read_stats(s.offline, "knn_index", index_at) or {}).get("index")
    kk = min(cfg.knn_k, max(len(index_ids) - 1, 0))
    t_knn = time.perf_counter()
    if kk and len(ids):
        order = np.argsort(index_ids, kind="stable")
        pos = np.searchsorted(index_ids, ids, sorter=order)
        pos = np.minimum(pos, len(order) - 1)
        own = np.where(index_ids[order[pos]] == ids, order[pos], -1)
        rows, sim = knn.search(index, vectors, own, kk, cfg.knn_ef_search)
    else:
        rows, sim = np.full((len(ids), kk), -1, np.int64), np.zeros((len(ids), kk), np.float32)
    nbr = knn.to_ids(index_ids, rows)
    kstats = {"index": kind, "users": int(len(index_ids)), "k": kk, "queried": int(len(ids)),
              "seconds": round(time.perf_counter() - t_knn, 2), "index_from": index_at.isoformat()}
    if base is None and kind == "hnsw":
        q = np.random.default_rng(0).choice(len(ids), min(1000, len(ids)), replace=False)
        kstats["recall_at_k"] = knn.recall_at_k(index, vectors, rows[q], q, kk)
    if base is not None and carried:
        ids = np.concatenate([ids, prev.column("user_id").to_numpy()])
        vectors = np.concatenate([vectors, _matrix(prev.column("vector"), dim, np.float32)])
        at = np.concatenate([at, prev.column("embedded_at").cast(pa.int64()).to_numpy()])
        nbr = np.concatenate([nbr, _matrix(prev.column("neighbour_ids"), kk, np.int64)])
        sim = np.concatenate([sim, _matrix(prev.column("similarities"), kk, np.float32)])
        del prev
    order = np.argsort(ids, kind="stable")
    table = pa.table({"user_id": pa.array(ids[order], pa.int64()), "vector": _lists(vectors[order], pa.float32()),
                      "embedded_at": pa.array(at[order], pa.timestamp("us", tz="UTC")),
                      "neighbour_ids": _lists(nbr[order], pa.int64()),
                      "similarities": _lists(sim[order], pa.float32())})
    del vectors
    state = {"model_version": version, "settings": {k: getattr(cfg, k) for k in KNN_STATE_SETTINGS},
             "index_from": index_at.isoformat()}
    if base is None and index is not None and cfg.knn_requery == "active":
        # The index is published before the state that names it, so a state never points at a missing index (and
        # only where an active interval will read it: under `all` nothing does).
        _publish(off.stage_files(s.offline, "knn_index", T, {"index.faiss": knn.serialize(index),
                                                             "ids.npy": _npy(index_ids)}),
                 {"interval_end": T.isoformat(), "index": kind, "users": int(len(index_ids)),
                  "model_version": version}, clock)
    del index
    staged = off.stage_table(table, s.offline, "user_embeddings", T)
    del table
    path = _publish(staged, {"interval_end": T.isoformat(), "users": int(len(ids)), "embedded": int(len(new_ids)),
                             "carried": carried, "rejected": {pc.NONFINITE_USER: n_bad} if n_bad else {},
                             "knn_state": state}, clock)
    nb = spark.read.parquet(path).select("user_id", "neighbour_ids", "similarities")
    agg = off.read_interval(spark, s.offline, "user_aggregates", T)
    out = pc.neighbour_embeddings(nb, agg, T, version)
    staged = off.stage(out, s.offline, "neighbours", T)
    n = spark.read.parquet(staged.path).count()
    stats = {"interval_end": T.isoformat(), "users_with_history": int(len(ids)), "users_embedded": int(len(new_ids)),
             "users_carried": carried, "users_with_neighbour_embedding": n, "users_rejected": n_bad,
             "full": base is None, "full_because": full_because, "histories_reused": reused,
             "user_batch_size": cfg.user_batch_size, "knn": kstats,
             "model_version": version, "seconds": round(time.perf_counter() - t0, 2)}
    _publish(staged, stats, clock)
    if n_bad:
        logger.warning("neighbours %s: %d users set aside: %s", T, n_bad, pc.NONFINITE_USER)
    logger.info("neighbours %s: %d users embedded, %d carried, %d with a neighbour embedding, index %s", T,
                len(new_ids), carried, n, kstats)
    return stats


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


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
