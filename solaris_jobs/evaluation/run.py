"""``solaris evaluate``: the whole replay evaluation of one data set, written to ``<out>/report.json`` (every number,
the settings, the seeds and the protocol's dates) and ``<out>/report.md`` with its plots.

Per seed (``seed.run_seed``; the seed varies the FM, the autoencoder, the verifier and the VMs, and, on synthetic
data with ``data_per_seed``, the log itself: seed k draws its log with generator seed ``synth.seed + k`` from the
same configuration, so that the intervals across seeds hold data and model variance): train the models on ``[t0, t1)``; replay ``[t1, t3)`` at the largest budget (``solaris_jobs.learning.replay``);
derive the headline budget and cadence from it (``curves``); train the VM variants on what was served
(``variants``); measure BCE, AUC and TR with paired-bootstrap intervals over users, overall, per tier and per
segment, and coverage and cost through what ``FeatureReader`` served. The budget and cadence curves and the
15-minute replay run for the first seed only; the sweep over the share of the label signal only a sequence model
can see runs one seed per share (``sweep_seed``; ``--seeds none`` runs the sweep alone, and ``evaluate-merge``
(``merge``) joins it to the headline's seeds).

Everything expensive is cached under ``<out>`` (data, checkpoints, replays, FM outputs) and reused when its inputs
are unchanged, so a rerun only redoes what changed; ``--fresh`` starts over.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from solaris_jobs.evaluation import report as rep
from solaris_jobs.evaluation.config import EvalConfig
from solaris_jobs.evaluation.protocol import data_manifest, freeze_code_versions
from solaris_jobs.evaluation.replays import SeedContext
from solaris_jobs.evaluation.seed import run_seed
from solaris_jobs.evaluation.targets import check_targets, seed_summary, sweep_point
from solaris_jobs.evaluation.windows import protocol_of


def data_seed(cfg: EvalConfig, seed: int) -> int | None:
    """The generator seed of ``seed``'s log (None: a fixed data set)."""
    if cfg.dataset != "synth":
        return None
    return cfg.synth.seed + seed if cfg.data_per_seed else cfg.synth.seed


def dataset_root(cfg: EvalConfig, out: Path, share: float | None = None, seed: int | None = None) -> Path:
    """The data set (generated or converted once under ``out``; synthetic traffic at sequence share ``share``,
    default the config's, drawn for evaluation seed ``seed`` (``data_seed``; default the config's own))."""
    from solaris_jobs.data import movielens, synth
    if cfg.dataset == "path":
        return Path(cfg.data_root)
    if cfg.dataset == "movielens":
        root = out / "data"
        if not (root / "manifest.json").exists():
            movielens.build(root)
        return root
    sc = cfg.synth if share is None else replace(cfg.synth, sequence_share=share)
    if seed is not None:
        sc = replace(sc, seed=data_seed(cfg, seed))
    root = out / f"data-seq{sc.sequence_share:g}" if sc.seed == cfg.synth.seed else \
        out / f"data-seq{sc.sequence_share:g}-seed{sc.seed}"
    stamp = root / "manifest.json"
    if stamp.exists():
        made = json.loads(stamp.read_text())
        if (made.get("config") == json.loads(json.dumps(asdict(sc)))
                and made.get("generator_version") == synth.GENERATOR_VERSION):
            return root
    if root.exists():
        shutil.rmtree(root)
    synth.generate(sc, root)
    return root


def eval_session(cfg: EvalConfig):
    """The Spark session an evaluation's replays run on."""
    from solaris_jobs.core.settings import Settings
    from solaris_jobs.pipeline import jobs
    return jobs.session(Settings(spark_master=cfg.spark_master, spark_log_level="ERROR", spark_driver_memory="6g"),
                        "evaluate")


