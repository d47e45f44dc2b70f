"""The refresh's first Spark step, ``select``: which pairs go to the FM for the interval ``[start, T)``.

Its phases: plan what to read of the log (``_read_log``), set the interval's bad rows aside, bring the interval's
state up to date (``interval_state``), build the candidate pool (recently ranked pairs, misses, the request
simulator's candidates), exclude negatives and score with the verifier, select, and write the selection, the state
and their stats.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import PrecomputeConfig, Settings
from solaris_jobs.pipeline import history, interval_state, model_refs, retention, selection, simulator, verifier
from solaris_jobs.pipeline.event_source import event_source
from solaris_jobs.pipeline.interval_state import Base, LogReads, SimulatorState, State, StateKey, StateRun
from solaris_jobs.pipeline.step_common import Clock, interval, publish, releases_caches
from solaris_jobs.pipeline.windows import active_users, prior_events, read_from, recent_pairs, split_bad_events

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pool:
    """The interval's candidate pool (cached) and how it was made.

    Attributes:
        pairs: (user_id, item_id, source, retrieval_score, last_seen), a pair once.
        sim: the request simulator's state, when it ran (None: skipped, the budget was full without it).
        budget: (pairs, expected rows) of the FM budget, or None (the per-user share).
    """
    pairs: object
    sim: SimulatorState | None
    budget: tuple[int, float] | None

    @property
    def simulator_skipped(self) -> bool:
        return self.budget is not None and self.sim is None


@dataclass(frozen=True)
class Scored:
    """The pool after negative exclusion, scored by the verifier: ``kept`` (the pool less the excluded pairs),
    ``excluded``, the past selections exclusion read, the budget's reach (None: the whole pool is scored) and
    ``pairs`` (the scored part of ``kept``, with ``vm_score``)."""
    kept: object
    excluded: object
    past: list
    reach: int | None
    pairs: object


@releases_caches
def select(spark, s: Settings, start, end, *, events=None, models=None, clock=None, cache=None) -> dict:
    """Candidate selection: active users (+ missed), request-simulator candidates, negative exclusion, verifier
    scores, top share selected. Outputs: ``rejects`` and ``selection`` for the interval, and the interval's state
    that ``embed`` and ``neighbours`` read instead of the log, and the next interval's select updates
    (``interval_state``). The state is the previous interval's updated with the events since when it can be, else
    made from this run's one read of the lookback."""
    from pyspark.sql import functions as F
    t0 = time.perf_counter()
    start, T = interval(start, end)
    vm = (models.vm if models is not None and models.vm is not None
          else model_refs.resolve(s.models, ("vm",)).vm)
    run = StateRun(spark, s, event_source(events, s.data), T, _state_history_len(s, models), cache)
    base = interval_state.previous_state(run, start)
    sim_why = interval_state.simulator_rebuild_reason(run, base.previous)   # before the state's update
    first, raw, reads = _read_log(run, start, base, sim_why)
    n_bad = _set_aside_bad_events(run, start, raw, clock)
    misses = off.read_misses(spark, s.offline, T - pd.Timedelta(hours=s.precompute.miss_hours), T)
    users = cache(active_users(reads.near, T, s.precompute.active_hours, misses))
    state, why = interval_state.update_state(run, base, reads)
    if why is not None:
        base = Base(None, why, base.fingerprint)
    pool = _pool(run, start, first, reads, state, users, misses, base, sim_why)
    scored = _exclude_and_score(run, pool, state, vm)
    chosen = _choose(s.precompute, pool, scored, misses)
    counts = {"users": users.count(), "pairs_considered": pool.pairs.count(),
              "pairs_excluded": scored.excluded.count(), "exclusion_history_runs": len(scored.past)}
    staged = off.stage(chosen.withColumn("run", F.lit(T.to_pydatetime()).cast("timestamp")), s.offline, "selection",
                       T)
    state_stats = _write_state(run, staged, state, pool, base, clock)
    written = _selection_counts(spark.read.parquet(staged.path), pool, scored, counts["pairs_considered"],
                                counts["pairs_excluded"])
    stats = {"interval_end": T.isoformat(), "rejected_events": n_bad, **counts, **written,
             **_budget_stats(s.precompute, pool, scored.reach), "select_share": s.precompute.select_share,
             "select_scope": s.precompute.select_scope, "verifier": vm.version, "state": state_stats,
             "seconds": round(time.perf_counter() - t0, 2)}
    publish(staged, stats, clock)
    logger.info("selection %s: %d users, %d pairs considered, %d excluded by negative exclusion (VM scoring "
                "saved), %d selected for the FM%s", T, counts["users"], counts["pairs_considered"],
                counts["pairs_excluded"], stats["pairs_selected"],
                f" (budget {pool.budget[0]})" if pool.budget is not None else "")
    return stats


