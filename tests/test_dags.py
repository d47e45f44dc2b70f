"""The Airflow DAGs on real Airflow 3: integrity, ``dag.test()`` end to end on MovieLens with the SQLite and the
Redis online store, backfills through ``solaris backfill``'s task functions, and one live Airflow (its services as
real processes) for the module, which the REST and browser tests read."""
import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from models import load_checkpoint
from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import Settings
from tests.support import ML_END, assert_same_outputs, dag_precompute_json, feast_yaml, RedisServer

ROOT = Path(__file__).resolve().parent.parent
DAGS = ROOT / "dags"
HOUR = pd.Timedelta(hours=1)
HEAVY = ("torch", "pyspark", "feast", "pandas", "solaris_jobs", "faiss", "redis")


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory, movielens_root, ml_models):
    """A fresh Airflow home (SQLite metadata DB, migrated) and the SOLARIS settings the tasks read."""
    home = tmp_path_factory.mktemp("airflow_home")
    mp = pytest.MonkeyPatch()
    env = {"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS), "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
           "SOLARIS_DATA": str(movielens_root), "SOLARIS_MODELS": str(ml_models), "SOLARIS_EXPIRE_FROM": "write",
           "SOLARIS_PRECOMPUTE": dag_precompute_json(), "SOLARIS_START_DATE": "1998-01-01T00:00:00+00:00",
           "SOLARIS_FEATURE_REPO": str(ROOT / "feature_repo"), "SOLARIS_RETRIES": "0"}
    for k, v in env.items():
        mp.setenv(k, v)
    from airflow.utils import db
    db.initdb()
    yield env
    mp.undo()


