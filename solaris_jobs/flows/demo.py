"""``solaris demo``: SOLARIS at work where it applies, then what it showed in one table.

On synthetic ad-like traffic (the evaluation's headline generator configuration at the quick size,
``evaluation.config.quick_config``): the FM, autoencoder and verifier trained once on ``[t0, t1)``; the real refresh
DAG with ``dag.test()`` (Airflow in-process, SQLite metadata DB under the workdir) over the first intervals after
t1, with the replay's refresh settings (TTLs counted from the write: the DAG runs on the wall clock), into the embedded SQLite online store of ``feature_repo/``; one read through
the stock Feast SDK and one through the tiered serving client; then the quick replay evaluation with the same
models (``solaris evaluate --quick --no-curves``: the budget and cadence curves are not in the closing table and
took 4 more minutes on 2 cores) and the closing table (``closing_table``).

On MovieLens-100K (``--dataset movielens``, real data, where pairs never recur): the offline comparison of the
rankers and the refresh DAG over a few hourly intervals, which shows what the pair tier can and cannot reach there.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import time
import warnings
from pathlib import Path

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import Settings, dag_env
from solaris_jobs.flows.refresh_steps import STEPS
from solaris_jobs.online import store_config
from solaris_jobs.online.store_config import DEFAULT_REPO

COMMITTED = DEFAULT_REPO.parent / "benchmarks" / "results" / "evaluation_synth.json"
ENV_FILE = "solaris.env"          # the settings the demo's refresh ran with (``make airflow`` reads them)
HOUR = pd.Timedelta(hours=1)


def refresh_cron(every: pd.Timedelta) -> str:
    """The refresh DAG's cron for a cadence of whole hours dividing a day (``settings.dag_env``'s ``cron``)."""
    hours = every / pd.Timedelta(hours=1)
    if hours <= 0 or hours != int(hours) or 24 % int(hours):
        raise ValueError(f"the demo's refresh runs every whole number of hours dividing 24, not {every}")
    return {1: "0 * * * *", 24: "0 0 * * *"}.get(int(hours), f"0 */{int(hours)} * * *")


def refresh_env(settings: Settings, workdir: Path, start: pd.Timestamp, end: pd.Timestamp,
                every: pd.Timedelta, ttl_env: dict | None = None, catchup: bool = False) -> dict:
    """The environment the refresh DAG's tasks run with: ``settings``, the views' TTLs, the DAG's first and last
    interval, cron and catchup (whether a scheduler runs the intervals between them), and an Airflow home with its
    SQLite metadata DB under ``workdir``."""
    return {**settings.to_env(), **(ttl_env or {}),
            **dag_env(start_date=start, end_date=end, retries=0, cron=refresh_cron(every), catchup=catchup),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
            "AIRFLOW_HOME": str(workdir / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            # dag.test() serializes the DAG into its bundle: the DAG file must be in the dags folder.
            "AIRFLOW__CORE__DAGS_FOLDER": str(DEFAULT_REPO.parent / "dags"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{workdir / 'airflow' / 'airflow.db'}"}


def write_env_file(path: Path, env: dict) -> None:
    """``env``'s SOLARIS_* variables as shell assignments (``set -a; . FILE``): Airflow for real on the demo's
    data, models and settings (``make airflow``)."""
    lines = [f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items()) if k.startswith("SOLARIS_")]
    path.write_text("# written by `solaris demo`: the settings its refresh ran with\n" + "\n".join(lines) + "\n")


def run_refresh(workdir: Path, env: dict, ends: list[pd.Timestamp], echo=print) -> list[dict]:
    """The refresh DAG (``dag.test()``) over the intervals ending at ``ends``, with ``env`` (this process's
    environment is restored after), then one read through the Feast SDK and one through the tiered reader; prints
    each interval's coverage and task times and returns each interval's report."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return _run_refresh(workdir, env, ends, echo)
    finally:        # what runs next in this process (the quick replay) takes its settings from itself alone
        os.environ.clear()
        os.environ.update(saved)


def _run_refresh(workdir: Path, env: dict, ends: list[pd.Timestamp], echo) -> list[dict]:
    (workdir / "airflow").mkdir(parents=True, exist_ok=True)
    # Nothing a user can act on: Airflow's start-up lines, and a deprecation inside FastAPI's test client, which
    # dag.test() uses to call the execution API in-process.
    logging.getLogger("airflow").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
        return _dag_runs(workdir, env, ends, echo)


STORE_MARK = "online_store.written"    # which embedded store the demo's last refresh wrote, and its state then


def _store_state(path: Path) -> str:
    st = path.stat()
    return json.dumps({"path": str(path.resolve()), "mtime_ns": st.st_mtime_ns, "size": st.st_size})