def _state_history_len(s: Settings, models) -> int | None:
    """The FM's history length, for the state ``select`` writes: of the run's FM, else of the one under
    ``settings.models`` (None: no FM there, or another history length than configured; no state then, and embed
    reads the log)."""
    from models.protocol import FMRefused
    try:
        fm = models if models is not None and models.fm is not None else model_refs.resolve(
            s.models, ("fm",), fm_factory=s.fm_factory)
        return fm.check_history_len(s.precompute.history_len)
    except FMRefused:
        raise                           # an FM that breaks the protocol stops the run before it writes anything
    except (FileNotFoundError, ValueError) as e:
        logger.warning("no FM history length (%s): the interval's state is left to embed", e)
        return None


def _near_hours(cfg: PrecomputeConfig) -> float:
    """The hours before T that the selection's pool reads (active users, recently ranked pairs, the budget's
    window): all it reads of the log when the state is updated and the request simulator does not run."""
    return max(cfg.active_hours, cfg.recent_hours, cfg.budget_window_hours if cfg.budget_per_row else 0.0)


def _simulator_may_be_skipped(cfg: PrecomputeConfig) -> bool:
    """Under a budget ranked by recency, without exclusion, with recently ranked pairs in the pool: the request
    simulator's candidates (never ranked) come after every recently ranked or missed pair, and are not computed
    when those alone fill the budget."""
    return (cfg.budget_per_row is not None and cfg.select_priority == "recency" and not cfg.exclusion_runs
            and cfg.recent_hours > 0)


def _read_log(run: StateRun, start: pd.Timestamp, base: Base, sim_why: str | None):
    """What the run reads of the log. With the previous interval's state (the lookback's histories and counters)
    and either a pool that may do without the request simulator or the simulator's own state to update, only the
    hours the pool's windows need are read (the whole lookback later, only if the simulator runs without its
    state); else the whole lookback, once.

    Returns:
        (the first event time read (None: the whole log), the raw rows read, the ``LogReads``).
    """
    cfg, T = run.cfg, run.T
    lookback = read_from(T, cfg.lookback_days, start)
    near_only = base.previous is not None and (_simulator_may_be_skipped(cfg) or sim_why is None)
    # The previous state's last ``label_delay_minutes`` are read again (their labels arrived since).
    first = (min(start - pd.Timedelta(minutes=cfg.label_delay_minutes), T - pd.Timedelta(hours=_near_hours(cfg)))
             if near_only else lookback)
    raw = run.source.spark(run.spark, start=first, end=T)
    near = run.cache(prior_events(raw, T, cfg.lookback_days))
    whole = (lambda: near) if first == lookback else functools.cache(
        lambda: run.cache(prior_events(run.source.spark(run.spark, start=lookback, end=T), T, cfg.lookback_days)))
    leaving = base.previous.leaving if base.previous is not None else None
    gone = functools.cache(lambda: run.cache(run.log_between(*leaving)))
    return first, raw, LogReads(near, whole, gone)