def _load_dag(path: Path):
    spec = importlib.util.spec_from_file_location(f"dag_{path.stem}_{os.getpid()}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dag


def test_dag_integrity(airflow_env, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    monkeypatch.delenv("SOLARIS_RETRIES")          # the deployed defaults (the other tests fail fast)
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    dag = bag.get_dag("solaris_refresh")
    assert "solaris" in dag.tags and dag.max_active_runs == 1 and dag.doc_md
    # The report serves the interval's requests from the store they met: before this interval's materialize.
    order = ["validate", "drain_misses", "select", "embed", "aggregate", "neighbours", "report", "materialize"]
    assert sorted(dag.task_ids) == sorted(order)
    for a, b in zip(order, order[1:]):
        assert b in dag.get_task(a).downstream_task_ids, (a, b)
    for t in dag.tasks:
        assert t.retries >= 1 and t.doc_md and t.execution_timeout is not None, t.task_id
        assert t.max_active_tis_per_dag == 1, t.task_id        # backfill runs go through each step in turn
        # Its doc says what to do when it fails, and how to rerun it.
        assert "**If it fails**" in t.doc_md and "rerun" in t.doc_md.lower(), t.task_id
    # The owner Airflow shows is the deployment's (SOLARIS_OWNER), on both DAGs.
    monkeypatch.setenv("SOLARIS_OWNER", "ml-platform@example.com")
    for name in ("solaris_refresh.py", "solaris_train.py"):
        assert {t.owner for t in _load_dag(DAGS / name).tasks} == {"ml-platform@example.com"}, name
        assert all("**If it fails**" in t.doc_md for t in _load_dag(DAGS / name).tasks if t.task_id != "prepare")
    assert {o.name for t in dag.tasks for o in t.outlets} >= {
        "solaris_selection", "solaris_pair_embeddings", "solaris_user_aggregates", "solaris_user_states",
        "solaris_neighbours",
        "solaris_online_store"}
    # Parsing imports none of the heavy libraries (a fresh interpreter, as the DAG processor has), and with a
    # Spark connection the Spark steps become SparkSubmitOperators (the FM one on the configured queue).
    # Each Spark step's spark-submit settings come from SOLARIS_SPARK_SUBMIT, applied when the task runs (after the
    # heavy-import check: parsing imports nothing of SOLARIS): shared ones, and the embed step's own on top.
    code = ("import sys, importlib.util as u; s = u.spec_from_file_location('d', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); import json; "
            "heavy = [k for k in sys.argv[2:] if k in sys.modules]; "
            "sub = lambda t: (getattr(m, '_submit_settings', lambda t: None)(t), {f: getattr(t, f, None) for f in "
            "('application', 'conf', 'py_files', '_archives', 'env_vars', '_deploy_mode')})[1]; "
            "print(json.dumps({'heavy': heavy, "
            "'ops': {t.task_id: type(t).__name__ for t in m.dag.tasks}, 'queue': m.dag.get_task('embed').queue, "
            "'submit': {n: sub(m.dag.get_task(n)) for n in ('select', 'embed')} if m.SPARK_CONN else {}}))")
    submit = {"conf": {"spark.executor.memory": "8g"}, "archives": ["env.tar.gz#env"], "env_vars": {"A": "1"},
              "steps": {"embed": {"conf": {"spark.task.resource.gpu.amount": "1"}, "py_files": ["fm.zip"]}}}
    for conn, kind in ((None, "_PythonDecoratedOperator"), ("spark_default", "SparkSubmitOperator")):
        env = {**os.environ, "SOLARIS_FM_QUEUE": "gpu", "SOLARIS_SPARK_SUBMIT": json.dumps(submit)}
        if conn:
            env["SOLARIS_SPARK_CONN_ID"] = conn
        res = subprocess.run([sys.executable, "-c", code, str(DAGS / "solaris_refresh.py"), *HEAVY],
                             capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        info = json.loads(res.stdout.strip().splitlines()[-1])
        assert info["heavy"] == [], info
        assert info["ops"]["embed"] == kind and info["ops"]["validate"] == "_PythonDecoratedOperator"
        assert info["queue"] == "gpu"
    assert info["submit"] == {
        "select": {"application": str(ROOT / "spark_jobs" / "select_candidates.py"),
                   "conf": {"spark.executor.memory": "8g"}, "py_files": None, "_archives": "env.tar.gz#env",
                   "env_vars": {"A": "1"}, "_deploy_mode": None},
        "embed": {"application": str(ROOT / "spark_jobs" / "fm_inference.py"),
                  "conf": {"spark.executor.memory": "8g", "spark.task.resource.gpu.amount": "1"}, "py_files": "fm.zip",
                  "_archives": "env.tar.gz#env", "env_vars": {"A": "1"}, "_deploy_mode": None}}


def _sqlite_yaml(tmp_path: Path) -> Path:
    return feast_yaml(tmp_path / "fs.yaml", f"  type: sqlite\n  path: {tmp_path / 'online.db'}")


def _redis_yaml(tmp_path: Path, server: RedisServer) -> Path:
    return feast_yaml(tmp_path / "fs.yaml", f'  type: redis\n  connection_string: "{server.url}"')


def _dump_sqlite(path: Path) -> dict:
    conn = sqlite3.connect(str(path))
    try:
        return {t: conn.execute(f'SELECT entity_key, feature_name, value, event_ts FROM "{t}" '
                                f'ORDER BY entity_key, feature_name').fetchall()
                for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name LIKE 'solaris_%' "
                                         "AND name NOT IN ('solaris_materialized', 'solaris_leases')")}
    finally:
        conn.close()


def _run_dag_test(offline: Path, yaml_path: Path, end: pd.Timestamp = ML_END):
    """dag.test() of solaris_refresh for the interval ending ``end``, and what it must leave behind; the DAG."""
    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialized_intervals
    from solaris_jobs.online.reader import FeatureReader
    dag = _load_dag(DAGS / "solaris_refresh.py")
    # A manual run's data interval is the one that ended at its logical date (run-after semantics).
    run = dag.test(logical_date=end.to_pydatetime())
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert run.state == "success", states
    assert pd.Timestamp(run.data_interval_start) == end - HOUR and pd.Timestamp(run.data_interval_end) == end
    assert set(states.values()) == {"success"} and len(states) == 8
    cfg = store_config.load(ROOT / "feature_repo", yaml_path)
    assert end in materialized_intervals(cfg)
    from solaris_jobs.core import offline as off
    report = off.read_report(offline, end)
    assert report["interval_end"] == end.isoformat() and report["fail_open"] == 0
    # The report runs before materialize: on this fresh store the interval found nothing, so every row is none.
    assert report["store_empty"] and report["coverage_counts"]["none"] == report["events"]
    # Coverage counts every logged row of the interval once, by the tier the reader served it.
    assert sum(report["coverage_counts"].values()) == report["events"]
    pairs = pd.read_parquet(offline / "pair_embeddings")
    user = int(pairs.user_id.iloc[0])
    mine = pairs[pairs.user_id == user]
    reader = FeatureReader(cfg, pairs.model_version.iloc[0], len(pairs.embedding.iloc[0]), misses=None)
    f = reader.read(user, mine.item_id.to_numpy(), end + HOUR)
    assert set(f.tier_names()) == {"pair"}
    reader.close()
    # What the run page shows without a log: each output's asset event carries its step's numbers (those the step
    # published offline), and the tasks name the deployment's owner.
    extras = _asset_extras(run.run_id)
    sel = off.read_stats(offline, "selection", end)
    assert extras["solaris_selection"]["pairs_selected"] == sel["pairs_selected"] > 0
    assert extras["solaris_selection"]["pairs_considered"] == sel["pairs_considered"]
    assert extras["solaris_pair_embeddings"]["pairs"] == off.read_stats(offline, "pair_embeddings", end)["pairs"]
    assert extras["solaris_pair_embeddings"]["model_pairs_per_s"] > 0
    rep = extras["solaris_reports"]
    assert rep["events"] == report["events"] and rep["requests"] == report["requests"]
    assert [rep[f"coverage_{t}"] for t in report["coverage"]] == [None if v is None else round(v, 4)
                                                                  for v in report["coverage"].values()]
    written = extras["solaris_online_store"]
    assert written["interval_end"] == end.isoformat() and written["pair_embeddings_written"] > 0
    assert extras["solaris_user_aggregates"]["users"] == off.read_stats(offline, "user_aggregates", end)["users"]
    nb = off.read_stats(offline, "neighbours", end)
    assert extras["solaris_neighbours"]["users_with_history"] == nb["users_with_history"] > 0
    assert extras["solaris_neighbours"]["knn_index"] == nb["knn"]["index"]
    assert {t.owner for t in dag.tasks} == {"solaris"}
    return dag


def _asset_extras(run_id: str) -> dict:
    """{asset name: extra} of the asset events a DAG run emitted (from Airflow's metadata DB)."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select
    with create_session() as session:
        events = session.scalars(select(AssetEvent).where(AssetEvent.source_run_id == run_id)).all()
        return {e.asset.name: dict(e.extra) for e in events}


def test_refresh_dag_through_spark_submit_redis_equals_in_process(airflow_env, spark, tmp_path, monkeypatch):
    """dag.test() end to end into Redis with SOLARIS_SPARK_CONN_ID set: the four Spark steps are
    SparkSubmitOperators, submitted to a real Spark standalone master and worker on loopback (the connection names
    the master), and get the worker's settings whole (--settings); their work runs on the cluster's executors.
    With non-default settings their outputs equal an in-process run of the same settings, row for row (when only
    the paths travelled, the jobs ran on the argparse defaults: a 30-day lookback, 24 active hours, L = 50)."""
    from tests.support import SparkStandalone
    from solaris_jobs.core import offline as off
    from solaris_jobs.pipeline import jobs
    offline = tmp_path / "offline"
    precompute = json.loads(dag_precompute_json()) | {"select_share": 0.3, "exclusion_runs": 2, "knn_k": 5,
                                                   "lookback_days": 21}
    server = RedisServer(tmp_path / "redis").start()
    try:
        with SparkStandalone(tmp_path / "cluster") as cluster:
            conn = {"conn_type": "spark", "host": "spark://127.0.0.1", "port": cluster.port}
            for k, v in {"SOLARIS_OFFLINE": str(offline), "SOLARIS_PRECOMPUTE": json.dumps(precompute),
                         "SOLARIS_SPARK_CONN_ID": "solaris_test_spark",
                         "AIRFLOW_CONN_SOLARIS_TEST_SPARK": json.dumps(conn),
                         "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}.items():
                monkeypatch.setenv(k, v)                                               # (spark-submit on PATH)
            yaml_path = _redis_yaml(tmp_path, server)
            monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(yaml_path))
            dag = _run_dag_test(offline, yaml_path)
            worker_log = (tmp_path / "cluster" / "worker.log").read_text()
    finally:
        server.stop()
    # Each of the four steps was its own application on the cluster, its work on the cluster's executor.
    assert worker_log.count("Asked to launch executor") >= 4, worker_log[-3000:]
    assert {t: type(dag.get_task(t)).__name__ for t in ("select", "embed", "aggregate", "neighbours")} == \
        dict.fromkeys(("select", "embed", "aggregate", "neighbours"), "SparkSubmitOperator")
    assert off.read_stats(offline, "selection", ML_END)["select_share"] == 0.3
    s = Settings.from_env(offline=str(tmp_path / "in_process"))
    assert s.precompute.select_share == 0.3 and s.precompute.history_len == 10 and s.precompute.lookback_days == 21
    jobs.run(spark, s, ML_END - HOUR, ML_END)
    counts = assert_same_outputs(offline, s.offline, ML_END, rtol=1e-5, atol=1e-6)
    assert counts["pair_embeddings"] > 0 and counts["neighbours"] > 0


def test_refresh_dag_test_sqlite_then_backfill_two_intervals_twice_identical(airflow_env, spark, tmp_path,
                                                                              monkeypatch):
    """dag.test() end to end into the SQLite online store for the first of 2 intervals; then `solaris backfill`
    over the 2 skips the one dag.test() completed and runs the other. Each interval is then run a second time, with
    identical online-store contents: the second with --force, the first because one of its outputs went missing."""
    from click.testing import CliRunner

    from solaris_jobs.flows import refresh_steps as o
    from solaris_jobs.flows.cli import main
    offline = tmp_path / "offline"
    monkeypatch.setenv("SOLARIS_OFFLINE", str(offline))
    yaml_path = _sqlite_yaml(tmp_path)
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(yaml_path))
    start = ML_END - 2 * HOUR
    _run_dag_test(offline, yaml_path, start + HOUR)
    s = Settings.from_env()
    first = o.backfill(s, start, ML_END)
    assert [r["status"] for r in first] == ["skipped", "done"]
    assert [r["interval_end"] for r in first] == [(start + k * HOUR).isoformat() for k in (1, 2)]
    before = _dump_sqlite(tmp_path / "online.db")
    assert before and all(rows for rows in before.values())
    again = o.backfill(s, start + HOUR, ML_END, force=True)          # --force runs a complete interval again
    assert [r["status"] for r in again] == ["done"]
    assert _dump_sqlite(tmp_path / "online.db") == before
    # Without --force every interval is complete and skipped; a missing output makes its interval run again.
    res = CliRunner().invoke(main, ["backfill", "--start", start.isoformat(), "--end", ML_END.isoformat()])
    assert res.exit_code == 0, res.output
    assert [r["status"] for r in json.loads(res.stdout)] == ["skipped"] * 2
    import shutil
    from solaris_jobs.core import offline as off
    shutil.rmtree(off.interval_uri(offline, "neighbours", start + HOUR))
    out = o.backfill(s, start, ML_END)
    assert [r["status"] for r in out] == ["done", "skipped"]
    assert _dump_sqlite(tmp_path / "online.db") == before


SCREENSHOTS = ROOT / "artifacts" / "screenshots"     # the browser test's artefacts (git-ignored)


def test_two_runs_of_one_interval_started_at_once_one_refused_the_other_complete(airflow_env, spark, tmp_path,
                                                                                  monkeypatch):
    """Two `solaris backfill`s of the same interval started together (as a backfill beside the scheduled run): the
    interval's lease lets one run its steps; the other is refused at its first step, naming the holder, and writes
    nothing; the interval ends complete, and its lease is released for the next run. Then a backfill killed
    mid-way and rerun ends as that uninterrupted run did."""
    import threading

    from solaris_jobs.flows import refresh_steps as o
    from solaris_jobs.online import lease
    monkeypatch.setenv("SOLARIS_OFFLINE", str(tmp_path / "offline"))
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(_sqlite_yaml(tmp_path)))
    s = Settings.from_env()
    start = ML_END - HOUR
    gate, results = threading.Barrier(2), {}

    def run(name):
        gate.wait()
        try:
            results[name] = o.backfill(s, start, ML_END)
        except Exception as e:                                         # noqa: BLE001 (the test inspects it)
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    refused = [r for r in results.values() if isinstance(r, lease.LeaseHeld)]
    done = [r for r in results.values() if isinstance(r, list)]
    assert len(refused) == 1 and len(done) == 1, results
    assert refused[0].holder.startswith("backfill-") and done[0][0]["status"] == "done"
    assert o.interval_complete(s, ML_END) and lease.holder(o.store(s), ML_END) is None
    # Only the winner's outputs were published: one run folder per dataset, the winner's selection stats.
    from solaris_jobs.core import offline as off
    assert off.read_stats(s.offline, "selection", ML_END)["pairs_selected"] == \
        done[0][0]["steps"]["select"]["pairs_selected"]

    # A third `solaris backfill` of the interval into a fresh store, SIGKILLed once the interval's selection is
    # published (FM inference running): the rerun is refused while the dead run's lease stands (the error names
    # it and `solaris lease release`); once released, the rerun completes the interval with the same offline
    # outputs (row for row) and the same online store (digest) as the uninterrupted run above.
    import signal
    import time

    from tests.support import assert_same_outputs
    run = tmp_path / "killed"
    run.mkdir()
    env = {**os.environ, "SOLARIS_OFFLINE": str(run / "offline"), "FEAST_FS_YAML_FILE_PATH": str(_sqlite_yaml(run)),
           "PYTHONPATH": str(ROOT)}
    with open(run / "backfill.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "solaris_jobs.flows.cli", "backfill", "--start",
                                 start.isoformat(), "--end", ML_END.isoformat()], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not off.is_complete(str(run / "offline"), "selection", ML_END):
            assert proc.poll() is None and time.monotonic() < deadline, (run / "backfill.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert not off.is_complete(str(run / "offline"), "neighbours", ML_END)          # killed mid-way
    monkeypatch.setenv("SOLARIS_OFFLINE", str(run / "offline"))
    monkeypatch.setenv("FEAST_FS_YAML_FILE_PATH", str(run / "fs.yaml"))
    killed = Settings.from_env()
    assert not o.interval_complete(killed, ML_END)
    with pytest.raises(lease.LeaseHeld, match=r"backfill-\w+.*solaris lease release") as held:
        o.backfill(killed, start, ML_END)
    assert lease.release(o.store(killed), ML_END, held.value.holder)
    assert o.backfill(killed, start, ML_END)[0]["status"] == "done" and o.interval_complete(killed, ML_END)
    assert_same_outputs(s.offline, killed.offline, ML_END)
    assert _online_digest(run / "online.db") == _online_digest(tmp_path / "online.db")


def _online_digest(db: Path) -> str:
    """A digest of every feature row a SQLite online store holds (key, feature, value, event time; not the write
    time), and of the intervals recorded as materialized (without their timings)."""
    import hashlib
    conn = sqlite3.connect(str(db))
    h = hashlib.sha256()
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name LIKE 'solaris_%' "
                                 "AND name NOT LIKE 'solaris_materialized' AND name NOT LIKE 'solaris_leases' "
                                 "ORDER BY name"):
        h.update(table.encode())
        for row in conn.execute(f'SELECT entity_key, feature_name, value, event_ts FROM "{table}" ORDER BY 1, 2'):
            h.update(repr(row).encode())
    h.update(repr(sorted(k for k, in conn.execute("SELECT interval_end FROM solaris_materialized"))).encode())
    conn.close()
    return h.hexdigest()


def test_train_dag_publishes_a_version_and_reembeds(airflow_env, spark, tmp_path, monkeypatch):
    """dag.test() of solaris_train on MovieLens with tiny models: a new version folder, `current` switched
    atomically, the latest interval re-embedded and re-materialized with the new version only."""
    from solaris_jobs.flows import refresh_steps as o
    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialized_intervals
    from solaris_jobs.online.reader import FeatureReader
    reg = tmp_path / "registry"
    (reg / "versions").mkdir(parents=True)
    (reg / "current").symlink_to(Path(airflow_env["SOLARIS_MODELS"]), target_is_directory=True)
    offline = tmp_path / "offline"
    yaml_path = _sqlite_yaml(tmp_path)
    for k, v in {"SOLARIS_MODEL_REGISTRY": str(reg), "SOLARIS_MODELS": str(reg / "current"),
                 "SOLARIS_OFFLINE": str(offline), "FEAST_FS_YAML_FILE_PATH": str(yaml_path),
                 "SOLARIS_TRAIN": json.dumps({"epochs": 1, "history_len": 10, "d_model": 16, "layers": 1,
                                              "d_interaction": 32, "d_code": 8, "max_train_rows": 20_000,
                                              "seed": 1,     # seed 0 would reproduce the same weights
                                              # the ranker's VM trains on a replay of the log's last 3 days
                                              "served_hours": 72, "served_every": "24h",
                                              "fm_lr": 3e-3, "fm_weight_decay": 1e-3, "fm_dropout": 0.2,
                                              "fm_target_user": True, "verifier_epochs": 2}),
                 "SOLARIS_TRAIN_CRON": "none"}.items():
        monkeypatch.setenv(k, v)
    s = Settings.from_env()
    o.backfill(s, ML_END - HOUR, ML_END)                      # one interval with the old models
    old = pd.read_parquet(offline / "pair_embeddings").model_version.unique().tolist()
    run = _load_dag(DAGS / "solaris_train.py").test()
    assert run.state == "success", {ti.task_id: ti.state for ti in run.get_task_instances()}
    from solaris_jobs.pipeline.model_refs import models_folder
    assert (reg / "current").is_file() and not (reg / "current").is_symlink()       # a pointer file, not a link
    current = Path(models_folder(reg / "current"))
    assert current.parent == (reg / "versions").resolve()
    assert {p.name for p in current.iterdir()} >= {"fm.pt", "ae.pt", "vm.pt", "vm_transfer.pt"}
    # The ranker's VM was trained on what the replay's reader served with the new models (not on codes computed
    # for every row): its checkpoint says so, with the share of its training rows per tier.
    _, fm_meta = load_checkpoint(current / "fm.pt", kind="fm")        # the FM's recipe from SOLARIS_TRAIN
    assert (fm_meta["config"]["dropout"], fm_meta["config"]["target_user"]) == (0.2, True)
    assert (fm_meta["extra"]["train"]["lr"], fm_meta["extra"]["train"]["weight_decay"]) == (3e-3, 1e-3)
    _, vm_meta = load_checkpoint(current / "vm.pt", kind="vm")          # the verifier's epochs and patience
    assert (vm_meta["extra"]["train"]["epochs"], vm_meta["extra"]["train"]["patience"]) == (2, 2)
    _, meta = load_checkpoint(current / "vm_transfer.pt", kind="vm")
    assert meta["config"]["fm_age"] and meta["extra"]["trained_on"] == "served features"
    served = pd.read_parquet(current / "served" / "served.parquet")
    assert len(served) and (served.tier < TIERS.index("none")).any() and 0 < meta["extra"]["tier_shares"]["none"] < 1
    new = pd.read_parquet(offline / "pair_embeddings").model_version.unique().tolist()
    assert len(old) == len(new) == 1 and old != new
    assert pd.read_parquet(offline / "user_aggregates").model_version.unique().tolist() == new
    # The run's asset events say what was published: the version, its embedding version, each model's metrics.
    extras = _asset_extras(run.run_id)
    published = extras["solaris_models"]
    assert published["version"] == current.name and published["embedding_version"] == new[0]
    assert 0 < published["fm_test_bce"] < 1 and published["vm_transfer_model_version"] == meta["model_version"]
    assert 0 < published["vm_transfer_train_share_none"] < 1
    assert extras["solaris_online_store"]["model_version"] == new[0]
    assert extras["solaris_online_store"]["pair_embeddings_written"] > 0
    pairs = pd.read_parquet(offline / "pair_embeddings")
    user = int(pairs.user_id.iloc[0])
    items = pairs[pairs.user_id == user].item_id.to_numpy()
    cfg = store_config.load(ROOT / "feature_repo", yaml_path)
    assert materialized_intervals(cfg)[ML_END]["interval_start"] == (ML_END - HOUR).isoformat()
    for version, tier in ((new[0], "pair"), (old[0], "none")):
        reader = FeatureReader(cfg, version, len(pairs.embedding.iloc[0]), misses=None)
        assert set(reader.read(user, items, ML_END + HOUR).tier_names()) == {tier}, version
        reader.close()

    # A new version whose checkpoint is corrupt (truncated by a crashed upload) or missing is never published:
    # the publish task fails naming the file, `current` keeps the good version, and the refresh goes on with it.
    import shutil

    from models.checkpoint import CheckpointError
    from solaris_jobs.flows.training_steps import publish
    bad = reg / "versions" / "corrupt"
    shutil.copytree(current, bad, ignore=shutil.ignore_patterns("served"))
    (bad / "ae.pt").write_bytes((bad / "ae.pt").read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"corrupt/ae\.pt"):
        publish(str(bad))
    (bad / "ae.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"corrupt/ae\.pt: no checkpoint there"):
        publish(str(bad))
    assert Path(models_folder(reg / "current")) == current
    assert o.run_step(Settings.from_env(), "embed", ML_END - HOUR, ML_END)["model_version"] == new[0]


def test_reembed_finds_the_latest_intervals_start():
    from solaris_jobs.flows.training_steps import latest_start
    t = pd.Timestamp("2026-01-01T06:00", tz="UTC")
    assert latest_start({t: {"interval_start": "2026-01-01T02:00:00+00:00"}, t - HOUR: {}}) == t - 4 * HOUR
    assert latest_start({t: {}, t - 6 * HOUR: {}}) == t - 6 * HOUR        # recorded before starts were
    with pytest.raises(ValueError, match="no recorded start"):
        latest_start({t: {}})


def test_solaris_airflow_stopped_by_sigterm_leaves_no_process(tmp_path):
    """`solaris airflow` under a process supervisor or a container stop gets SIGTERM, not Ctrl-C: it stops its
    API server, scheduler, DAG processor and triggerer (each in its own session) and their workers too."""
    import signal
    import time

    from tests.support import processes_with_env
    home = (tmp_path / "airflow").resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SOLARIS_"))}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "solaris"), "airflow", "--home", str(home),
                             "--port", "0", "--no-spark-connect"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Airflow UI and API:" in line:
                break
        assert proc.poll() is None, "".join(lines[-20:])
        services = processes_with_env("AIRFLOW_HOME", str(home))
        assert len(services) >= 4, services                      # api-server, scheduler, dag-processor, triggerer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while processes_with_env("AIRFLOW_HOME", str(home)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_with_env("AIRFLOW_HOME", str(home)) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for _ in range(5):                                            # what a failed stop left, forks included
            for pid in processes_with_env("AIRFLOW_HOME", str(home)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ the live Airflow

@dataclass(frozen=True)
class LiveRefresh:
    """What the module's live Airflow ran: two intervals of solaris_refresh, both finished."""
    af: object             # the LocalAirflow, running
    home: Path             # its AIRFLOW_HOME
    offline: Path          # the offline store and the SQLite online store its tasks wrote
    yaml_path: Path
    triggered: str         # the run triggered through the REST API: the interval ending ML_END
    backfilled: str        # the run `airflow backfill create` made: the interval before it
    states: dict           # {run id: {task id: state}}


@pytest.fixture(scope="module")
def live_refresh(airflow_env, tmp_path_factory):
    """Airflow for real, started once for this module: API server, scheduler, DAG processor and triggerer as
    processes on free ports, and the Spark Connect server `solaris airflow` starts beside them. Its metadata DB is
    its own (the dag.test() runs of the other tests write this module's DB in-process; a scheduler beside them would
    contend for SQLite's lock). One run is triggered through the REST API, the interval before it is backfilled with
    Airflow's own `airflow backfill create`; both are finished when a test gets them, and the tests only read them,
    so none depends on another having run. The tests that use it are the module's last, so that it runs only while
    they do (a module's fixture stops at the module's end)."""
    from solaris_jobs.dev.airflow_local import LocalAirflow
    work = tmp_path_factory.mktemp("live_airflow")
    yaml_path = _sqlite_yaml(work)
    env = {"SOLARIS_OFFLINE": str(work / "offline"), "FEAST_FS_YAML_FILE_PATH": str(yaml_path),
           "SOLARIS_END_DATE": ML_END.isoformat(), "SOLARIS_SPARK_MASTER": "local[2]",
           "SOLARIS_SPARK_DRIVER_MEMORY": "1g", "SOLARIS_RETRIES": "0"}
    earlier = ML_END - 2 * HOUR                       # logical date = start of the interval [earlier, ML_END - 1h)
    with LocalAirflow(work / "airflow", env=env, parallelism=2, spark_connect=True) as af:
        af.wait_for_dag("solaris_refresh")
        triggered = af.trigger("solaris_refresh", (ML_END - HOUR).isoformat(), ML_END.isoformat())
        res = af.cli("backfill", "create", "--dag-id", "solaris_refresh", "--from-date", earlier.isoformat(),
                     "--to-date", earlier.isoformat())
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        backfill_runs = af.runs("solaris_refresh", run_type="backfill")
        assert [pd.Timestamp(r["data_interval_end"]) for r in backfill_runs] == [ML_END - HOUR]
        states = {}
        for rid in (triggered, backfill_runs[0]["dag_run_id"]):
            state = af.wait_for_run("solaris_refresh", rid, timeout=1200)
            states[rid] = af.task_states("solaris_refresh", rid)
            assert state == "success", (states, sorted((work / "airflow" / "logs").rglob("*.log"))[-3:])
        yield LiveRefresh(af, work / "airflow", work / "offline", yaml_path, triggered, backfill_runs[0]["dag_run_id"],
                          states)
    assert af.spark is not None and af.spark.proc is None                     # stopped with Airflow


def _asset_extras_live(af, run_id: str) -> dict:
    """{asset name: extra} of the asset events a run of the live Airflow emitted (its REST API)."""
    import urllib.parse
    q = urllib.parse.urlencode({"source_dag_id": "solaris_refresh", "source_run_id": run_id, "limit": 100})
    return {e["name"]: e["extra"] for e in af.api("GET", f"/api/v2/assets/events?{q}")["asset_events"]}


def test_real_airflow_rest_trigger_and_cli_backfill(live_refresh, spark, tmp_path):
    """The module's live Airflow (API server, scheduler, DAG processor and triggerer as real processes, and the
    Spark Connect server beside them) ran one run triggered and watched through the REST API and the interval before
    it backfilled with Airflow's own `airflow backfill create`; every task ran in its own process (LocalExecutor),
    and the Spark steps connected to the one long-lived Spark instead of starting a JVM. The backfilled interval's
    outputs through Spark Connect equal an in-process run of it, row for row."""
    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialized_intervals
    live, earlier = live_refresh, ML_END - 2 * HOUR
    connect = live.af.env()["SOLARIS_SPARK_MASTER"]
    assert connect == live.af.spark.shared_url and connect.startswith(live.af.spark.url + "/;session_id=")
    assert set(live.states) == {live.triggered, live.backfilled}
    for tasks in live.states.values():
        assert set(tasks.values()) == {"success"} and len(tasks) == 8
    logs = {p.parent.name.removeprefix("task_id="): p.read_text(errors="replace")
            for p in (live.home / "logs").rglob("*.log") if "task_id=" in str(p)}
    spark_tasks = {t for t, text in logs.items() if f"Spark Connect session at {connect}" in text}
    assert {"select", "embed", "aggregate", "neighbours"} <= spark_tasks, sorted(logs)
    cfg = store_config.load(ROOT / "feature_repo", live.yaml_path)
    done = materialized_intervals(cfg)
    assert {ML_END - HOUR, ML_END} <= set(done)
    assert done[ML_END - HOUR]["interval_start"] == earlier.isoformat()
    assert _dump_sqlite(live.yaml_path.parent / "online.db")["solaris_pair_embeddings"]
    # The backfilled interval is the earlier one: nothing it reads depends on the triggered run's outputs.
    from solaris_jobs.pipeline import jobs
    s = Settings.from_env(offline=str(tmp_path / "in_process"))
    jobs.run(spark, s, earlier, ML_END - HOUR)
    counts = assert_same_outputs(live.offline, s.offline, ML_END - HOUR, rtol=1e-5, atol=1e-6)
    assert counts["pair_embeddings"] > 0 and counts["neighbours"] > 0


def test_operator_screens_in_a_real_browser(live_refresh, tmp_path):
    """What an operator sees, rendered by headless Chromium (Debian's chromium + chromedriver, Selenium): the
    Airflow UI (the module's live Airflow, its API server on a free loopback port; the run it was triggered for)
    shows the refresh DAG's graph with all its tasks and its owner, the run with every task's state, and the
    asset events the tasks emitted with their step's numbers; `feast ui` over the project's repo (and Feast's CLI)
    lists the three feature views, each with its TTL (an override shows), owner and version policy; the evaluation
    report (report.html, rendered from the committed benchmarks/results/evaluation_synth.json) loads every plot.
    Screenshots under artifacts/screenshots/."""
    import shutil
    import urllib.parse

    from selenium.webdriver.common.action_chains import ActionChains

    from solaris_jobs.evaluation import report
    from tests.support import FeastUI, feast_repo, headless_chromium, wait_for_text
    af, run_id = live_refresh.af, live_refresh.triggered
    extras = _asset_extras_live(af, run_id)
    assert set(extras) >= {"solaris_selection", "solaris_pair_embeddings", "solaris_reports", "solaris_online_store"}
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    tasks = ["validate", "drain_misses", "select", "embed", "aggregate", "neighbours", "report", "materialize"]
    # Feast's own CLI first (`feast apply`, `feature-views list`, `registry-dump`): every entity, view and the
    # FeatureService carry a description and the deployment's owner; each view's tags give its tier, its TTL as
    # configured (an override shows) and the model-version policy.
    ttls = {"pair_embeddings": "90min", "pair_fallbacks": "24h", "user_aggregates": "24h", "user_states": "24h",
            "neighbours": "24h"}
    repo, feast_env, feast = feast_repo(tmp_path / "feast", {"SOLARIS_OWNER": "ml-platform@example.com",
                                                             "SOLARIS_TTL_PAIR_EMBEDDINGS": "90min"})
    listed, registry = feast("feature-views", "list").stdout, json.loads(feast("registry-dump").stdout)
    views = {v["spec"]["name"]: v["spec"] for v in registry["featureViews"]}
    assert set(views) == set(ttls)
    for name, tier in (("pair_embeddings", "pair"), ("pair_fallbacks", "item_aware"), ("user_aggregates", "user_aggregate"),
                       ("user_states", "user_state"), ("neighbours", "neighbour")):
        spec = views[name]
        assert name in listed and spec["owner"] == "ml-platform@example.com" and f"TTL {ttls[name]}" in spec[
            "description"]
        assert spec["tags"]["tier"] == tier and spec["tags"]["ttl"] == ttls[name], spec["tags"]
        assert "pinned version" in spec["tags"]["model_version_policy"]
    [service] = [f["spec"] for f in registry["featureServices"]]
    assert service["name"] == "solaris_v3" and service["owner"] == "ml-platform@example.com"
    assert "pair_embeddings 90min" in service["tags"]["ttls"] and service["description"]
    entities = {e["spec"]["name"]: e["spec"] for e in registry["entities"]}
    assert all(entities[e]["owner"] == "ml-platform@example.com" and entities[e]["description"]
               for e in ("user", "item"))
    rep = report.write(json.loads((ROOT / "benchmarks" / "results" / "evaluation_synth.json").read_text()),
                       tmp_path / "report").with_suffix(".html")
    with FeastUI(repo, feast_env) as ui:
        # validate writes no asset: its numbers are its XCom `summary` (the REST API, as the UI's XCom tab reads it).
        summary = af.api("GET", f"/api/v2/dags/solaris_refresh/dagRuns/{urllib.parse.quote(run_id, safe='')}"
                                f"/taskInstances/validate/xcomEntries/summary")["value"]
        summary = json.loads(summary) if isinstance(summary, str) else summary
        assert summary["step"] == "validate" and summary["events"] >= 0 and "users" in summary, summary
        browser = headless_chromium()
        try:
            shot = lambda name: browser.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
            browser.get(af.url + "/")
            browser.add_cookie({"name": "_token", "value": af.token(), "path": "/"})     # logged in as admin
            # The DAG: its owner, and its graph with every task.
            browser.get(f"{af.url}/dags/solaris_refresh")
            wait_for_text(browser, ["Owner", "solaris", "Created Asset Events"])
            browser.find_element("css selector", "button[aria-label^='Show Graph']").click()
            wait_for_text(browser, tasks)
            nodes = {e.text.split("\n")[0] for e in browser.find_elements("css selector", ".react-flow__node")}
            assert set(tasks) <= nodes, nodes
            shot("airflow_graph")
            # The run: every task succeeded.
            browser.get(f"{af.url}/dags/solaris_refresh/runs/{run_id}")
            text = wait_for_text(browser, ["8 Task Instances", "Success", *tasks])
            assert "Failed" not in text
            shot("airflow_run")
            # Each step's asset event, its extra unfolded: the numbers the step published.
            for task, asset, keys in (("select", "solaris_selection", ("pairs_considered", "pairs_selected")),
                                      ("embed", "solaris_pair_embeddings", ("pairs", "model_pairs_per_s")),
                                      ("report", "solaris_reports", ("requests", "coverage_none")),
                                      ("materialize", "solaris_online_store", ("pair_embeddings_written",))):
                browser.get(f"{af.url}/dags/solaris_refresh/runs/{run_id}/tasks/{task}/asset_events")
                wait_for_text(browser, ["1 Asset Event", asset])
                js = lambda v: json.dumps(int(v) if isinstance(v, float) and v.is_integer() else v)   # JSON.stringify
                shown = wait_for_text(browser, [f'"{k}": {js(extras[asset][k])}' for k in keys],
                                      until=lambda: [ActionChains(browser).move_to_element(f).click().perform()
                                                     for f in browser.find_elements(
                                                         "css selector", ".codicon-folding-collapsed")])
                assert f'"step": "{task}"' in shown
                if task == "select":
                    shot("airflow_asset_event")
            # Feast: the three views, each with its TTL tag and owner.
            browser.get(f"{ui.url}/p/solaris/feature-view")
            wait_for_text(browser, ["Feature Views", "pair_embeddings", "user_aggregates", "neighbours"])
            shot("feast_views")
            for view, ttl in ttls.items():
                browser.get(f"{ui.url}/p/solaris/feature-view/{view}")
                text = wait_for_text(browser, ["model_version_policy", "ml-platform@example.com", f"TTL {ttl}"])
                assert f"\nttl\n{ttl}\n" in text, text
                if view == "pair_embeddings":
                    shot("feast_pair_embeddings")
            # The report: one page, every plot decoded and drawn.
            browser.get(rep.as_uri())
            wait_for_text(browser, ["Targets", "VM + SOLARIS, all tiers"])
            sizes = browser.execute_script(
                "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
            assert len(sizes) >= 4 and all(c and w > 100 and h > 100 for c, w, h in sizes), sizes
            browser.execute_script("document.images[0].scrollIntoView()")
            shot("report")
        finally:
            browser.quit()
    assert all((SCREENSHOTS / f"{n}.png").stat().st_size > 10_000 for n in (
        "airflow_graph", "airflow_run", "airflow_asset_event", "feast_views", "feast_pair_embeddings", "report"))
