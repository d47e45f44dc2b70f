"""Why the evaluation's pool is ranked by recency: the same replay with the paper's ranking, the verifier's score
alone, at the headline budget, beside the headline (recency, then the verifier) on the same test rows.

Runs after ``solaris evaluate`` (it reuses that run's data, models, FM outputs and the headline VM's
hyperparameters, and replays with the same jobs, store and reader):

    .venv/bin/python benchmarks/priority_ablation.py --eval artifacts/eval-synth --seed 0

Prints a table and writes ``benchmarks/results/priority_ablation.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", required=True, help="the output folder of a finished `solaris evaluate` run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "priority_ablation.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from solaris_jobs import events as ev
    from solaris_jobs import jobs, model_refs, replay, training
    from solaris_jobs.event_source import EventTable
    from solaris_jobs.evaluation import metrics, variants
    from solaris_jobs.evaluation import run as er
    from solaris_jobs.evaluation.protocol import Protocol
    from solaris_jobs.settings import Settings
    t_all = time.perf_counter()
    out = Path(a.eval).resolve()
    report = json.loads((out / "report.json").read_text())
    cfg = er.EvalConfig(**{**{k: v for k, v in report["config"].items() if k not in ("synth", "models")}})
    cfg = replace(cfg, synth=er.SynthConfig(**report["config"]["synth"]),
                  models=er.ModelsConfig(**report["config"]["models"]), seeds=tuple(report["config"]["seeds"]),
                  budgets=tuple(report["config"]["budgets"]), sequence_shares=tuple(report["config"]["sequence_shares"]),
                  sweep_variants=tuple(report["config"]["sweep_variants"]))
    P = Protocol.from_dict(report["protocol"])
    seed = next(r for r in report["per_seed"] if r["seed"] == a.seed)
    root = er._data(cfg, out)
    events = EventTable(ev.read_events(root), str(root))
    spark = jobs.session(Settings(spark_master=cfg.spark_master, spark_log_level="ERROR", spark_driver_memory="6g"),
                         "ablation")
    sdir = out / f"seed{a.seed}"
    models = model_refs.resolve(sdir / "models", ("fm", "ae", "vm"))
    ctx = er.SeedContext(replace(cfg, select_priority="verifier"), root, sdir, P, a.seed, events, spark)
    plan = replay.ReplayPlan(P.t1, P.t3, pd.Timedelta(cfg.cadence), pd.Timedelta(cfg.delay), er._ttls(cfg))
    t0 = time.perf_counter()
    rec = er._replay(ctx, models, sdir / "models", f"replay-verifier-b{cfg.budget:g}", plan, cfg.budget)
    replay_s = time.perf_counter() - t0
    served_v = replay.read_served(sdir / f"replay-verifier-b{cfg.budget:g}")
    head_dir = sdir / f"derived-b{cfg.budget:g}-x1"
    served_h = replay.read_served(head_dir if head_dir.exists() else sdir / f"replay-b{cfg.budget:g}")
    data = training.load_dataset(str(root), models.history_len, cuts=(P.valid_from, P.t2))
    cache = variants.fm_outputs(data, models.fm.path, models.ae.path, P, sdir / "cache")
    tab = variants.build_table(data, P, served_h, cache)
    params = {"solaris": seed["variants"]["solaris"]["params"]}
    fits = variants.train_variants(tab, a.seed, cfg.vm_epochs, cfg.vm_batch_size, ["vm", "solaris"],
                                   {"vm": seed["variants"]["vm"]["params"], **params}, cache=sdir / "vm_cache")
    tab_v = variants.build_table_like(tab, served_v)
    fit_v = variants.train_variants(tab_v, a.seed, cfg.vm_epochs, cfg.vm_batch_size, ["solaris"], params,
                                    cache=sdir / "vm_cache")["solaris"]
    test = tab.split == 2
    y = tab.labels[test]
    probs = er._probs(tab, fits)
    probs["verifier"] = fit_v["test_prob"]
    losses = {k: metrics.row_bce(y, probs[k]) for k in ("vm", "fm", "solaris", "verifier", "base_rate")}
    summ = metrics.summarize_losses(losses, tab.users[test], y, probs, floor="base_rate",
                                    boot=metrics.PairedBootstrap(tab.users[test], cfg.n_boot, seed=a.seed))
    rows = {}
    for name, served, key in (("recency, then verifier (headline)", served_h, "solaris"),
                              ("verifier score (the paper's)", served_v, "verifier")):
        extra = er._ceiling_and_segments(ctx, served, plan.every)
        ts = served.column("event_timestamp").cast("int64").to_numpy()
        cov = er._coverage(served, (ts >= P.t2.value // 1000) & (ts < P.t3.value // 1000), extra, P, plan.every)
        cov.pop("per_interval")
        rows[name] = {"coverage": cov, "tr": summ["variants"][key]["tr"], "tr_ci": summ["variants"][key]["tr_ci"],
                      "bce": summ["variants"][key]["bce"]}
    res = {"eval": str(out), "seed": a.seed, "budget_per_row": cfg.budget, "rows": rows, "gap": summ["gap"],
           "verifier_replay": er._replay_summary(rec), "timings": {"replay_s": round(replay_s, 1),
                                                                  "total_s": round(time.perf_counter() - t_all, 1)}}
    print(f"{'priority':36s} {'pair':>6s} {'any':>6s} {'pair/ceil':>9s} {'TR':>6s}  95%")
    for k, r in rows.items():
        c = r["coverage"]
        tr = "-" if r["tr"] is None else f"{r['tr']:.3f}"
        ci = "" if not r["tr_ci"] else f"[{r['tr_ci'][0]:.3f}, {r['tr_ci'][1]:.3f}]"
        print(f"{k:36s} {c['shares']['pair']:6.3f} {c['any_tier']:6.3f} {c['pair_of_ceiling']:9.3f} {tr:>6s}  {ci}")
    Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
