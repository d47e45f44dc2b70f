"""The refresh at scale: one hourly interval end to end (select, embed, aggregate, neighbours, materialize into a
real redis-server) on synthetic logs of 10K, 100K and 1M users, with wall time and peak memory per stage and in
total, and pairs/s. Each size runs in its own child process, so its peak memory is its own; the peak is the RSS
of the whole process tree (driver JVM, Python driver and workers, redis-server), sampled every 0.2 s.

    .venv/bin/python benchmarks/scale.py --users 10000 100000 1000000
    .venv/bin/python benchmarks/scale.py --plot-only          # re-plot benchmarks/results/scale.json

Since #39 the product's defaults are the evaluated configuration (``--config evaluated``, the default here); the
figures of the "default configuration" before then are ``--config per-user-share``. Its settings were fixed here,
before any run, and were the product's defaults except where said:
- the log: ``solaris data synth`` defaults (ad-like traffic, 5% positives) with ``--days 2`` (one day of active
  users plus one day before them: an interval's work is driven by the users active in the last 24 h and their
  candidates; the 30-day lookback then reads the whole 2-day log, so log length is not what this measures) and
  ``--items 50000`` (the catalogue does not grow with users);
- the interval: the log's last hour; ``active_hours`` 24, ``lookback_days`` 30, ``--candidates 100`` (the figures
  #13 started from: 100K users, 10 minutes an interval), ``select_share`` 0.2, ``knn_requery all`` (the first
  interval of a run is always a full one);
- the models: production size (FM d_model 64, 2 layers, history 50; AE 32-d codes; VM) trained once, for one
  epoch on 200K rows, on the smallest size's log, and used for every size: users the models never saw map to the
  padding row, which costs the same as any other;
- materialize: ``expire_from write`` (the log is in the past), every view.

``--config evaluated`` (added 2026-12-04, after the default configuration's runs and before any run of its own)
runs the same log, models and interval with the refresh settings the replay evaluation (#11) measured instead of
the product's defaults: taken from ``solaris_jobs.evaluation.config``'s own ``EvalConfig`` and ``refresh_settings``
(so they cannot drift): a budget of 0.5 FM pair inferences per served row over one global ranking by recency, the
pool = pairs ranked in the last 24 h + 20 simulator candidates per active user + misses, no negative exclusion, the
whole log as lookback, 24 h aggregate window; ``knn_requery all`` (the evaluation's default too). #13 asks that "its
budgeted candidate pool must scale too" and that outputs stay what the evaluation measured: this is that pool.
Its figures go to ``scale_evaluated.json`` / ``.png``; the default configuration's stay in ``scale.json``.

``--steady`` (added 2026-12-04, with the state that select updates from the previous interval's, and before any
run of it) measures a steady-state hourly interval instead of the first one of a run: the hour before the log's
last runs first (every stage, in its own process: its figures are kept as ``previous``), then the last hour in a
fresh process, as production's next hourly run would: its state (histories and counters) is updated from the
previous interval's instead of rebuilt from the whole lookback, and only the last 24 h of the log are read unless
the request simulator runs. Everything else is the configuration's (``knn_requery all``: every user re-embedded
and re-queried each hour). ``--knn-requery active`` (a secondary figure, not what the evaluation measured)
re-embeds and re-queries only the users with an event since the previous interval, against its index. Figures go
to ``scale[_<config>]_steady[_knn_active].json``.

``--days 30 --users 10000 --steady --config evaluated`` (added 2026-12-04 evening, before its run): the same
traffic per user over 30 days, so that the evaluated configuration's lookback (the whole log) is 30x what the
pool's 24 h window reads: what the state's update saves when the lookback is long. A log of other
than 2 days has its own folders (``data_<users>_<days>d``); the models are the same.

Saves benchmarks/results/scale.json and benchmarks/results/scale.png (time and memory vs users, log-log, with the
linear reference through the smallest size).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from precompute_jobs import PeakRSS  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
STAGES = ("select", "embed", "aggregate", "neighbours", "materialize")


def train_models(data: Path, out: Path) -> dict:
    """The product's FM, AE and verifier VM (its widths and recipes, the evaluated ones: ``TrainSettings``'
    defaults), the FM for one epoch, on 200K rows of ``data``: the FM's trunk is what costs at inference, and it
    is the product's."""
    from solaris_jobs.core.settings import TrainSettings
    from solaris_jobs.learning import training
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ts = TrainSettings(epochs=1, max_train_rows=200_000)
    ds = training.load_dataset(str(data), history_len=ts.history_len, max_train_rows=ts.max_train_rows)
    training.train_as_product("fm", ds, out / "fm.pt", ts)
    training.train_as_product("ae", ds, out / "ae.pt", ts, fm_path=out / "fm.pt")
    training.train_as_product("verifier", ds, out / "vm.pt", ts)
    return {"seconds": round(time.perf_counter() - t0, 1), "trained_on": str(data), "train_settings": ts.model_dump()}