def _set_aside_bad_events(run: StateRun, start: pd.Timestamp, raw, clock: Clock | None) -> int:
    """Writes the interval's own bad rows with their reason (``rejects``; earlier ones were, by earlier runs)."""
    from pyspark.sql import functions as F
    _, bad = split_bad_events(raw.where(F.col("event_timestamp") >= F.lit(start.to_pydatetime())))
    staged = off.stage(bad, run.settings.offline, "rejects", run.T)
    n_bad = run.spark.read.parquet(staged.path).count()
    path = publish(staged, {"interval_end": run.T.isoformat(), "rows": n_bad}, clock)
    if n_bad:
        logger.warning("set aside %d bad event rows of the interval: %s", n_bad, path)
    return n_bad


def _pool(run: StateRun, start, first, reads: LogReads, state: State, users, misses, base: Base,
          sim_why: str | None) -> Pool:
    """One pool: under a budget the misses are candidates like the others (inside the budget); without one they are
    forced in on top of the verifier's share (``_choose``). Ranked by recency, the simulator's candidates (never
    ranked) come after every recently ranked or missed pair: when those alone fill the budget, no simulator
    candidate can be selected, so none is computed, and the pool is the one just counted (cached)."""
    cfg, T = run.cfg, run.T
    recent = recent_pairs(reads.near, T, cfg.recent_hours) if cfg.recent_hours > 0 else None
    budget = None
    if cfg.budget_per_row is not None:
        budget = selection.budget_pairs(reads.near, start, T, cfg.budget_per_row, cfg.budget_window_hours)
    if _simulator_may_be_skipped(cfg):
        known = run.cache(selection.candidate_pool(None, recent, misses))
        if known.count() >= budget[0]:
            return Pool(known, None, budget)
        known.unpersist()
    sim = interval_state.simulator_state(run, base.previous, sim_why, reads)
    candidates = _simulated(run, first, reads, state, users, sim)
    pairs = run.cache(selection.candidate_pool(candidates, recent, misses if budget is not None else None))
    return Pool(pairs, sim, budget)


def _simulated(run: StateRun, first, reads: LogReads, state: State, users, sim: SimulatorState):
    """The request simulator's candidates of the active users. The popularity of the last ``popularity_hours``
    comes from the events read or their own read of the log; of the whole lookback, from the item counters."""
    from pyspark.sql import functions as F
    cfg, T = run.cfg, run.T
    popular_from = T - pd.Timedelta(hours=cfg.simulator.popularity_hours)
    if sim.rebuild_because is not None:
        recent = reads.whole()
    elif first is None or first <= popular_from:
        recent = reads.near
    else:
        recent = prior_events(run.source.spark(run.spark, start=popular_from, end=T), T, cfg.lookback_days)
    totals = state.item_counters.select("item_id", F.col("item_cnt").alias("count"))
    return simulator.candidate_pairs(recent, users, T, cfg.simulator,
                                     simulator.covisit_top(sim.covisit, cfg.simulator.covisit_top), sim.seeds, totals)


def _exclude_and_score(run: StateRun, pool: Pool, state: State, vm) -> Scored:
    """Negative exclusion against the last ``exclusion_runs`` selections, then the verifier's scores. Without
    simulator candidates, the budget reaches only the most recently ranked part of the pool: the verifier scores
    and ranks that part alone, with the ranks and the selection of a ranking of the whole pool."""
    from pyspark.sql import functions as F
    cfg, offline = run.cfg, run.settings.offline
    past = off.list_intervals(offline, "selection", before=run.T, last=cfg.exclusion_runs) \
        if cfg.exclusion_runs else []
    bottoms = None
    if len(past) == cfg.exclusion_runs and past:
        bottoms = off.read_intervals(run.spark, offline, "selection", past).where("bottom") \
            .select(F.col("run"), "user_id", "item_id")
    kept, excluded = selection.exclude_negatives(pool.pairs, bottoms, cfg.exclusion_runs)
    reach = selection.budget_reach(kept, pool.budget[0]) if pool.simulator_skipped else None
    with_counts = history.with_counters(selection.within_reach(kept, reach), state.user_counters,
                                        state.item_counters)
    scored = verifier.score_pairs(with_counts, vm, cfg).drop(*history.COUNTER_COLS)
    return Scored(kept, excluded, past, reach, scored)


