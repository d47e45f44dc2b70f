"""What an operator should see of a refresh or training step without opening its log: a few flat numbers per step,
taken from the step's stats (the XCom, ``_stats.json``), for the extras of the Airflow asset events the tasks emit
and for ``solaris status``.

Pure functions of the stats dicts; a key a step did not report is left out rather than guessed.
"""
from __future__ import annotations

from typing import Any

from solaris_jobs.core.contract import TIERS

# step -> (summary key, path into the step's stats)
FIELDS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "validate": (("events", ("events",)), ("users", ("users",)), ("bad_events", ("bad_events",))),
    "drain_misses": (("misses_moved", ("pairs",)), ("files", ("files",)), ("skipped", ("skipped",))),
    "select": (("users", ("users",)), ("pairs_considered", ("pairs_considered",)),
               ("pairs_excluded", ("pairs_excluded",)), ("pairs_scored", ("pairs_scored",)),
               ("pairs_beyond_reach", ("pairs_beyond_reach",)), ("budget_reach", ("budget_reach",)),
               ("pairs_selected", ("pairs_selected",)), ("budget_pairs", ("budget_pairs",)),
               ("rejected_events", ("rejected_events",)), ("seconds", ("seconds",))),
    "embed": (("pairs", ("pairs",)), ("pairs_per_s", ("pairs_per_s",)),
              ("model_pairs_per_s", ("model_pairs_per_s",)), ("rejected", ("rejected",)),
              ("model_version", ("model_version",)), ("seconds", ("seconds",))),
    "aggregate": (("users", ("users",)), ("intervals_read", ("intervals_read",)), ("seconds", ("seconds",))),
    "neighbours": (("users_with_history", ("users_with_history",)), ("users_embedded", ("users_embedded",)),
                   ("users_carried", ("users_carried",)), ("full", ("full",)), ("knn_index", ("knn", "index")),
                   ("knn_recall_at_k", ("knn", "recall_at_k")), ("seconds", ("seconds",))),
    "materialize": (("store", ("store",)),),
    "report": (("requests", ("requests",)), ("events", ("events",)), ("fail_open", ("fail_open",)),
               ("latest_materialized_end", ("latest_materialized_end",)),
               ("feature_age_hours_now", ("feature_age_hours_now",))),
}


def _get(stats: dict, path: tuple[str, ...]) -> Any:
    cur: Any = stats
    for k in path:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def step_summary(step: str, stats: dict) -> dict:
    """The step's headline numbers, flat and small (an asset event's extra): the interval, then the fields of
    ``FIELDS[step]`` the stats hold; materialize adds rows written per view, report the share per tier."""
    if step not in FIELDS:
        raise ValueError(f"no summary for step {step!r}; the steps are {sorted(FIELDS)}")
    out = {"step": step}
    for k in ("interval_start", "interval_end"):
        if stats.get(k) is not None:
            out[k] = stats[k]
    for key, path in FIELDS[step]:
        v = _get(stats, path)
        if v is not None and v != {}:
            out[key] = v
    if step == "materialize":
        for view, st in (stats.get("views") or {}).items():
            out[f"{view}_written"] = st.get("written")
            if st.get("expired"):
                out[f"{view}_expired"] = st["expired"]
    if step == "report":
        for t in TIERS:
            share = _get(stats, ("coverage", t))
            out[f"coverage_{t}"] = None if share is None else round(float(share), 4)
    return out


def training_summary(kind: str, metrics: dict) -> dict:
    """A trained model's version and test metrics (train_fm, train_ae, ... results), flat."""
    out = {"model": kind}
    for k in ("model_version", "test_bce", "test_auc", "valid_bce", "test_explained_variance", "fm_version",
              "ae_version", "mode", "replay_wall_s"):
        if metrics.get(k) is not None:
            out[k] = round(metrics[k], 5) if isinstance(metrics[k], float) else metrics[k]
    shares = metrics.get("tier_shares_of_training_rows")
    if isinstance(shares, dict):
        for t, v in shares.items():
            out[f"train_share_{t}"] = round(float(v), 4)
    return out