def settings_for(config: str, data: Path, offline: Path, models: Path, master: str):
    """The refresh settings of ``config``: ``evaluated`` (what the replay evaluation measured, from its own code: the
    product's defaults since #39) or ``per-user-share`` (the defaults before, with the overrides of the docstring)."""
    from solaris_jobs.core.settings import PrecomputeConfig, Settings, apply_flags
    if config == "evaluated":
        from solaris_jobs.evaluation.config import EvalConfig, refresh_settings
        cfg = EvalConfig()
        s = refresh_settings(cfg, data, offline, models, cfg.budget)
        return replace(s, spark_master=master, spark_log_level="WARN")
    # per-user-share: the refresh's defaults before #39 (the per-user top 20% of simulator candidates, misses forced
    # in, negative exclusion), the "default configuration" of the figures before then.
    return apply_flags(Settings(data=str(data), offline=str(offline), models=str(models), spark_master=master,
                                precompute=PrecomputeConfig.per_user_share()), {
        "precompute.active_hours": 24.0, "precompute.lookback_days": 30.0,
        "precompute.simulator.n_candidates": 100,               # half of them popular
        "precompute.knn_requery": "all"})


def folders(work: Path, users: int, days: float, config: str) -> tuple[Path, Path]:
    """The log's and the outputs' folders of a size (a log of other than 2 days gets its own)."""
    suffix = f"_{days:g}d" if days != 2.0 else ""
    return (work / f"data_{users}{suffix}",
            work / (f"offline_{users}{suffix}" if config == "per-user-share" else f"offline_{config}_{users}{suffix}"))