def _choose(cfg: PrecomputeConfig, pool: Pool, scored: Scored, misses):
    """The selection: a budget of pairs ranked by ``select_priority``, else the top ``select_share`` of the pairs
    considered (per user or global) with the misses forced in; stamped with the run."""
    from pyspark.sql import functions as F
    if pool.budget is not None:
        sel = selection.select_budget(scored.pairs, pool.budget[0], cfg.select_priority, cfg.exclusion_share,
                                      scored.reach is None)
    else:
        considered = pool.pairs.groupBy("user_id").agg(F.count("*").alias("n_considered"))
        sel = selection.select_pairs(scored.pairs, cfg.select_share, cfg.select_scope, cfg.exclusion_share,
                                     considered)
        sel = selection.force_misses(sel, misses)
    return sel


def _write_state(run: StateRun, staged: off.Staged, state: State, pool: Pool, base: Base, clock) -> dict | None:
    """Publishes the interval's state for the staged selection, then prunes old states; its stats (None: no FM
    history length, no state written)."""
    if run.history_len is None:
        return None
    cfg, prev = run.cfg, base.previous
    key = StateKey(run.history_len, cfg.lookback_days, off.RUN + staged.run, cfg.label_delay_minutes)
    out = interval_state.write_state(
        run.spark, run.settings.offline, run.T, state, key, clock, fingerprint=base.fingerprint,
        full_at=run.T if prev is None else pd.Timestamp(prev.stats["full_at"]), sim=pool.sim,
        sim_key=interval_state.simulator_key(cfg))
    out.update(built="full" if prev is None else "incremental", full_because=base.rebuild_because,
               pruned=retention.prune_state(run.settings.offline, cfg, run.T))
    return out


def _selection_counts(written, pool: Pool, scored: Scored, considered: int, excluded: int) -> dict:
    """What the written selection holds: pairs scored, beyond the budget's reach and selected, forced misses, and
    per source the pool and the selected pairs (the pool's own counts under a reach: the selection holds only the
    part it reaches)."""
    from pyspark.sql import functions as F
    agg = written.agg(F.count("*").alias("rows"), F.count("vm_score").alias("scored"),
                      F.sum(F.col("selected").cast("int")).alias("selected"),
                      F.sum((F.col("source") == "miss").cast("int")).alias("misses")).first()
    rows = {r["source"]: (r["pool"], r["selected"]) for r in written.groupBy("source").agg(
        F.count("*").alias("pool"), F.sum(F.col("selected").cast("int")).alias("selected")).collect()}
    pool_rows = {k: n for k, (n, _) in rows.items()} if scored.reach is None else \
        {r["source"]: r["count"] for r in scored.kept.groupBy("source").count().collect()}
    return {"pairs_scored": agg["scored"],
            "pairs_beyond_reach": considered - excluded - agg["rows"] if scored.reach is not None else 0,
            "pairs_selected": agg["selected"] or 0, "forced_misses": 0 if pool.budget is not None else agg["misses"],
            "by_source": {k: {"pool": n, "selected": rows.get(k, (0, 0))[1] or 0} for k, n in pool_rows.items()}}


def _budget_stats(cfg: PrecomputeConfig, pool: Pool, reach: int | None) -> dict:
    if pool.budget is None:
        return {}
    return {"budget_per_row": cfg.budget_per_row, "budget_pairs": pool.budget[0], "expected_rows": pool.budget[1],
            "select_priority": cfg.select_priority, "simulator_skipped": pool.simulator_skipped,
            "budget_reach": None if reach is None else pd.Timestamp(reach, unit="us", tz="UTC").isoformat()}
