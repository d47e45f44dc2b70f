"""One seed's run (the seed varies the FM, the autoencoder, the verifier and the VMs; the caller chooses the seed's
data, ``run.dataset_root``): train the models on ``[t0, t1)``; replay ``[t1, t3)`` (``replays``); train the VM
variants on what was served (``variants``); score them on the test rows (``scoring``) and, for the first seed, the
curves (``seed_curves``).
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from solaris_jobs.evaluation import variants
from solaris_jobs.evaluation.config import ttls
from solaris_jobs.evaluation.protocol import train_models
from solaris_jobs.evaluation.replays import BaseReplay, SeedContext, replay_summary, run_replay
from solaris_jobs.evaluation.scoring import (OLD_COMPARISON, evaluate_test, kd_grid_check, secondary, tier_values,
                                             without_recency)
from solaris_jobs.evaluation.seed_curves import seed_curves
from solaris_jobs.evaluation.windows import fm_per_row


def run_seed(ctx: SeedContext, with_curves: bool, names=None) -> dict:
    """The headline numbers of one seed (and, with ``with_curves``, the budget and cadence curves, the secondary
    training window, the KD grid check and the comparison without the recency inputs); ``names``: the variants to
    train (default all)."""
    cfg = ctx.cfg
    t_seed = time.perf_counter()
    model_metrics = train_models(ctx.root, ctx.protocol, ctx.seed, ctx.out / "models", cfg.models,
                                 cfg.label_delay_minutes, cfg.fm_checkpoint, cfg.fm_factory, cfg.possibly_leaky)
    base = replay_base(ctx, with_curves)
    served, dout = base.served_at(cfg.budget)
    tab = variant_table(ctx, base, served)
    t0 = time.perf_counter()
    fits = variants.train_variants(tab, ctx.seed, cfg.vm_epochs, cfg.vm_batch_size, names=names,
                                   grid_points=cfg.grid_points, cache=ctx.out / "vm_cache")
    vm_wall = time.perf_counter() - t0
    every = base.plan.every
    res = {"seed": ctx.seed, "models": model_metrics, "headline": evaluate_test(ctx, tab, fits, served, every),
           "tier_value": {"validation": tier_values(tab, fits, 1, cfg.n_boot, ctx.seed),
                          "test": tier_values(tab, fits, 2, cfg.n_boot, ctx.seed)},
           "fm_per_row": fm_per_row(base.record, served, ctx.protocol, dout),
           "variants": {k: {kk: vv for kk, vv in v.items() if kk not in ("valid_prob", "test_prob", "model")}
                        for k, v in fits.items()},
           "replay": replay_summary(base.record), "timings": {"replay_s": round(base.wall_s, 1),
                                                                "vm_variants_s": round(vm_wall, 1)}}
    if "solaris" in fits:
        _save_transfer_vm(ctx, base, fits["solaris"], dout)
    if with_curves:
        res["curves"] = seed_curves(ctx, base, tab, fits)
        res["secondary_t1_only"] = secondary(ctx, tab, served, every, names)
        if {"vm", "vm_kd", "solaris"} <= set(fits):
            res["kd_grid_check"] = kd_grid_check(ctx, tab, fits)
        if set(OLD_COMPARISON) <= set(fits):
            res["without_recency"] = without_recency(ctx, tab)
    res["timings"]["seed_s"] = round(time.perf_counter() - t_seed, 1)
    return res


def replay_base(ctx: SeedContext, with_curves: bool) -> BaseReplay:
    """The seed's replay of ``[t1, t3)`` with the models in ``ctx.out / "models"``: at the headline budget, or, with
    the curves, at the largest budget any point needs (the slow cadence takes m x the budget)."""
    from solaris_jobs.learning import replay
    from solaris_jobs.pipeline import model_refs
    cfg, P = ctx.cfg, ctx.protocol
    models_dir = ctx.out / "models"
    models = model_refs.resolve(models_dir, ("fm", "ae", "vm"), fm_factory=cfg.fm_factory)
    plan = replay.ReplayPlan(P.t1, P.t3, pd.Timedelta(cfg.cadence), pd.Timedelta(cfg.delay), ttls(cfg),
                             cfg.serving_budget_ms, cfg.serving_cooldown_s, cfg.serving_store, tuple(cfg.tiers))
    budget = max(max(cfg.budgets), cfg.budget * cfg.slow_cadence) if with_curves else cfg.budget
    name = f"replay-b{budget:g}"
    t0 = time.perf_counter()
    record = run_replay(ctx, models, models_dir, name, plan, budget)
    return BaseReplay(ctx, models, plan, budget, record, ctx.out / name, time.perf_counter() - t0)


def variant_table(ctx: SeedContext, base: BaseReplay, served):
    """The VM variants' table: the log's examples with the FM's outputs and the features ``served``."""
    from solaris_jobs.learning import training
    P = ctx.protocol
    data = training.load_dataset(str(ctx.root), base.models.history_len, cuts=(P.valid_from, P.t2),
                                 label_delay_minutes=ctx.cfg.label_delay_minutes)
    cache = variants.fm_outputs(data, base.models.fm.path, base.models.ae.path, P, ctx.out / "cache",
                                base.models.fm.factory)
    return variants.build_table(data, P, served, cache)


def _save_transfer_vm(ctx: SeedContext, base: BaseReplay, fit: dict, dout: Path | None) -> None:
    """The ranker's VM trained on what the store served: a checkpoint `solaris rank` and `Ranker` take."""
    from models import save_checkpoint
    save_checkpoint(fit["model"], ctx.out / "vm_transfer_served.pt", extra={
        "fm_version": base.models.fm.version, "ae_version": base.models.ae.version,
        "trained_on": f"served features of {dout or base.out}", "params": fit["params"]})