def one_size(users: int, items: int, days: float, work: Path, models: Path, master: str,
             config: str = "evaluated", phase: str = "cold", knn_requery: str | None = None) -> dict:
    """Generates the log for ``users``, then runs its last hour through every stage; the figures as a dict.
    ``phase``: ``cold`` (the first interval: the offline store starts empty), ``previous`` (the hour before the
    last, the offline store emptied first) or ``steady`` (the last hour after ``previous``: its outputs kept)."""
    import pandas as pd

    from solaris_jobs.data import synth
    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialize
    from solaris_jobs.pipeline import jobs
    from tests.support import RedisServer, feast_yaml

    data, offline = folders(work, users, days, config)
    cfg = synth.SynthConfig(users=users, items=items, days=days, seed=0)
    if (data / "manifest.json").exists():                  # a log of an earlier run of the same size
        gen = {"reused": True, "rows": json.loads((data / "manifest.json").read_text())["events"]}
    else:
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            manifest = synth.generate(cfg, data)
            gen = {"seconds": round(time.perf_counter() - t0, 1), "rows": manifest["events"]}
        gen["peak_rss_mb"] = round(mem.peak / 2**20)
    print(f"users {users:,}: {gen['rows']:,} events (generated in {gen.get('seconds', 'an earlier run')} s)", flush=True)
    model_info = None
    if not (models / "vm.pt").exists():
        model_info = train_models(data, models)
        print(f"trained the models on it in {model_info['seconds']} s", flush=True)
    end = pd.Timestamp(cfg.start) + pd.Timedelta(days=days) - pd.Timedelta(hours=int(phase == "previous"))
    start = end - pd.Timedelta(hours=1)
    if phase != "steady" and offline.exists():            # outputs of an earlier run: the interval starts clean
        import shutil
        shutil.rmtree(offline)
    s = settings_for(config, data, offline, models, master)
    if knn_requery:
        s = replace(s, precompute=replace(s.precompute, knn_requery=knn_requery))
    stages: dict = {}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server, PeakRSS() as total:
        t_all = time.perf_counter()
        t0 = time.perf_counter()
        spark = jobs.session(s, "scale")
        spark_start = round(time.perf_counter() - t0, 1)
        try:
            sc = spark.sparkContext                # to count each step's Spark jobs (classic sessions)
        except Exception:                          # a Spark Connect session has no SparkContext: no counts
            sc = None
        try:
            for step in jobs.SPARK_STEPS:
                if sc is not None:
                    sc.setJobGroup(step, step)
                with PeakRSS() as m:
                    t0 = time.perf_counter()
                    st = jobs.run(spark, s, start, end, (step,))[step]
                seconds = round(time.perf_counter() - t0, 1)
                n_jobs = len(sc.statusTracker().getJobIdsForGroup(step)) if sc is not None else None
                if step == "select" and phase == "steady" and (st.get("state") or {}).get("built") != "incremental":
                    raise RuntimeError(f"the steady-state interval rebuilt its state: {st.get('state')}")
                stages[step] = {"seconds": seconds, "peak_rss_mb": round(m.peak / 2**20), "spark_jobs": n_jobs,
                                "stats": st}
                print(f"  {step}: {stages[step]['seconds']} s, {n_jobs} Spark jobs, peak "
                      f"{stages[step]['peak_rss_mb']} MB", flush=True)
        finally:
            spark.stop()
        store = store_config.load(ROOT / "feature_repo", feast_yaml(
            Path(tmp) / "fs.yaml", f'  type: redis\n  connection_string: "{server.url}"'))
        with PeakRSS() as m:
            t0 = time.perf_counter()
            st = materialize(store, str(offline), end, expire_from="write")
        stages["materialize"] = {"seconds": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(m.peak / 2**20),
                                 "stats": st}
        print(f"  materialize: {stages['materialize']['seconds']} s", flush=True)
        wall = time.perf_counter() - t_all
    sel, emb = stages["select"]["stats"], stages["embed"]["stats"]
    return {"users": users, "config": config, "phase": phase, "items": items, "days": days, "generate": gen, "models": model_info,
            "precompute": asdict(s.precompute),
            "interval": [start.isoformat(), end.isoformat()], "spark_start_seconds": spark_start,
            "stages": stages, "seconds": round(wall, 1), "peak_rss_mb": round(total.peak / 2**20),
            "active_users": sel["users"], "pairs_considered": sel["pairs_considered"],
            "pairs_selected": sel["pairs_selected"], "pairs_per_s": round(emb["pairs"] / wall, 1),
            "embed_model_pairs_per_s": emb.get("model_pairs_per_s")}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = sorted(results, key=lambda r: r["users"])
    n = [r["users"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "seconds", "wall time (s)"), (axes[1], "peak_rss_mb", "peak memory (MB)")):
        for stage in STAGES:
            ax.plot(n, [r["stages"][stage][key] for r in results], "o-", ms=3, lw=1, label=stage)
        ax.plot(n, [r[key] for r in results], "ko-", lw=2, label="interval" if key == "seconds" else "whole run")
        ref = results[0][key]
        ax.plot(n, [ref * u / n[0] for u in n], "k:", lw=1, label="linear")
        ax.set(xscale="log", yscale="log", xlabel="users", ylabel=label)
        ax.grid(True, which="both", lw=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("One hourly interval, 2 cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--days", type=float, default=2.0)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--work", default=None, help="Folder for logs, models and outputs (default: a temporary one).")
    ap.add_argument("--config", choices=("per-user-share", "evaluated"), default="evaluated",
                    help="The refresh settings: those the replay evaluation measured (the product's defaults since "
                         "#39), or the per-user top share (the defaults before).")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/scale.json (scale_evaluated.json)")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--steady", action="store_true", help="A steady-state interval: the last hour after the one "
                                                             "before it (see above).")
    ap.add_argument("--knn-requery", choices=("all", "active"), default=None,
                    help="Override the configuration's knn_requery (with --steady).")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # the child process of one size
    ap.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    args = ap.parse_args()
    name = "scale" + ("" if args.config == "per-user-share" else f"_{args.config}") + ("_steady" if args.steady else "") \
        + (f"_knn_{args.knn_requery}" if args.knn_requery else "")
    out = Path(args.out or OUT / f"{name}.json")
    if args.one:
        work = Path(args.work)
        r = one_size(args.one, args.items, args.days, work, work / "models", args.master, args.config, args.phase,
                     args.knn_requery)
        print("RESULT " + json.dumps(r, default=str), flush=True)
        return
    if args.plot_only:
        plot(json.loads(out.read_text())["results"], out.with_suffix(".png"))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="solaris_scale_"))
    results = json.loads(out.read_text())["results"] if out.exists() else []
    def child(n: int, phase: str) -> dict | None:
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--one", str(n), "--items", str(args.items), "--days", str(args.days),
               "--master", args.master, "--work", str(work), "--config", args.config, "--phase", phase]
        proc = subprocess.Popen(cmd + (["--knn-requery", args.knn_requery] if args.knn_requery else []),
                                stdout=subprocess.PIPE, text=True)
        r = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0 or r is None:
            print(f"users {n:,} ({phase}): failed (exit {proc.returncode}) after {time.perf_counter() - t0:.0f} s",
                  flush=True)
            return None
        return r

    for n in args.users:
        if args.steady:
            prev = child(n, "previous")
            r = child(n, "steady") if prev is not None else None
            if r is not None:
                r["previous"] = prev
        else:
            r = child(n, "cold")
        if r is None:
            break
        results = [x for x in results if x["users"] != n] + [r]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "args": {k: v for k, v in vars(args).items() if k != "one"},
                                   "results": sorted(results, key=lambda x: x["users"])}, indent=2) + "\n")
        print(f"users {n:,}: interval {r['seconds']} s ({r['seconds'] / n * 1e3:.2f} ms per user), peak "
              f"{r['peak_rss_mb']} MB, {r['pairs_selected']:,} pairs selected, {r['pairs_per_s']} pairs/s "
              f"end to end; per stage (s) {[r['stages'][st]['seconds'] for st in STAGES]}; state "
              f"{(r['stages']['select']['stats'].get('state') or {}).get('built')}", flush=True)
    if results:
        plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
