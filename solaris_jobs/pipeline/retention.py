"""What the offline store keeps, and the pruning that enforces it.

Nothing else deletes an interval's output: every refresh adds one folder per dataset, and the state select keeps
for the next interval (``covisit_counts`` alone is about 85 MB an hour at 100K users) is only ever read by that
next interval. So:

- the state (``user_histories``, the counters, ``covisit_counts``, ``user_seeds``) is pruned by select itself,
  after it has published the interval's: intervals ending more than ``state_keep_hours`` before the one it just
  wrote go (a rerun of an interval whose previous state is gone rebuilds it from the log: slower, the same);
- the outputs are kept until an operator prunes them (``solaris prune``): they are the features' history, what
  an audit or a new ranker's training may want.

Either way an interval that a later run of the jobs still reads back is never removed (``protected_from``), and an
interval is removed pointers first (``offline.remove_interval``): a reader sees a whole output or none.
"""
from __future__ import annotations

import logging

import pandas as pd

from solaris_jobs.core import offline as off

logger = logging.getLogger(__name__)

STATE = off.STATE_DATASETS + off.SIMULATOR_STATE
# Every dataset with one folder per interval (reports and misses have their own layouts and are small).
DATASETS = off.DATASETS + ("knn_index",)


def protected_from(cfg, dataset: str, ends: list[pd.Timestamp]) -> pd.Timestamp | None:
    """The oldest of ``dataset``'s complete intervals ``ends`` (oldest first) that the next interval's jobs may
    read back with ``cfg`` (a ``PrecomputeConfig``): negative exclusion the last ``exclusion_runs`` selections,
    aggregate the pair embeddings of the last ``aggregate_hours``, an ``active`` neighbours interval the index of
    the last ``knn_rebuild_hours``; every dataset its newest interval (the next select's state, materialize's
    input). None: nothing to protect."""
    if not ends:
        return None
    newest = ends[-1]
    if dataset == "selection":
        return ends[-max(cfg.exclusion_runs, 1):][0]
    if dataset == "pair_embeddings":
        return newest - pd.Timedelta(hours=cfg.aggregate_hours)
    if dataset == "knn_index":
        return newest - pd.Timedelta(hours=cfg.knn_rebuild_hours)
    return newest


def check_datasets(datasets) -> tuple[str, ...]:
    """The names, checked before anything is removed.

    Raises:
        ValueError: a name that is not an offline dataset with one folder per interval (the message names it).
    """
    bad = [d for d in datasets if d not in DATASETS]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))}: not an offline dataset with one folder per interval "
                         f"({', '.join(DATASETS)})")
    return tuple(datasets)


def prune(offline, cfg, datasets, before, dry_run: bool = False) -> dict:
    """Removes the intervals of ``datasets`` that end before ``before`` (a time, or a callable giving it from the
    dataset's complete interval ends, e.g. their newest less some hours; None: nothing), except those
    ``protected_from`` keeps. Incomplete folders before the bound go too once ``offline.ORPHAN_AGE`` old (a write
    that died before its publish; a younger one may be a writer's at work).

    Returns:
        Per dataset: ``removed`` (interval ends), ``bytes`` (their files), ``kept_for_jobs`` (intervals before the
        bound kept because the jobs read them back) and ``before`` (the bound used, None: none).
    """
    out = {}
    for d in check_datasets(datasets):
        complete = off.list_intervals(offline, d)
        bound = before(complete) if callable(before) else before
        out[d] = {"before": None, "removed": [], "bytes": 0, "kept_for_jobs": 0}
        if bound is None:
            continue
        bound = pd.Timestamp(bound)
        keep = protected_from(cfg, d, complete)
        limit = bound if keep is None else min(bound, keep)
        done = set(complete)
        doomed = [e for e in off.interval_ends(offline, d)
                  if e < limit and (e in done or off.abandoned(offline, d, e))]
        out[d] = {"before": bound.isoformat(), "removed": [e.isoformat() for e in doomed],
                  "bytes": sum(off.remove_interval(offline, d, e, dry_run) for e in doomed),
                  "kept_for_jobs": sum(1 for e in complete if limit <= e < bound)}
    return out


def prune_state(offline, cfg, T: pd.Timestamp) -> dict:
    """Select's own pruning, once the interval's state at ``T`` is published: state intervals ending more than
    ``state_keep_hours`` before ``T`` (never ``T``'s own nor a later one)."""
    try:
        got = prune(offline, cfg, STATE, T - pd.Timedelta(hours=cfg.state_keep_hours))
    except OSError as e:                # the interval's own outputs are whole: a failed removal only waits
        logger.warning("could not remove old state before %s (the next select tries again): %s", T, e)
        return {"intervals": 0, "bytes": 0, "error": str(e)}
    return {"intervals": max((len(v["removed"]) for v in got.values()), default=0),
            "bytes": sum(v["bytes"] for v in got.values())}
