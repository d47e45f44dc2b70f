"""The second half of ``solaris demo``: the real refresh DAG over MovieLens intervals with ``dag.test()`` (Airflow
in-process, SQLite metadata DB under the workdir), the embedded SQLite online store of ``feature_repo/``, then the
coverage table and one read through the stock Feast SDK and one through the tiered serving client."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import PrecomputeConfig, Settings, dag_env
from solaris_jobs.flows.refresh_steps import STEPS
from solaris_jobs.online.store_config import DEFAULT_REPO
from solaris_jobs.online.views import FEATURE_SERVICE


def _settings_env(workdir: Path, models: Path, master: str, end: pd.Timestamp) -> dict:
    s = Settings(data=str(workdir / "data"), offline=str(workdir / "offline"), models=str(models),
                 expire_from="write", spark_master=master,
                 # MovieLens users rate in bursts and leave: a week of activity and the whole log as history.
                 precompute=PrecomputeConfig(active_hours=168, lookback_days=None),
                 # The demo prints its own summary: task logs and Spark's warnings would bury it.
                 spark_log_level="ERROR")
    return {**s.to_env(), **dag_env(start_date="1998-01-01T00:00:00+00:00", end_date=end, retries=0),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
            "AIRFLOW_HOME": str(workdir / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            # dag.test() serializes the DAG into its bundle: the DAG file must be in the dags folder.
            "AIRFLOW__CORE__DAGS_FOLDER": str(DEFAULT_REPO.parent / "dags"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{workdir / 'airflow' / 'airflow.db'}"}


def run_refresh_demo(workdir: Path, models: Path, intervals: int, last_end, master: str, echo=print) -> dict:
    end = pd.Timestamp(last_end)
    end = end.tz_localize("UTC") if end.tzinfo is None else end
    os.environ.update(_settings_env(workdir, models, master, end))
    (workdir / "airflow").mkdir(parents=True, exist_ok=True)
    from airflow.utils import db           # after AIRFLOW_HOME is set
    db.initdb()
    spec = importlib.util.spec_from_file_location("solaris_refresh_dag", DEFAULT_REPO.parent / "dags" /
                                                  "solaris_refresh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = []
    for k in reversed(range(intervals)):
        e = end - pd.Timedelta(hours=k)
        t0 = time.perf_counter()
        run = mod.dag.test(logical_date=e.to_pydatetime())      # a manual run covers the interval ending here
        tis = {ti.task_id: ti for ti in run.get_task_instances()}
        if run.state != "success":
            raise RuntimeError(f"refresh of the interval ending {e} ended {run.state}: "
                               f"{ {t: ti.state for t, ti in tis.items()} }")
        secs = {t: round((ti.end_date - ti.start_date).total_seconds(), 1) for t, ti in tis.items()
                if ti.start_date and ti.end_date}
        rep = off.read_report(workdir / "offline", e)
        rows.append((e, rep, secs, time.perf_counter() - t0))
    echo(f"\nrefresh DAG (dag.test) over {intervals} hourly interval(s); offline store {workdir / 'offline'}, "
         f"online store {DEFAULT_REPO / 'data' / 'online_store.db'}")
    echo(f"{'interval end':26s} {'events':>6s} {'pair':>6s} {'aggr.':>6s} {'state':>6s} {'nbr.':>6s} {'none':>6s}  "
         f"seconds per task ({'/'.join(STEPS)}), run")
    for e, rep, secs, wall in rows:
        cov = rep["coverage"]
        c = "".join(f" {cov[t]:6.2f}" if cov[t] is not None else f" {'-':>6s}"
                    for t in TIERS)
        steps = "/".join(f"{secs.get(t, 0):.1f}" for t in STEPS)
        echo(f"{e.isoformat():26s} {rep['events']:6d}{c}  {steps}, {wall:.0f}")
    echo("coverage = share of the interval's logged rows by the tier the serving client (FeatureReader) served them "
         "at their own time from the store the interval found (TTL and model version applied)")
    _show_reads(workdir, models, end, echo)
    return {"intervals": [(e.isoformat(), rep, secs) for e, rep, secs, _ in rows]}


def _show_reads(workdir: Path, models: Path, end: pd.Timestamp, echo) -> None:
    from feast import FeatureStore

    from solaris_jobs.online import store_config
    from solaris_jobs.online.reader import FeatureReader
    pairs = off.read_table(workdir / "offline", "pair_embeddings", end).to_pandas()
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
         f"{got['pair_embeddings__model_version'][0]}, user aggregate over {got['user_aggregates__n_pairs'][0]} "
         f"pairs, {got['neighbours__n_neighbours'][0]} neighbours")
    cfg = store_config.load()
    reader = FeatureReader(cfg, pairs.model_version.iloc[0], len(emb), misses=None)
    items = list(pairs[pairs.user_id == user].item_id[:5]) + [999_999]
    f = reader.read(user, items, end + pd.Timedelta(minutes=30))
    echo(f"tiered read for user {user} at {end + pd.Timedelta(minutes=30)}: "
         + ", ".join(f"{i}->{t}" for i, t in zip(items, f.tier_names())) + f" ({f.latency_ms:.1f} ms)")
    reader.close()