def _fresh_stores(workdir: Path, echo) -> None:
    """Each run replays the same past intervals, so it starts from empty stores where they are the demo's own: the
    embedded online store held what the last run wrote for later intervals, newer than the requests served again,
    which the reader refuses as such (coverage 0 on a rerun). The SQLite file is deleted only when it is the one
    the demo's last refresh wrote and nothing wrote it since (``STORE_MARK``); the offline store only when this
    workdir holds the demo's settings file. Any other store is left as it is, with a note."""
    import shutil
    cfg = store_config.load()
    mark = workdir / STORE_MARK
    if cfg.kind == "sqlite" and cfg.sqlite_path.exists():
        if mark.exists() and mark.read_text() == _store_state(cfg.sqlite_path):
            cfg.sqlite_path.unlink()
        else:
            echo(f"note: the online store {cfg.describe()} holds rows this demo did not write last (or was written "
                 f"since): left as it is; rows there newer than the demo's requests count as misses")
    elif cfg.kind != "sqlite":
        echo(f"note: the online store {cfg.describe()} is not the embedded one: left as it is; rows an earlier demo "
             f"run wrote there are newer than the requests served again and count as misses")
    offline = workdir / "offline"
    if offline.exists() and (workdir / ENV_FILE).exists():
        shutil.rmtree(offline)


def _mark_store(workdir: Path) -> None:
    cfg = store_config.load()
    if cfg.kind == "sqlite" and cfg.sqlite_path.exists():
        (workdir / STORE_MARK).write_text(_store_state(cfg.sqlite_path))


def _dag_runs(workdir: Path, env: dict, ends: list[pd.Timestamp], echo) -> list[dict]:
    _fresh_stores(workdir, echo)
    write_env_file(workdir / ENV_FILE, env)
    from airflow.utils import db           # after AIRFLOW_HOME is set
    db.initdb()
    spec = importlib.util.spec_from_file_location("solaris_refresh_dag", DEFAULT_REPO.parent / "dags" /
                                                  "solaris_refresh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    offline = Settings.from_env().offline
    rows = []
    for e in ends:
        t0 = time.perf_counter()
        run = mod.dag.test(logical_date=e.to_pydatetime())      # a manual run covers the interval ending here
        tis = {ti.task_id: ti for ti in run.get_task_instances()}
        if run.state != "success":
            raise RuntimeError(f"refresh of the interval ending {e} ended {run.state}: "
                               f"{ {t: ti.state for t, ti in tis.items()} }")
        secs = {t: round((ti.end_date - ti.start_date).total_seconds(), 1) for t, ti in tis.items()
                if ti.start_date and ti.end_date}
        rows.append({"end": e, "report": off.read_report(offline, e), "seconds": secs,
                     "wall_s": time.perf_counter() - t0})
    echo(f"\nrefresh DAG (dag.test) over {len(ends)} interval(s); offline store {offline}, "
         f"online store {store_config.load().describe()}")
    echo(f"{'interval end':26s} {'events':>6s} " + " ".join(f"{t[:6]:>6s}" for t in TIERS)
         + f"  seconds per task ({'/'.join(STEPS)}), run")
    for r in rows:
        cov = r["report"]["coverage"]
        c = "".join(f" {cov[t]:6.2f}" if cov.get(t) is not None else f" {'-':>6s}" for t in TIERS)
        steps = "/".join(f"{r['seconds'].get(t, 0):.1f}" for t in STEPS)
        empty = " (the store was empty: nothing to serve yet)" if r["report"].get("store_empty") else ""
        echo(f"{r['end'].isoformat():26s} {r['report']['events']:6d}{c}  {steps}, {r['wall_s']:.0f}{empty}")
    echo("coverage = share of the interval's logged rows by the tier the serving client (FeatureReader) served them "
         "at their own time from the store the interval found (TTL and model version applied)")
    show_reads(Path(offline), ends[-1], echo)
    _mark_store(workdir)
    return rows


def show_reads(offline: Path, end: pd.Timestamp, echo=print) -> None:
    """One feature read through the stock Feast SDK and one request through the tiered serving client."""
    from feast import FeatureStore

    from solaris_jobs.online.reader import FeatureReader
    from solaris_jobs.online.views import FEATURE_SERVICE
    pairs = off.read_table(offline, "pair_embeddings", end).to_pandas()
    if pairs.empty:
        echo(f"\nno pair embeddings in the interval ending {end}: no read to show")
        return
    user, item = int(pairs.user_id.iloc[0]), int(pairs.item_id.iloc[0])
    spec = importlib.util.spec_from_file_location("solaris_repo_demo", DEFAULT_REPO / "solaris_repo.py")
    repo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repo)
    fs = FeatureStore(repo_path=str(DEFAULT_REPO))
    fs.apply(repo.OBJECTS)
    got = fs.get_online_features(features=fs.get_feature_service(FEATURE_SERVICE), full_feature_names=True,
                                 entity_rows=[{"user_id": user, "item_id": item}]).to_dict()
    emb = got["pair_embeddings__embedding"][0]
    echo(f"\nFeast SDK, FeatureService {FEATURE_SERVICE}, user {user} item {item}: pair embedding "
         f"[{', '.join(f'{x:.3f}' for x in emb[:4])}, ...] ({len(emb)} floats), model "
         f"{got['pair_embeddings__model_version'][0]}")
    reader = FeatureReader(store_config.load(), pairs.model_version.iloc[0], len(emb), misses=None)
    items = list(pairs[pairs.user_id == user].item_id[:5]) + [999_999]
    at = end + pd.Timedelta(minutes=30)
    f = reader.read(user, items, at)
    echo(f"tiered read (FeatureReader, the product's tiers) for user {user} at {at}: "
         + ", ".join(f"{i}->{t}" for i, t in zip(items, f.tier_names())) + f" ({f.latency_ms:.1f} ms)")
    reader.close()


