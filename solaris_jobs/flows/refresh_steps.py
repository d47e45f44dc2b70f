"""The refresh as task functions, one per step, for one interval ``[start, end)``: what the Airflow DAG's tasks
call, what ``solaris backfill`` runs without a scheduler, and the one interval loop (``run_intervals``) behind
``backfill`` and the CLI's job and materialize commands. Each step returns a JSON-able stats dict (the task's XCom).

Settings: one ``solaris_jobs.core.settings.Settings`` object (the Airflow tasks build it from the worker's
environment with ``Settings.from_env()``). The Spark steps are ``solaris_jobs.pipeline.jobs``; the others are here.
Every step takes the doors a replay needs: ``events`` (an event source read once), ``clock`` (what "now" is for expiry,
freshness and timestamps) and, for the Spark steps, ``models`` (resolved once) and ``spark`` (a session to reuse).
"""
from __future__ import annotations

import json
import logging
import time

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import Settings
from solaris_jobs.pipeline import jobs
from solaris_jobs.pipeline.event_source import event_source
from solaris_jobs.pipeline.jobs import SPARK_STEPS
from solaris_jobs.pipeline.step_common import interval, wall_clock

logger = logging.getLogger(__name__)

STEPS = ("validate", "drain_misses", *SPARK_STEPS, "report", "materialize")
OUTPUTS = ("selection", "pair_embeddings", "user_aggregates", "neighbours")       # what makes an interval complete
STEP_OUTPUT = dict(zip(SPARK_STEPS, OUTPUTS))           # the offline dataset each Spark step publishes


def store(s: Settings):
    """The online store the settings' Feast repo names."""
    from solaris_jobs.online import store_config
    return store_config.of_settings(s)


def validate(s: Settings, start, end, *, events=None, clock=None) -> dict:
    """The interval's events are readable and in the contract; counts (an empty hour is allowed, and said).

    Rows that read but break the contract (ids <= 0, labels other than 0/1) are counted per reason; selection
    sets them aside into ``rejects``. More than ``max_bad_share`` of the interval's rows bad fails the task: an
    upstream log that broke is stopped here, before hours of FM inference run on what is left of it. So does an
    interval that starts more than a day after the clock's now.
    """
    from solaris_jobs.core.events import DataContractError, bad_event_counts
    from solaris_jobs.core.settings import env_var
    start, end = interval(start, end)
    now = (clock or wall_clock)()
    if start > now + pd.Timedelta(days=1):
        # Its events have not happened: a wrong clock, or --start/--end of another year; rows time-stamped that far
        # ahead in a log are set aside by training (events.FUTURE_REASON) and never read by an earlier interval.
        raise DataContractError(f"the interval [{start.isoformat()}, {end.isoformat()}) starts more than a day "
                                f"after now ({now.isoformat()}): check the clock and the interval bounds")
    source = event_source(events, s.data)
    t = source.table(start, end)
    n = t.num_rows
    users = len(set(t.column("user_id").to_pylist())) if n else 0
    bad = bad_event_counts(t)
    n_bad = sum(bad.values())
    if not n:
        logger.warning("no events in [%s, %s): the refresh still runs on the earlier log", start, end)
    elif n_bad > s.max_bad_share * n:
        raise DataContractError(
            f"{source.describe()} [{start.isoformat()}, {end.isoformat()}): {n_bad} of {n} rows break the event "
            f"contract ({', '.join(f'{k}: {v}' for k, v in bad.items() if v)}), more than "
            f"{env_var('max_bad_share')}={s.max_bad_share}; fix the log (or raise the limit) and rerun the interval")
    elif n_bad:
        logger.warning("[%s, %s): %d of %d rows will be set aside: %s", start, end, n_bad, n, bad)
    return {"interval_start": start.isoformat(), "interval_end": end.isoformat(), "events": n, "users": users,
            "bad_events": {k: v for k, v in bad.items() if v}}


def drain_miss_stream(s: Settings, start=None, end=None, **_) -> dict:
    """Moves the serving miss stream (Redis) into ``<offline>/misses/`` before selection reads it."""
    cfg = store(s)
    if cfg.kind != "redis":
        return {"skipped": "the SQLite store's misses are written to <offline>/misses/ directly"}
    from solaris_jobs.online.misses import drain_misses
    return drain_misses(cfg, s.offline)


