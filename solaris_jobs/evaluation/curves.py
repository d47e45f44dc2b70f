"""Budget and cadence curves derived from one replay at the largest budget.

A budgeted selection is one global ranking of the pool cut at ``ceil(budget x expected rows)`` (``selection.
select_budget``); the pool, the ranking and every embedding do not depend on the budget. So the selection at a
smaller budget is the larger one's top ``ceil(b x expected rows)`` pairs, and the replay at that budget follows
from it exactly: keep those pair embeddings, recompute the user aggregates and the item-aware fallbacks over them
with the aggregate job itself (``jobs.aggregate``) and the neighbour embeddings from the same neighbour lists (``aggregates.
neighbour_embeddings``), then serve the same requests again through ``FeatureReader`` with the refreshes visible
when the replay made them visible (``replay.serve_again``). A cadence of m x the replay's takes every m-th refresh
with m times the budget (the refresh at T sees the same log and pool; its budget covers m intervals' rows). Misses
change nothing here: in a replay of a log, a missed pair is a logged pair, already in the pool as recently ranked
(``derive`` checks the settings that make all this hold). The cadence derivation keeps each kept refresh's
visibility time from the hourly replay; it is not compared with a replay run at that cadence.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import Settings
from solaris_jobs.learning import replay
from solaris_jobs.pipeline import jobs
from solaris_jobs.pipeline import aggregates
from solaris_jobs.pipeline.model_refs import ModelSet


def derive(spark, s: Settings, record: dict, models: ModelSet, plan: replay.ReplayPlan, events, out: Path,
           budget: float, every: int = 1) -> dict:
    """A replay at ``budget`` FM inferences per served row and a cadence of ``every`` x the base replay's, from the
    base replay's outputs (``s.offline``) and record.

    Raises:
        ValueError: the base replay selected fewer pairs than the derived budget needs (run it at a larger budget).
    """
    cfg = s.precompute
    # When masking is exact: one global ranking under a budget, no negative exclusion (its bottoms would depend on
    # the pool), and every miss already in the pool as a recently ranked pair.
    if cfg.budget_per_row is None or cfg.exclusion_runs or cfg.miss_hours > cfg.recent_hours:
        raise ValueError("a budget curve is derived by masking only from a budgeted replay without negative exclusion "
                         f"whose misses are recently ranked pairs (budget_per_row={cfg.budget_per_row}, "
                         f"exclusion_runs={cfg.exclusion_runs}, miss_hours={cfg.miss_hours} > recent_hours="
                         f"{cfg.recent_hours}?)")
    out = Path(out)
    derived = s.override(offline=str(out / "offline"))
    period = plan.every * every
    visible = []
    for k, r in enumerate(record["refreshes"]):
        if k % every:
            continue
        T = pd.Timestamp(r["cutoff"])
        n_keep = int(math.ceil(budget * r["expected_rows"] * every))
        if n_keep > r["pairs_selected"] and r["pairs_selected"] == r["budget_pairs"]:
            raise ValueError(f"refresh {T}: a budget of {budget}/row at {every}x the cadence needs {n_keep} pairs; "
                             f"the base replay selected {r['pairs_selected']}")
        keep = (off.read_interval(spark, s.offline, "selection", T)
                .where(f"selected AND priority_rank <= {n_keep}").select("user_id", "item_id"))
        pairs = off.read_interval(spark, s.offline, "pair_embeddings", T).join(keep, ["user_id", "item_id"],
                                                                              "left_semi")
        staged = off.stage(pairs, derived.offline, "pair_embeddings", T)
        n = spark.read.parquet(staged.path).count()
        staged.publish({"interval_end": T.isoformat(), "derived_from": s.offline, "budget_per_row": budget,
                        "budget_pairs": n_keep, "pairs": n, "models": models.to_dict()})
        jobs.aggregate(spark, derived, T - period, T, events=events, models=models, clock=lambda T=T: T)
        lists = off.read_interval(spark, s.offline, "neighbours", T).select("user_id", "neighbour_ids",
                                                                           "similarities")
        agg = off.read_interval(spark, derived.offline, "user_aggregates", T)
        off.write_interval(aggregates.neighbour_embeddings(lists, agg, T, models.embedding_version), derived.offline,
                           "neighbours", T, {"interval_end": T.isoformat(), "derived_from": s.offline})
        # The user states do not depend on the budget: the base replay's, as they are.
        off.write_interval(off.read_table(s.offline, "user_states", T), derived.offline, "user_states", T,
                           {"interval_end": T.isoformat(), "derived_from": s.offline})
        visible.append((T, pd.Timestamp(r["visible_at"])))
    dplan = replace(plan, every=period)
    res = replay.serve_again(derived, models, dplan, events, visible, out)
    res.update(budget_per_row=budget, cadence=str(period), derived_from=str(s.offline))
    return res