def synth_demo(workdir: Path, reports: Path, intervals: int, master: str, echo=print) -> dict:
    """The main job on synthetic ad-like traffic: models, refresh DAG, store, reads, quick replay, closing table."""
    from dataclasses import replace

    from solaris_jobs.evaluation.config import quick_config, refresh_settings, ttls
    from solaris_jobs.evaluation.run import eval_session, evaluate, seed_models
    # Without the curves (4 min more on 2 cores): the replay runs at the headline budget itself, not derived from
    # one at the curve's largest budget; the closing table shows no curve. `solaris evaluate --quick` draws them.
    cfg = replace(quick_config(), spark_master=master, curves=False)
    seed = cfg.seeds[0]
    t0 = time.perf_counter()
    root, protocol, models_dir, metrics = seed_models(cfg, reports, seed)
    echo(f"models trained on [{protocol.t0}, {protocol.t1}) of {root} ({time.perf_counter() - t0:.0f} s; reused "
         f"when unchanged): FM validation BCE {metrics['fm']['valid_bce']:.4f}, verifier "
         f"{metrics['vm']['valid_bce']:.4f}, autoencoder explained variance "
         f"{metrics['ae']['test_explained_variance']:.3f}")
    rows = []
    if intervals > 0:
        eval_session(cfg)       # the refresh's Spark steps then run in the JVM the quick replay runs in, as it starts it
        every = pd.Timedelta(cfg.cadence)
        ends = [protocol.t1 + every * (k + 1) for k in range(intervals)]
        # The replay's refresh settings, but the DAG runs on the wall clock over a log from the past: TTLs count
        # from the write (as for MovieLens), else every row would have expired long before it was read.
        settings = refresh_settings(cfg, root, workdir / "offline", models_dir, cfg.budget).override(
            expire_from="write")
        # catchup: `make airflow` with these settings schedules the demo's intervals (their dates are past).
        env = refresh_env(settings, workdir, protocol.t1, ends[-1], every, ttls(cfg), catchup=True)
        rows = run_refresh(workdir, env, ends, echo)
    echo(f"\nquick replay evaluation with the same models (solaris evaluate --quick --no-curves) -> {reports}")
    report = evaluate(cfg, reports)
    committed = json.loads(COMMITTED.read_text()) if COMMITTED.exists() else None
    echo("\n" + closing_table(report, committed))
    echo(f"\nthe quick evaluation's report: {reports / 'report.html'}")
    return {"refresh": rows, "report": report}


def movielens_env(workdir: Path, models: Path, master: str, end: pd.Timestamp) -> dict:
    """The refresh's environment on the MovieLens demo's data and checkpoints, hourly intervals up to ``end``."""
    from solaris_jobs.core.settings import PrecomputeConfig
    s = Settings(data=str(workdir / "data"), offline=str(workdir / "offline"), models=str(models),
                 expire_from="write", spark_master=master,
                 # MovieLens users rate in bursts and leave: a week of activity and the whole log as history.
                 precompute=PrecomputeConfig(active_hours=168, lookback_days=None),
                 # The demo prints its own summary: task logs and Spark's warnings would bury it.
                 spark_log_level="ERROR")
    return refresh_env(s, workdir, pd.Timestamp("1998-01-01", tz="UTC"), end, HOUR)