def materialize_interval(s: Settings, start, end, *, clock=None, views=None, always_check: bool = False,
                         **_) -> dict:
    """The interval's five views into the online store (``solaris_jobs.online.materialize``), expiring by the clock."""
    from solaris_jobs.online.materialize import materialize
    start, end = interval(start, end)
    return materialize(store(s), s.offline, end, views, expire_from=s.expire_from, start=start,
                       now=clock() if clock else None, always_check=always_check)


def report(s: Settings, start, end, *, events=None, clock=None) -> dict:
    """Coverage and freshness of the interval, before its own features are written.

    Coverage: the interval's logged rows (its requests) served again through ``FeatureReader`` at their own times
    from the online store as the interval found it (the DAG runs this step before ``materialize``): per tier the
    share of rows, with every view's TTL, the embedding version of the current models and "nothing newer than the
    request" applied, exactly as serving does (``online.coverage.tier_summary``; the evaluation uses the same); before
    the first materialization (``store_empty``) every row is tier none and the store is not read. Freshness:
    the newest materialized interval and how old the interval's features are now (the clock). Written to
    ``<offline>/reports/end=.../report.json`` and returned.
    """
    from solaris_jobs.online.coverage import Server, tier_summary
    from solaris_jobs.online.materialize import materialized_intervals
    from solaris_jobs.pipeline import model_refs
    start, end = interval(start, end)
    source = event_source(events, s.data)
    ev = source.table(start, end, columns=["user_id", "item_id", "event_timestamp", "label", "request_id"])
    cfg = store(s)
    models = model_refs.of_settings(s, ("fm", "ae"))
    stored = materialized_intervals(cfg)
    latest = max(stored) if stored else None
    server = Server(ev, cfg, models.embedding_version, int(models.ae.config["d_code"]), env=None)
    served = {}
    try:
        if stored:                 # before the first materialization there is no store: every row is tier none
            server.serve_until(end)
            served = server.metrics()["counts"]
    finally:
        server.close()
    summary = tier_summary(server.tier, server.age)
    now = (clock or wall_clock)()
    out = {"interval_start": start.isoformat(), "interval_end": end.isoformat(), "events": ev.num_rows,
           "requests": server.n_requests, **summary,
           "coverage": summary["coverage"] if ev.num_rows else {k: None for k in summary["coverage"]},
           "embedding_version": models.embedding_version, "store": cfg.describe(),
           "fail_open": int(served.get("fail_open", 0)), "store_empty": not stored,
           "latest_materialized_end": latest.isoformat() if latest else None,
           "feature_age_hours_now": round((now - end).total_seconds() / 3600, 2)}
    off.write_report(s.offline, end, out)
    return out


_LOCAL_STEPS = {"validate": validate, "drain_misses": drain_miss_stream, "materialize": materialize_interval,
                "report": report}


def run_step(s: Settings, step: str, start, end, spark=None, *, events=None, models=None, clock=None,
             owner: str | None = None) -> dict:
    """Any step by name for the interval; the stats as plain JSON types (an Airflow XCom).

    Args:
        spark: a session to reuse for the Spark steps (None: ``jobs.session(s)``).
        events, models, clock: see ``solaris_jobs.pipeline.jobs``; pass an ``event_source.EventTable`` to share one
            cached Spark copy of events in memory across calls.
        owner: the run this step belongs to (an Airflow run id, a backfill's id): the step holds the interval's
            lease for it (``leased``); None: no lease (a replay, a test that owns its store).

    Raises:
        lease.LeaseHeld: another run holds the interval.
    """
    start, end = interval(start, end)
    if step not in SPARK_STEPS and step not in _LOCAL_STEPS:
        raise ValueError(f"unknown step {step!r}: {STEPS}")

    def go() -> dict:
        if step in SPARK_STEPS:
            return jobs.run(spark or jobs.session(s, step), s, start, end, (step,), events=events, models=models,
                            clock=clock)[step]
        return _LOCAL_STEPS[step](s, start, end, events=events, clock=clock)

    out = leased(s, end, owner, go, release=step == STEPS[-1]) if owner else go()
    return json.loads(json.dumps(out, default=str))


