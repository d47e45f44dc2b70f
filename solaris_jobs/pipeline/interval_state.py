"""The select step's interval state: every user's history and the user and item counters at the cutoff T
(``STATE``), and the request simulator's co-visit counts and seeds (``SIMULATOR``). ``select`` writes them for
its interval; ``embed`` and ``neighbours`` read them instead of the log; the next interval's ``select`` updates
them with the events since instead of reading the whole lookback again.

An interval's state is read only when it was made with the reader's history length and lookback for the
interval's published selection (``StateKey``). It is updated from the previous interval's only when that one
ends at this interval's start, was made with the same settings, was last rebuilt from the whole lookback less
than ``state_rebuild_hours`` ago, and the log's files it was read from are unchanged (their fingerprint); else it
is rebuilt, and the reason is recorded (``Base.rebuild_because``).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import PrecomputeConfig, Settings
from solaris_jobs.pipeline import history, simulator
from solaris_jobs.pipeline.step_common import Clock, publish
from solaris_jobs.pipeline.windows import prior_events, read_from, union_all

logger = logging.getLogger(__name__)

STATE = off.STATE_DATASETS
SIMULATOR = off.SIMULATOR_STATE
# What the datasets of one interval's state record alike.
STATE_FIELDS = ("interval_end", "history_len", "lookback_days", "label_delay_minutes", "log", "full_at")


@dataclass(frozen=True)
class StateKey:
    """What an interval's state must match to be read: the settings that made it, and the published selection it
    was written with (a rerun of select that writes no state, or a selection written otherwise, leaves an older
    state behind: it is then not read)."""
    history_len: int
    lookback_days: float | None
    selection: str | None
    label_delay_minutes: float = 0.0


@dataclass(frozen=True)
class State:
    """An interval's state: every user's last ``history_len`` events (None where no state is written: only the
    counters are used), the user counters and the item counters (DataFrames)."""
    histories: object | None
    user_counters: object
    item_counters: object

    def frames(self) -> tuple:
        return self.histories, self.user_counters, self.item_counters


@dataclass(frozen=True)
class Previous:
    """The previous interval's state, which this interval's updates.

    Attributes:
        end: its cutoff P.
        stats: the stats its histories were published with (every state dataset's record is the same).
        leaving: the events of the lookback at P that have left the lookback at T, ``[start, end)`` (None: none).
        leaving_fingerprint: the fingerprint of those hours' files when the log was listed.
    """
    end: pd.Timestamp
    stats: dict
    leaving: tuple[pd.Timestamp, pd.Timestamp] | None
    leaving_fingerprint: str


@dataclass(frozen=True)
class Base:
    """What this interval's state is made from: the previous interval's to update (``previous``), or the whole
    lookback (``previous`` None, ``rebuild_because`` why); ``fingerprint``: of the log's files the new state holds,
    recorded with it (None: no state is written)."""
    previous: Previous | None
    rebuild_because: str | None
    fingerprint: str | None


@dataclass(frozen=True)
class SimulatorState:
    """The request simulator's state at T (cached DataFrames): the lookback's co-visit counts and each user's latest
    items; why it was made from the whole lookback (None: updated), and when it last was."""
    covisit: object
    seeds: object
    rebuild_because: str | None
    full_at: pd.Timestamp


@dataclass(frozen=True)
class LogReads:
    """What a select run read of the log, for its state: ``near`` (cached) holds at least the events since the
    previous state's end; ``whole()`` the lookback's valid events; ``leaving()`` the events that left the lookback
    since the previous state (both read and cached on first use)."""
    near: object
    whole: Callable[[], object]
    leaving: Callable[[], object]


@dataclass(frozen=True)
class StateRun:
    """One select run's view of its state: the session, the settings, the event source, the cutoff, the FM's
    history length (None: no FM to write a state for) and the step's ``cache``."""
    spark: object
    settings: Settings
    source: object
    T: pd.Timestamp
    history_len: int | None
    cache: Callable

    @property
    def cfg(self) -> PrecomputeConfig:
        return self.settings.precompute

    def log_between(self, start: pd.Timestamp, end: pd.Timestamp):
        """The log's valid events in ``[start, end)`` (``windows.PRIOR_COLS``)."""
        return log_between(self.spark, self.source, start, end)


def log_between(spark, source, start: pd.Timestamp, end: pd.Timestamp):
    """The log's valid events in ``[start, end)`` (``windows.PRIOR_COLS``)."""
    return prior_events(source.spark(spark, start=start, end=end), end, None)


def selection_run(s: Settings, T: pd.Timestamp) -> str | None:
    """The run folder name of the interval's published selection (None: none published)."""
    path = off.published(s.offline, "selection", T)
    return path.rstrip("/").rsplit("/", 1)[-1] if path else None


def leaving_hours(P: pd.Timestamp, T: pd.Timestamp, lookback_days: float | None):
    """The events of the state at P that have left the lookback at T: ``[start, end)``, or None (none can)."""
    if lookback_days is None:
        return None
    first, last = read_from(P, lookback_days), min(read_from(T, lookback_days), P)
    return (first, last) if first < last else None


# ----------------------------------------------------------------------------------------------- the previous state

def previous_state(run: StateRun, start: pd.Timestamp) -> Base:
    """The previous interval's state this interval's is updated from, and the log's fingerprint to record with it.

    One listing of the log, before anything is read, gives every fingerprint (a file that lands after it is in
    no fingerprint: the next interval sees it and rebuilds): of the hours the new state will hold (recorded), of
    those the previous state held (compared with its record), of those that leave the lookback now (compared again
    after they are read, ``update_state``).
    """
    cfg, T = run.cfg, run.T
    if run.history_len is None:
        return Base(None, "no FM history length", None)
    record = (read_from(T, cfg.lookback_days), T)
    prev = off.list_intervals(run.settings.offline, STATE[0], before=T, last=1)
    if not cfg.state_rebuild_hours or not prev:
        return Base(None, "state_rebuild_hours 0" if prev else "no earlier state",
                    run.source.fingerprints([record])[0])
    P = prev[0]
    leaving = leaving_hours(P, T, cfg.lookback_days)
    fingerprint, held, left = run.source.fingerprints([record, (read_from(P, cfg.lookback_days), P),
                                                       leaving or record])
    why = _not_updatable(run, start, P, held)
    if why is not None:
        return Base(None, why, fingerprint)
    return Base(Previous(P, off.read_stats(run.settings.offline, STATE[0], P), leaving, left), None, fingerprint)


def _not_updatable(run: StateRun, start: pd.Timestamp, P: pd.Timestamp, held: str) -> str | None:
    """Why the state at P cannot be updated to T (None: it can); ``held``: the fingerprint of the files it was read
    from, as they are now."""
    cfg, offline = run.cfg, run.settings.offline
    if P != start:
        return f"the last state ends at {P.isoformat()}, not at this interval's start"
    stats = [off.read_stats(offline, d, P) or {} for d in STATE]
    first = {k: stats[0].get(k) for k in STATE_FIELDS}
    if None in (first["log"], first["full_at"]) or any({k: st.get(k) for k in STATE_FIELDS} != first
                                                       for st in stats[1:]):
        return f"the state of {P.isoformat()} is incomplete or from an older version"
    if ((first["history_len"], first["lookback_days"], first["label_delay_minutes"])
            != (run.history_len, cfg.lookback_days, cfg.label_delay_minutes)):
        return f"the state of {P.isoformat()} has another history length, lookback or label delay"
    if run.T - pd.Timestamp(first["full_at"]) >= pd.Timedelta(hours=cfg.state_rebuild_hours):
        return f"its last full rebuild ({first['full_at']}) is {cfg.state_rebuild_hours:g} h old or more"
    if not all(off.is_complete(offline, d, P) for d in STATE):
        return f"the state of {P.isoformat()} is gone"
    if held != first["log"]:
        return (f"the events the state of {P.isoformat()} was read from changed since (a late event in an old "
                "hour, a rewritten file, another event source)")
    return None


# ----------------------------------------------------------------------------------------------- the new state

def update_state(run: StateRun, base: Base, reads: LogReads) -> tuple[State, str | None]:
    """The interval's state and why it was rebuilt (None: it was updated): with no previous state, of
    ``reads.whole()``; else the previous interval's updated with ``reads.near`` since its end and, with a lookback,
    less the events that left it (``reads.leaving()``). When the leaving hours' files changed between the listing
    and their read, the update is dropped for a rebuild."""
    prev, why = base.previous, base.rebuild_because
    if prev is not None:
        updated = _updated(run, prev, reads)
        if updated is not None:
            return updated, None
        why = (f"the log's files of {prev.leaving[0].isoformat()}-{prev.leaving[1].isoformat()} changed while they "
               "were read")
        logger.warning("state of %s: %s; rebuilding it from the whole lookback", run.T, why)
    whole = history.hide_recent_labels(reads.whole(), run.T, run.cfg.label_delay_minutes)
    if run.history_len is None:                         # no state is written: only the counters are used
        return State(None, *history.counters(whole)), why
    return State(*history.interval_state(whole, run.history_len)), why


def _updated(run: StateRun, prev: Previous, reads: LogReads) -> State | None:
    """The previous state updated to T, or None when the leaving hours' files changed while they were read. With a
    label delay d, the events of ``[P - d, P)`` entered the previous state without their labels: they are taken out
    of it and read again with the labels known at T."""
    from pyspark.sql import functions as F
    hist, uc, ic = (off.read_interval(run.spark, run.settings.offline, d, prev.end) for d in STATE)
    d = run.cfg.label_delay_minutes
    redo = prev.end - pd.Timedelta(minutes=d)
    since_redo = reads.near.where(F.col("event_timestamp") >= F.lit(redo.to_pydatetime()))
    new = history.hide_recent_labels(since_redo, run.T, d)
    gone = [] if prev.leaving is None else [reads.leaving()]
    if d:                                               # as the previous state holds them: no label yet
        gone.append(history.hide_recent_labels(
            since_redo.where(F.col("event_timestamp") < F.lit(prev.end.to_pydatetime())), prev.end, d))
    gone = history.counters(union_all(gone)) if gone else (None, None)
    uc, ic = (run.cache(history.merge_counters(*x)) for x in zip((uc, ic), history.counters(new), gone))
    until = redo if d else None
    if prev.leaving is None:
        return State(history.merge_histories(hist, new, run.history_len, None, until), uc, ic)
    uc.count(), ic.count()                              # the leaving hours are read now
    if run.source.fingerprints([prev.leaving])[0] == prev.leaving_fingerprint:
        since = read_from(run.T, run.cfg.lookback_days)
        return State(history.merge_histories(hist, new, run.history_len, since, until), uc, ic)
    uc.unpersist(), ic.unpersist()
    return None


# ----------------------------------------------------------------------------------------------- the simulator's state

def simulator_key(cfg: PrecomputeConfig) -> dict:
    return {"covisit_window": cfg.simulator.covisit_window, "history_items": cfg.simulator.history_items}


def simulator_rebuild_reason(run: StateRun, prev: Previous | None) -> str | None:
    """Why the request simulator's state at T (co-visit counts, seeds) cannot be updated from the previous
    interval's (None: it can). It is updated with the state (``previous_state``, and the update not dropped since)
    when the previous select wrote it along with its state and made it from the whole lookback less than
    ``state_rebuild_hours`` ago."""
    if prev is None:
        return "the state is rebuilt"
    cfg, window = run.cfg, run.cfg.simulator.covisit_window
    if run.history_len is None or run.history_len < window:
        return f"the histories ({run.history_len}) are shorter than covisit_window ({window})"
    P, first = prev.end, prev.stats
    stats = [off.read_stats(run.settings.offline, d, P) or {} for d in SIMULATOR]
    same = ("interval_end", "history_len", "lookback_days", "log", "selection")
    if not all(off.is_complete(run.settings.offline, d, P) for d in SIMULATOR) or any(
            {k: st.get(k) for k in (*same, "full_at")} != {**{k: first.get(k) for k in same},
                                                           "full_at": stats[0].get("full_at")} for st in stats):
        return f"no request simulator state written with the state of {P.isoformat()}"
    if any({k: st.get(k) for k in simulator_key(cfg)} != simulator_key(cfg) for st in stats):
        return f"the request simulator state of {P.isoformat()} has another covisit_window or history_items"
    if run.T - pd.Timestamp(stats[0]["full_at"]) >= pd.Timedelta(hours=cfg.state_rebuild_hours):
        return f"its last full build ({stats[0]['full_at']}) is {cfg.state_rebuild_hours:g} h old or more"
    return None


def simulator_state(run: StateRun, prev: Previous | None, why: str | None, reads: LogReads) -> SimulatorState:
    """The request simulator's state at T. Updated: the previous interval's, with ``reads.near`` since its end (the
    co-visit pairs whose later event is new, with the last ``covisit_window`` events before them from the previous
    histories) and less the co-visit pairs whose earlier event left the lookback (``reads.leaving()``, with each
    leaving user's next events: from the previous histories where they reach back far enough, else from the log);
    seeds that left the lookback dropped. ``why``: ``simulator_rebuild_reason`` of the state as it was before the
    state's update (None: the simulator's can be updated); ``prev`` None: the state's update was dropped since, so
    this one is rebuilt too."""
    from pyspark.sql import functions as F
    window, n_seeds = run.cfg.simulator.covisit_window, run.cfg.simulator.history_items
    if prev is None:
        why = "the state is rebuilt"
    if why is not None:
        return SimulatorState(run.cache(simulator.covisit_counts(reads.whole(), window)),
                              run.cache(simulator.user_seeds(reads.whole(), n_seeds)), why, run.T)
    P, offline = prev.end, run.settings.offline
    covisit, seeds, hist = (off.read_interval(run.spark, offline, d, P) for d in (*SIMULATOR, STATE[0]))
    since = read_from(run.T, run.cfg.lookback_days)
    new = reads.near.where(F.col("event_timestamp") >= F.lit(P.to_pydatetime()))
    added = simulator.covisit_added(simulator.history_events(hist, window, since), new, window)
    gone = None
    if prev.leaving is not None:
        after = after_leaving(run.spark, run.source, hist, reads.leaving(), prev.leaving[1], P, window)
        gone = simulator.covisit_gone(reads.leaving(), after, window)
    full_at = pd.Timestamp(off.read_stats(offline, SIMULATOR[0], P)["full_at"])
    return SimulatorState(run.cache(simulator.merge_covisit(covisit, added, gone)),
                          run.cache(simulator.merge_seeds(seeds, new, n_seeds, since)), None, full_at)


def after_leaving(spark, source, hist, leaving, b: pd.Timestamp, P: pd.Timestamp, window: int):
    """Each leaving user's first ``window`` events in ``[b, P)`` (b: the end of the leaving events, P: the previous
    state's cutoff). The previous histories hold every event of a user from their oldest entry on: the events
    after it come from there, those in ``[b, oldest entry]`` (users with more than a history's worth of events
    since b) from the log, read up to the latest such entry."""
    from pyspark.sql import functions as F
    b_us = pd.Timestamp(b).value // 1000
    oldest = (hist.join(leaving.select("user_id").distinct(), "user_id", "left_semi")
              .select("user_id", F.col("hist_ts")[0].alias("_oldest")))
    held = (simulator.history_events(hist.join(oldest.select("user_id"), "user_id", "left_semi"), None)
            .join(oldest, "user_id").where((F.unix_micros("event_timestamp") >= b_us)
                                           & (F.unix_micros("event_timestamp") > F.col("_oldest"))).drop("_oldest"))
    short = oldest.where(F.col("_oldest") >= b_us)
    last = short.agg(F.max("_oldest")).first()[0]
    if last is not None:
        logged = (log_between(spark, source, b, min(P, pd.Timestamp(last + 1, unit="us", tz="UTC")))
                  .join(F.broadcast(short), "user_id")
                  .where(F.unix_micros("event_timestamp") <= F.col("_oldest")).select(*held.columns))
        held = held.unionByName(logged)
    return simulator.first_events(held, window)


# ----------------------------------------------------------------------------------------------- writing, reading

def write_state(spark, offline: str, T: pd.Timestamp, state: State, key: StateKey, clock: Clock | None, *,
                fingerprint: str, full_at: pd.Timestamp, sim: SimulatorState | None = None,
                sim_key: dict | None = None) -> dict:
    """Writes the interval's state for ``key``, with what the next interval needs to update it: the fingerprint of
    the log's files it was read from and when it was last rebuilt from the whole lookback (``full_at``). ``sim``:
    the request simulator's state, when it ran, published last with the same key and its settings (``sim_key``);
    a state without it is still whole. Returns its stats."""
    record = {"interval_end": T.isoformat(), **asdict(key), "log": fingerprint, "full_at": full_at.isoformat()}
    rows = _publish_all(spark, offline, T, dict(zip(STATE, state.frames())), record, clock)
    out = {**record, "users": rows["user_counters"], "users_with_history": rows["user_histories"],
           "items": rows["item_counters"]}
    if sim is not None:
        rows = _publish_all(spark, offline, T, dict(zip(SIMULATOR, (sim.covisit, sim.seeds))), record, clock,
                            full_at=sim.full_at.isoformat(), **sim_key)
        out["simulator"] = {"covisit_pairs": rows[SIMULATOR[0]], "seeds": rows[SIMULATOR[1]],
                            "built": "full" if sim.rebuild_because else "incremental",
                            "full_because": sim.rebuild_because, "full_at": sim.full_at.isoformat()}
    return out


def _publish_all(spark, offline: str, T: pd.Timestamp, frames: dict, record: dict, clock, **extra) -> dict:
    """Stages every frame, then publishes each with ``record``, its row count and ``extra``: {dataset: rows}."""
    staged = {d: off.stage(df, offline, d, T) for d, df in frames.items()}
    rows = {d: spark.read.parquet(st.path).count() for d, st in staged.items()}
    for d, st in staged.items():
        publish(st, {**record, "rows": rows[d], **extra}, clock)
    return rows


def read_state(spark, s: Settings, cfg: PrecomputeConfig, T: pd.Timestamp) -> State | None:
    """The interval's state when it was made with ``cfg``'s history length and lookback for the interval's
    published selection, else None."""
    want = asdict(StateKey(cfg.history_len, cfg.lookback_days, selection_run(s, T), cfg.label_delay_minutes))
    for d in STATE:
        stats = off.read_stats(s.offline, d, T) or {}
        if {k: stats.get(k) for k in want} != want:
            return None
    try:
        return State(*(off.read_interval(spark, s.offline, d, T) for d in STATE))
    except FileNotFoundError:                      # replaced or removed since its stats were read
        logger.info("the state of %s is gone: reading the log", T)
        return None
