"""One seed's budget and cadence curves: TR and coverage against FM inferences per served row and against the
refresh cadence, from the seed's replay (smaller budgets and slower cadences derived from it, ``curves``) and the
fast cadence's own replay; the all-tiers VM keeps the headline's hyperparameters (no new search).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pyarrow as pa

from solaris_jobs.evaluation import variants
from solaris_jobs.evaluation.replays import BaseReplay, SeedContext, replay_summary, run_replay, warm_from
from solaris_jobs.evaluation.scoring import ScoredRows, predict
from solaris_jobs.evaluation.windows import (ceiling_and_segments, coverage, coverage_of_test, event_us, fm_per_row,
                                             within)
from solaris_jobs.online.views import duration


def seed_curves(ctx: SeedContext, base: BaseReplay, tab, fits: dict) -> dict:
    """TR and coverage against FM inferences per served row (``cfg.budgets``) and against the cadence (the
    headline's, the slow one and, with ``cfg.fast_cadence``, the fast one's own replay)."""
    cfg, every = ctx.cfg, base.plan.every
    rows = ScoredRows.of(ctx, tab, fits)
    params = {"solaris": fits["solaris"]["params"]}

    def point(budget: float, mult: int, cadence: str) -> dict:
        served, dout = base.served_at(budget, mult)
        t = variants.build_table_like(tab, served)
        fit = variants.train_variants(t, ctx.seed, cfg.vm_epochs, cfg.vm_batch_size, ["solaris"], params,
                                      cache=ctx.out / "vm_cache")
        summ = rows.with_solaris(fit["solaris"]["test_prob"])
        return {"budget_per_row": budget, "cadence": cadence,
                "fm": fm_per_row(base.record, served, ctx.protocol, dout),
                "coverage": coverage_of_test(ctx.events, ctx.protocol, served, every * mult),
                "solaris": summ["variants"]["solaris"], "gap": summ["gap"]}

    out = {"budget": [point(b, 1, cfg.cadence) for b in cfg.budgets],
           "cadence": [point(cfg.budget, cfg.slow_cadence, duration(every * cfg.slow_cadence))]}
    head = next(p for p in out["budget"] if p["budget_per_row"] == cfg.budget)
    out["cadence"].append({**head, "cadence": cfg.cadence})
    if cfg.fast_cadence:
        out["fast_cadence"] = fast_cadence(ctx, base, tab, fits)
    return out


def fast_cadence(ctx: SeedContext, base: BaseReplay, tab, fits: dict) -> dict:
    """The fast cadence as its own replay over [t2 - before, t2 + after), switching from the headline's hourly
    refreshes (their outputs warm the store and the aggregates' window) to the fast cadence at t2 - before;
    coverage of the test hours it covers, beside the hourly and slow cadences on the same rows, and the TR there of
    the headline's all-tiers VM (trained on the hourly features) served each cadence's features: the served-training
    day was not replayed at the fast cadence (a VM trained on it would take 4x the refreshes)."""
    from solaris_jobs.learning import replay
    cfg, P, plan = ctx.cfg, ctx.protocol, base.plan
    switch = P.t2 - pd.Timedelta(hours=cfg.fast_hours_before)
    stop = P.t2 + pd.Timedelta(hours=cfg.fast_hours_after)
    fast = pd.Timedelta(cfg.fast_cadence)
    head_served, head_dir = base.served_at(cfg.budget)
    head_offline = str((head_dir or base.out) / "offline")
    warm = warm_from(head_offline, [r for r in base.record["refreshes"] if pd.Timestamp(r["cutoff"]) < switch],
                     plan.every, plan.ttls)
    fplan = replace(plan, start=switch, end=stop, every=fast)
    t0 = time.perf_counter()
    name = f"replay-fast-{cfg.fast_cadence}"
    rec = run_replay(ctx, base.models, Path(base.models.fm.path).parent, name, fplan, cfg.budget, warm=warm,
                     warm_key=f"{head_offline} before {switch.isoformat()}")
    wall = time.perf_counter() - t0
    fast_served = replay.read_served(ctx.out / name)
    slow = plan.every * cfg.slow_cadence
    cadences = ((cfg.fast_cadence, fast_served, fast), (cfg.cadence, head_served, plan.every),
                (duration(slow), base.served_at(cfg.budget, cfg.slow_cadence)[0], slow))
    scored = ScoredRows.of(ctx, tab, fits)
    rows = {label: _window_coverage(ctx, tab, fits["solaris"]["model"], scored, served, period, stop)
            for label, served, period in cadences}
    pairs = sum(r["pairs_embedded"] for r in rec["refreshes"] if pd.Timestamp(r["cutoff"]) >= P.t2)
    n_rows = int(within(event_us(fast_served), P.t2, stop).sum())
    return {"window": [P.t2.isoformat(), stop.isoformat()], "switch_at": switch.isoformat(), "coverage": rows,
            "fast_fm_per_row": pairs / n_rows if n_rows else None, "replay": replay_summary(rec),
            "timings": {"replay_s": round(wall, 1)}}


def _window_coverage(ctx: SeedContext, tab, vm, scored: ScoredRows, served: pa.Table, period: pd.Timedelta,
                     stop: pd.Timestamp) -> dict:
    """Coverage of the rows served in [t2, stop) at a cadence of ``period``, and the TR there of the headline's
    all-tiers VM (``vm``) served these features."""
    P = ctx.protocol
    extra = ceiling_and_segments(ctx.events, P, served, period)
    c = coverage(served, within(event_us(served), P.t2, stop), extra, P, period)
    c.pop("per_interval", None)
    test = tab.split == 2
    summ = scored.with_solaris(predict(vm, variants.build_table_like(tab, served)), mask=within(tab.ts[test], P.t2,
                                                                                                  stop))
    c["headline_vm"] = {"solaris": summ["variants"]["solaris"], "gap": summ["gap"], "rows": summ["rows"]}
    return c