def movielens_demo(workdir: Path, seeds: list[int], fm_epochs: int, intervals: int, last_end: str, master: str,
                   echo=print) -> dict:
    """MovieLens-100K (real data): the rankers' offline comparison and the refresh DAG over hourly intervals."""
    from solaris_jobs.learning.experiment import run_movielens
    report = run_movielens(workdir, seeds, fm_epochs=fm_epochs)
    echo(report["table"])
    rows = []
    if intervals > 0:
        end = pd.Timestamp(last_end)
        end = end.tz_localize("UTC") if end.tzinfo is None else end
        ends = [end - HOUR * k for k in reversed(range(intervals))]
        rows = run_refresh(workdir, movielens_env(workdir, workdir / "models" / f"seed{seeds[0]}", master, end),
                           ends, echo)
        pair = [r["report"]["coverage"].get("pair") for r in rows]
        pair = [p for p in pair if p is not None]
        if pair:
            echo(f"\nWhat this shows: on MovieLens a user rates a film once, so a (user, item) pair almost never "
                 f"comes back; the pair tier served {100 * sum(pair) / len(pair):.0f}% of the refreshed intervals' "
                 f"rows. SOLARIS precomputes pairs that will be ranked again: on such a log it has little to do "
                 f"(`solaris data profile` says so before a run). `make demo` shows it on traffic where pairs recur.")
    return {"refresh": rows, "report": report}


def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ci(ci, nd=4) -> str:
    return f" [{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}]" if ci else ""


def closing_table(report: dict, committed: dict | None) -> str:
    """What the demo showed, in a few lines: this run's coverage by tier, FM inferences per served row, serving
    latency and the rankers' test BCE with intervals (labelled: this size shows the mechanism, not the claim); then
    the headline criterion and TRs of the committed full evaluation (``committed``), labelled as such."""
    from solaris_jobs.evaluation.report import SHORT
    s, ps = report["summary"][0], report["per_seed"][0]
    cfg = report["config"]
    sc = cfg.get("synth") or {}
    cov = s["coverage"]
    shares = ", ".join(f"{t} {v:.2f}" for t, v in (cov["shares"] or {}).items() if v)
    lat = ps["replay"].get("serving_latency_ms") or {}
    n_cand = cfg.get("n_candidates")
    test = ps["headline"]["test"]["variants"]
    names = [k for k in ("vm", "vm_kd", "solaris", "fm") if k in test]
    W = 40                  # the labels' column
    L = [f"SOLARIS on synthetic ad-like traffic (generator v{report['data'].get('generator_version', '?')}, "
         f"sequence share {sc.get('sequence_share', '?')}), {sc.get('users', '?'):,} users over "
         f"{sc.get('days', '?')} days, seed {s['seed']}: this size shows the mechanism, not the claim.",
         f"{'coverage of the test rows by tier':{W}s} {shares} (any tier {_f(cov['any_tier'])}; pair tier at "
         f"{_f(cov['pair_of_ceiling'])} of the data's ceiling {_f(cov['ceiling'])})",
         f"{'FM inferences per served row':{W}s} {s['fm_per_row']:.2f} pairs"
         + (f", {s['fm_total_per_row']:.2f} with the user embeddings" if s.get("fm_total_per_row") is not None
            else ""),
         f"{'serving latency (Redis, FeatureReader)':{W}s} "
         + (f"p50 {lat['latency_p50_ms']:.2f} ms, p99 {lat['latency_p99_ms']:.2f} ms per request of {n_cand} "
            f"candidates ({ps['replay']['requests']:,} requests)" if lat else "-"),
         f"{'test BCE [95% interval over users]':{W}s} "
         + "; ".join(f"{SHORT.get(k, k.upper())} {test[k]['bce']:.4f}{_ci(test[k]['bce_ci'])}" for k in names)]
    c = s.get("dbce_criterion")
    if c:
        L.append(f"{'dBCE(all tiers) - 1.5 dBCE(KD)':{W}s} {c['value']:+.5f}{_ci(c['ci'], 5)} (this seed; users "
                 f"resampled)")
    if committed is None:
        L.append("no committed full evaluation found (benchmarks/results/evaluation_synth.json)")
        return "\n".join(L)
    a = (committed.get("targets") or {}).get("across_seeds")
    cs = committed["config"].get("synth") or {}
    seeds = ",".join(str(p["seed"]) for p in committed["summary"])
    L.append(f"the committed full evaluation (benchmarks/results/evaluation_synth.json: {cs.get('users', '?'):,} users, "
             f"seeds {seeds}; not this run)" + ("" if a else ", before #40's protocol (all seeds on one data draw, "
                                                              "no recency inputs; superseded, kept for the record):"))
    if a:
        crit = a["criterion"]
        L.append(f"{'  ' + crit['statistic']:{W}s} {crit['value']:+.5f}{_ci(crit['ci'], 5)} (seeds and users "
                 f"resampled): " + {True: "met", False: "missed", None: "not decided"}[crit.get("met")])
    trs = [(k, [p["tr"].get(k) for p in committed["summary"]]) for k in ("solaris", "vm_kd")]
    L.append(f"{'  TR per seed':{W}s} " + "; ".join(
        f"{SHORT.get(k, k)} " + ", ".join("-" if x is None else f"{x:.2f}" for x in xs) for k, xs in trs))
    return "\n".join(L)
