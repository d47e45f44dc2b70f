"""The fallback tiers the product serves, chosen once on seed 0's validation rows (#40) and then fixed
(``solaris_jobs.online.reader.DEFAULT_TIERS``, which ``EvalConfig.tiers`` and every ``FeatureReader`` take).

Declared before it ran: seed 0 of the headline configuration, every fallback tier served, the same replay the
headline's first seed runs (so the headline reuses it when every tier is kept); the all-tiers VM (``solaris``) and
the equal-input VM whose served codes are zeroed (``tiers_only``: tier flags, ages and counts kept) trained on their
grids as in the headline. A tier is kept where its value on its own validation rows (``scoring.tier_values``:
``BCE(tiers_only) - BCE(solaris)`` on the rows it served, paired bootstrap over users) has a 95% lower bound above
0. No test row is scored. The table goes into ``benchmarks/results/tier_choice_synth.json``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from solaris_jobs.online.reader import FALLBACKS

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tier_choice_synth.json"
VARIANTS = ("tiers_only", "solaris")


def choose(values: dict) -> tuple:
    """The fallback tiers whose value on their own validation rows has a lower bound above 0, in fallback order."""
    return tuple(t for t in FALLBACKS if (values.get(t) or {}).get("carries_value"))


def run(cfg, out: Path) -> dict:
    """Runs the choice on ``cfg``'s first seed into ``out`` (the headline evaluation's folder: its caches are shared)
    and returns the table: each tier's validation value with its interval, and the tiers kept."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation import variants
    from solaris_jobs.evaluation.protocol import freeze_code_versions, train_models
    from solaris_jobs.evaluation.replays import SeedContext
    from solaris_jobs.evaluation.run import code_commit, data_seed, dataset_root, eval_session, report_config
    from solaris_jobs.evaluation.scoring import tier_values
    from solaris_jobs.evaluation.seed import replay_base, variant_table
    from solaris_jobs.evaluation.windows import protocol_of
    from solaris_jobs.pipeline.event_source import EventTable
    cfg = replace(cfg, tiers=FALLBACKS)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    freeze_code_versions()
    seed = cfg.seeds[0]
    root = dataset_root(cfg, out, seed=seed)
    table = ev.read_events(root)
    ctx = SeedContext(cfg, root, out / f"seed{seed}", protocol_of(cfg, table), seed, EventTable(table, str(root)),
                      eval_session(cfg))
    train_models(ctx.root, ctx.protocol, seed, ctx.out / "models", cfg.models, cfg.label_delay_minutes)
    base = replay_base(ctx, with_curves=cfg.curves)
    served, _ = base.served_at(cfg.budget)
    tab = variant_table(ctx, base, served)
    fits = variants.train_variants(tab, seed, cfg.vm_epochs, cfg.vm_batch_size, names=VARIANTS,
                                   grid_points=cfg.grid_points, cache=ctx.out / "vm_cache")
    values = tier_values(tab, fits, 1, cfg.n_boot, seed)
    return {"method": __doc__.split("\n\n")[1].replace("\n", " "), "seed": seed, "data_seed": data_seed(cfg, seed),
            "commit": code_commit(), "validation": values, "chosen": list(choose(values)),
            "variants": {k: {kk: v[kk] for kk in ("params", "valid_bce")} for k, v in fits.items()},
            "config": report_config(cfg)}


def committed() -> dict | None:
    """The committed choice (``RESULT``), or None before it has run."""
    return json.loads(RESULT.read_text()) if RESULT.exists() else None