def evaluate(cfg: EvalConfig, out: Path, *, fresh: bool = False) -> dict:
    """Runs the evaluation into ``out`` and returns the report (also written as report.json and report.md)."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.pipeline.event_source import EventTable
    out = Path(out).resolve()
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    freeze_code_versions()          # the code as loaded now keys the caches, whatever is edited during the run
    t_all = time.perf_counter()
    spark = eval_session(cfg)
    commit = code_commit()
    seeds, sweep, data = [], [], {}

    def seed_data(seed: int):
        """The seed's data set, its manifest, protocol and log (one log at a time in memory); the report's own
        ``data`` and ``protocol`` are the first seed's (each seed's are in ``per_seed``)."""
        root = dataset_root(cfg, out, seed=seed)
        table = ev.read_events(root)
        manifest, protocol = data_manifest(root), protocol_of(cfg, table)
        data.setdefault("manifest", manifest), data.setdefault("protocol", protocol)
        return root, manifest, protocol, EventTable(table, str(root))

    def write(done: bool) -> dict:
        summaries = [seed_summary(r) for r in seeds]
        report = {
            "dataset": cfg.dataset, "complete": done, "config": report_config(cfg),
            "protocol": data["protocol"].to_dict(),
            "data": {k: v for k, v in data["manifest"].items() if k != "seconds"},
            "seeds": [r["seed"] for r in seeds], "summary": summaries, "targets": check_targets(summaries),
            "per_seed": seeds, "sweep": sweep, "timings": {"total_s": round(time.perf_counter() - t_all, 1)}}
        rep.save(report, out)
        return report

    # Written after every seed and sweep point (``complete`` false until the end): a long run is readable early.
    for k, seed in enumerate(cfg.seeds):
        root, manifest, protocol, events = seed_data(seed)
        ctx = SeedContext(cfg, root, out / f"seed{seed}", protocol, seed, events, spark)
        r = run_seed(ctx, with_curves=cfg.curves and k == 0)
        seeds.append({**r, "data_seed": data_seed(cfg, seed), "commit": commit, "protocol": protocol.to_dict(),
                      "data": {f: v for f, v in manifest.items() if f != "seconds"}})
        events.unpersist()
        write(False)
    if not seeds:
        seed_data(cfg.sweep_seed)
    for share in cfg.sequence_shares:
        if cfg.dataset != "synth":
            break
        sweep.append(_sweep_point(cfg, out, share, seeds, spark))
        write(False)
    return write(True)


def seed_models(cfg: EvalConfig, out: Path, seed: int):
    """``seed``'s data set and its FM, autoencoder and verifier trained on ``[t0, t1)`` into ``out/seed<k>/models``,
    as ``evaluate`` trains and then reuses them (the demo's refresh runs on them before its quick replay).
    Returns (data root, protocol, models folder, the models' metrics)."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation.protocol import train_models
    out = Path(out).resolve()
    freeze_code_versions()
    root = dataset_root(cfg, out, seed=seed)
    protocol = protocol_of(cfg, ev.read_events(root, columns=["user_id", "item_id", "event_timestamp"]))
    models = out / f"seed{seed}" / "models"
    metrics = train_models(root, protocol, seed, models, cfg.models, cfg.label_delay_minutes, cfg.fm_checkpoint,
                           cfg.fm_factory, cfg.possibly_leaky)
    return root, protocol, models, metrics


def choose_tiers(cfg: EvalConfig, out: Path) -> dict:
    """The tier choice (``tier_choice``) on ``cfg``'s first seed, every fallback served, into ``out`` (the headline
    evaluation's folder: its data, models, replay and VMs are shared) and returns its table: each tier's value on
    its validation rows with its interval, and the tiers kept."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation import tier_choice, variants
    from solaris_jobs.evaluation.protocol import train_models
    from solaris_jobs.evaluation.scoring import tier_values
    from solaris_jobs.evaluation.seed import replay_base, variant_table
    from solaris_jobs.online.reader import FALLBACKS
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
    train_models(ctx.root, ctx.protocol, seed, ctx.out / "models", cfg.models, cfg.label_delay_minutes,
                 cfg.fm_checkpoint, cfg.fm_factory, cfg.possibly_leaky)
    base = replay_base(ctx, with_curves=cfg.curves)
    served, _ = base.served_at(cfg.budget)
    tab = variant_table(ctx, base, served)
    fits = variants.train_variants(tab, seed, cfg.vm_epochs, cfg.vm_batch_size, names=tier_choice.VARIANTS,
                                   grid_points=cfg.grid_points, cache=ctx.out / "vm_cache")
    values = tier_values(tab, fits, 1, cfg.n_boot, seed)
    return {"method": tier_choice.METHOD, "seed": seed, "data_seed": data_seed(cfg, seed), "commit": code_commit(),
            "validation": values, "chosen": list(tier_choice.choose(values)),
            "variants": {k: {kk: v[kk] for kk in ("params", "valid_bce")} for k, v in fits.items()},
            "config": report_config(cfg)}


def _sweep_point(cfg: EvalConfig, out: Path, share: float, seeds: list[dict], spark) -> dict:
    """The sweep's point at ``share``: the seed ``sweep_seed`` run on that share's data (its headline run when the
    share is the headline's)."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.pipeline.event_source import EventTable
    head = [r for r in seeds if r["seed"] == cfg.sweep_seed]
    if share == cfg.synth.sequence_share and head:
        r = head[0]      # the headline data at the sweep's seed: that seed's headline run is the point
    else:
        r_root = dataset_root(cfg, out, share, seed=cfg.sweep_seed)
        t = ev.read_events(r_root)
        e = EventTable(t, str(r_root))
        ctx = SeedContext(cfg, r_root, out / f"sweep-seq{share:g}" / f"seed{cfg.sweep_seed}", protocol_of(cfg, t),
                          cfg.sweep_seed, e, spark)
        r = run_seed(ctx, with_curves=False, names=cfg.sweep_variants)
        e.unpersist()
    return sweep_point(share, r, ev.read_manifest(dataset_root(cfg, out, share, seed=cfg.sweep_seed))["positive_rate"])


def report_config(cfg: EvalConfig) -> dict:
    """The report's ``config``: every setting of ``cfg``, and the inputs every ranker takes from the log."""
    from solaris_jobs.core.contract import RECENCY_INPUTS
    from solaris_jobs.evaluation import fm_search, tier_choice
    from solaris_jobs.pipeline.history import COUNTER_COLS
    searched, chosen = fm_search.committed(cfg.models.fm_family), tier_choice.committed()
    searched = searched if searched and cfg.dataset == "synth" and fm_search.recipe_of(cfg.models) == \
        searched["chosen"] else None
    chosen = {k: chosen[k] for k in ("method", "seed", "commit", "validation", "chosen")} if chosen and \
        list(cfg.tiers) == chosen["chosen"] and cfg.dataset == chosen["config"]["dataset"] else None
    return {**json.loads(json.dumps(cfg.key(), default=str)),
            "ranker_inputs": {"counters": list(COUNTER_COLS), "recency": list(RECENCY_INPUTS),
                              "solaris_variants_add": ["fm_emb (one slot per tier)", "tier", "fm_age_h",
                                                      "fm_count"]},
            # The validation choices this run's settings come from, where they do (None where they do not).
            "fm_search": searched, "tier_choice": chosen}


def code_commit() -> dict:
    """The commit the evaluation runs (and whether the checkout had uncommitted changes to tracked files)."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()
    return {"sha": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