def published_stats(s: Settings, step: str, end) -> dict:
    """The stats a Spark step published beside its output for the interval ending at ``end`` (what the step
    returned, for a step that ran in another process: spark-submit, a cluster).

    Raises:
        FileNotFoundError: the step has no complete output for that interval.
    """
    from solaris_jobs.core.events import to_utc
    if step not in STEP_OUTPUT:
        raise ValueError(f"{step!r} publishes no offline output; the Spark steps are {SPARK_STEPS}")
    stats = off.read_stats(s.offline, STEP_OUTPUT[step], to_utc(end))
    if stats is None:
        raise FileNotFoundError(f"{s.offline}: no complete {STEP_OUTPUT[step]} output for the interval ending "
                                f"{to_utc(end).isoformat()}")
    return stats


def leased(s: Settings, end, owner: str, fn, release: bool = False):
    """``fn()`` holding the interval's lease for ``owner`` (taken or renewed before and renewed after; released
    after it when ``release``: the run's last step). A failure keeps the lease, so the run's retry goes on and no
    other run starts over its half-made outputs until it expires.

    Raises:
        lease.LeaseHeld: another run holds it (before ``fn`` ran).
    """
    from solaris_jobs.online import lease
    cfg, ttl = store(s), s.lease_minutes * 60
    lease.acquire(cfg, end, owner, ttl)
    out = fn()
    if release:
        lease.release(cfg, end, owner)
    else:
        lease.acquire(cfg, end, owner, ttl)
    return out


def interval_complete(s: Settings, end) -> bool:
    """The interval's outputs are all complete offline and it was materialized into the configured store."""
    from solaris_jobs.core.events import to_utc
    from solaris_jobs.online.materialize import materialized_intervals
    end = to_utc(end)
    return all(off.is_complete(s.offline, d, end) for d in OUTPUTS) and end in materialized_intervals(store(s))


def run_intervals(start, end, every, fn, *, skip=None, progress: bool = False, desc: str = "intervals") -> list:
    """The one interval loop: ``fn(start, end)`` for each interval of ``[start, end)`` split by ``every`` (None:
    one interval), in order; ``skip(start, end)`` true marks an interval skipped instead. A failing interval
    raises after logging which one (a rerun starts again from it).

    Returns:
        Per interval, ``fn``'s dict, or {"interval_start", "interval_end", "status": "skipped"}.
    """
    from solaris_jobs.core.events import split_intervals
    intervals = split_intervals(start, end, every)
    out = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(intervals), unit="interval", desc=desc)
    try:
        for a, b in intervals:
            if skip is not None and skip(a, b):
                out.append({"interval_start": a.isoformat(), "interval_end": b.isoformat(), "status": "skipped"})
            else:
                try:
                    out.append(fn(a, b))
                except Exception:
                    logger.error("%s: the interval [%s, %s) failed", desc, a.isoformat(), b.isoformat())
                    raise
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{b.isoformat()} {out[-1].get('status', 'done')}")
    finally:
        if bar is not None:
            bar.close()
    return out


def backfill(s: Settings, start, end, every="1h", force: bool = False, progress: bool = False, *, events=None,
             clock=None) -> list:
    """Runs every step for each interval of ``[start, end)`` in order, skipping complete intervals (unless
    ``force``), in one Spark session.

    Returns:
        Per interval: {"interval_start", "interval_end", "status": "done" | "skipped", "steps": {step: stats},
        "seconds": {step: s}}.
    """
    import uuid
    session = []
    events = event_source(events) if events is not None else None        # one cached copy for every interval
    owner = f"backfill-{uuid.uuid4().hex[:12]}"                          # this backfill's lease on each interval

    def one(a, b):
        steps, secs = {}, {}
        for step in STEPS:
            if step in SPARK_STEPS and not session:
                session.append(jobs.session(s, "backfill"))
            t0 = time.perf_counter()
            try:
                steps[step] = run_step(s, step, a, b, session[0] if session else None, events=events, clock=clock,
                                       owner=owner)
            except Exception as e:
                logger.error("backfill: interval ending %s failed in step %s", b, step)
                from solaris_jobs.online import lease
                if not isinstance(e, lease.LeaseHeld):
                    lease.release(store(s), b, owner)        # this process retries nothing: free the interval now
                raise
            secs[step] = round(time.perf_counter() - t0, 2)
        return {"interval_start": a.isoformat(), "interval_end": b.isoformat(), "status": "done", "steps": steps,
                "seconds": secs}

    return run_intervals(start, end, every, one, skip=None if force else (lambda a, b: interval_complete(s, b)),
                         progress=progress, desc="backfill")
