"""The production topology on loopback (#42): what breaks when the refresh leaves one host.

Airflow's API server and scheduler with CeleryExecutor on a Postgres metadata DB and a Redis broker, two Celery
workers as two hosts (one serving the FM queue and pool); a Spark standalone master and a worker that cannot see
the driver's files (its own mount namespace with empty tmpfs over the project, its venv, the tiny models and the
Airflow side's artifacts), reached through a Spark Connect server; the models on an S3-API server (a registry
pointer file and a version folder); the online store on a 3-primary Redis Cluster.

Where the data lives: the event log and the offline store, which the Spark steps read and write (and the steps
outside Spark read too), are on a folder every host sees, as an NFS or HDFS mount would be (Spark on ``s3a://``
needs the Hadoop AWS jars, docs/deployment.md), so the isolated worker reaches them without those; the models (a
registry pointer file and a version folder) are on the S3-API server, read there by the tasks and by the Spark
executors, through pyarrow.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pandas as pd

from solaris_jobs.core.settings import Settings
from tests.support import (ML_END, RedisClusterServer, S3Server, SparkStandalone, assert_same_outputs,
                           dag_precompute_json, enter_together, feast_yaml, project_zip)

ROOT = Path(__file__).resolve().parent.parent
HOUR = pd.Timedelta(hours=1)
FM_QUEUE = "solaris_fm"
# The first interval rebuilds its state from the lookback's hourly files: a week of them (the other DAG tests read
# 30 days) keeps this test's three intervals within its time.
PRECOMPUTE = dag_precompute_json(lookback_days=7)


def _upload_models(models: Path, s3) -> str:
    """The tiny models as a registry on the bucket: ``versions/v1/`` and a ``current`` pointer file naming it."""
    import pyarrow.fs as pafs

    from solaris_jobs.core import uris
    s3.bucket("solaris")
    bucket = uris.filesystem("s3a://solaris")[0]
    pafs.copy_files(str(models), "solaris/registry/versions/v1", pafs.LocalFileSystem(), bucket)
    with bucket.open_output_stream("solaris/registry/current") as f:
        f.write(b"versions/v1\n")
    return "s3a://solaris/registry/current"


def _wait_running(af, run_id: str, task: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ti = af.task_instances("solaris_refresh", run_id).get(task)
        if ti and ti["state"] == "running":
            return ti
        time.sleep(1)
    raise TimeoutError(f"{task} of {run_id} did not start running within {timeout:.0f}s")


PROBE = """
import json, os, sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
def probe(frames, hidden=json.loads(sys.argv[2])):
    import pandas as pd, solaris_jobs
    for _ in frames:
        yield pd.DataFrame({"v": [json.dumps({"python": sys.executable, "solaris": solaris_jobs.__file__,
                                              "hidden": [sorted(os.listdir(h)) for h in hidden]})]})
print(spark.range(1).mapInPandas(probe, "v string").collect()[0].v)
"""


def _executor_view(connect_url: str, hidden: list[Path]) -> dict:
    """What a Spark executor of the topology sees: its Python, where SOLARIS comes from, and what is in the driver's
    folders (a Spark Connect client is a process of its own: Connect mode holds for a whole process)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", PROBE, connect_url, json.dumps([str(h) for h in hidden])],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_production_topology_on_loopback(movielens_root, ml_models, spark, tmp_path, monkeypatch):
    """A scheduled refresh, then a two-interval backfill (`airflow backfill create`), through the whole topology:
    every run succeeds; the FM task ran on the FM queue's worker, in its pool, the others on the default queue; a
    Celery worker killed (SIGKILL of its whole process tree) while it ran the backfill's first Spark step is retried
    on a replacement worker; the three intervals' offline outputs equal an in-process run of the same settings row
    for row, and all three are materialized on the cluster; the Spark executors ran the worker's own Python and
    SOLARIS from its own path, and saw the driver's project, models and Airflow files empty."""
    from solaris_jobs.dev.airflow_local import LocalAirflow
    from solaris_jobs.dev.postgres_local import LocalPostgres
    from solaris_jobs.online import store_config
    from solaris_jobs.online.local_redis import LocalRedis
    from solaris_jobs.online.materialize import materialized_intervals
    from solaris_jobs.pipeline import jobs
    first, last = ML_END - 3 * HOUR, ML_END
    shared, driver = tmp_path / "shared", tmp_path / "driver"       # what every host sees; the Airflow side's own
    shared.mkdir()
    driver.mkdir()
    site = shared / "worker-site"                                     # SOLARIS as the Spark hosts have it installed
    site.mkdir()
    # The same settings in process, on the models' own files, interval by interval in the order Airflow runs them:
    # in a thread beside the topology (they share nothing; it fills the topology's waits).
    ends = (first + HOUR, first + 2 * HOUR, last)
    s = Settings.from_env(data=str(movielens_root), offline=str(tmp_path / "in_process"), models=str(ml_models),
                          precompute=json.loads(PRECOMPUTE), expire_from="write")
    s3 = S3Server(tmp_path / "s3")
    with ThreadPoolExecutor(1) as in_process, ExitStack() as stack:
        ref = in_process.submit(lambda: [jobs.run(spark, s, end - HOUR, end) for end in ends])
        # Every server at once (each waits mostly on its own start-up).
        pg, broker, cluster, spk = enter_together(
            stack, s3, LocalPostgres(driver / "postgres"), LocalRedis(driver / "broker"),
            RedisClusterServer(driver / "cluster"),
            SparkStandalone(tmp_path / "spark", cores=2, memory="2g", hide=(ROOT, driver, ml_models),
                            worker_env={**s3.env, "PYTHONPATH": str(project_zip(site / "solaris.zip"))}))[1:]
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        models = _upload_models(ml_models, s3)
        yaml_path = feast_yaml(driver / "fs.yaml", f"  type: redis\n  redis_type: redis_cluster\n"
                                                    f'  connection_string: "{cluster.url}"')
        env = {**s3.env, "SOLARIS_DATA": str(movielens_root), "SOLARIS_OFFLINE": str(shared / "offline"),
               "SOLARIS_MODELS": models, "SOLARIS_EXPIRE_FROM": "write",
               "SOLARIS_PRECOMPUTE": PRECOMPUTE, "FEAST_FS_YAML_FILE_PATH": str(yaml_path),
               "SOLARIS_FEATURE_REPO": str(ROOT / "feature_repo"),
               "SOLARIS_SPARK_MASTER": spk.url, "SOLARIS_SPARK_DRIVER_MEMORY": "1g",
               # Airflow's end_date bounds the intervals' starts: exactly one scheduled interval, the first.
               "SOLARIS_START_DATE": first.isoformat(), "SOLARIS_END_DATE": first.isoformat(),
               "SOLARIS_CATCHUP": "true", "SOLARIS_RETRIES": "1", "SOLARIS_RETRY_MINUTES": "0.05",
               "SOLARIS_FM_QUEUE": FM_QUEUE, "SOLARIS_FM_POOL": FM_QUEUE,
               # a task whose worker died is failed (then retried) after this many seconds without a heartbeat
               # (a live task's heartbeat comes every 5 s: [workers] min_heartbeat_interval)
               "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "15",
               "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2"}
        af = LocalAirflow(driver / "airflow", env=env, parallelism=4, executor="celery", metadata_db=pg.url,
                          broker_url=f"redis://{broker.url}/0", fm_pool_slots=1, spark_connect=True,
                          spark_python=spk.worker_python,
                          spark_conf={"spark.executor.memory": "1g", "spark.sql.shuffle.partitions": "4",
                                      "spark.default.parallelism": "2"},
                          services=("api-server", "scheduler", "dag-processor"))
        with af:
            af.start_worker("default", concurrency=2, wait=False)
            af.start_worker("fm", queues=(FM_QUEUE,), concurrency=1, wait=False)
            for name in ("default", "fm"):
                af.wait_worker(name)
            af.wait_for_dag("solaris_refresh")
            af.api("PATCH", "/api/v2/dags/solaris_refresh", {"is_paused": False})
            deadline = time.monotonic() + 300
            while not af.runs("solaris_refresh", run_type="scheduled") and time.monotonic() < deadline:
                time.sleep(2)
            scheduled = af.runs("solaris_refresh", run_type="scheduled")
            assert [pd.Timestamp(r["data_interval_end"]) for r in scheduled] == [first + HOUR]
            assert af.wait_for_run("solaris_refresh", scheduled[0]["dag_run_id"], 900) == "success", \
                af.task_instances("solaris_refresh", scheduled[0]["dag_run_id"])
            af.cli_checked("backfill", "create", "--dag-id", "solaris_refresh", "--from-date",
                           (first + HOUR).isoformat(), "--to-date", (first + 2 * HOUR).isoformat(),
                           "--max-active-runs", "1")
            backfill = sorted(af.runs("solaris_refresh", run_type="backfill"),
                              key=lambda r: r["data_interval_end"])
            assert [pd.Timestamp(r["data_interval_end"]) for r in backfill] == [first + 2 * HOUR, last]
            # The backfill's first Spark step dies with its worker (a host lost mid-task).
            victim = _wait_running(af, backfill[0]["dag_run_id"], "select")
            assert victim["hostname"] == "default"
            af.kill_worker("default")
            af.start_worker("default-2", concurrency=2)
            for r in backfill:
                assert af.wait_for_run("solaris_refresh", r["dag_run_id"], 900) == "success", \
                    af.task_instances("solaris_refresh", r["dag_run_id"])
            runs = [scheduled[0], *backfill]
            tis = {r["dag_run_id"]: af.task_instances("solaris_refresh", r["dag_run_id"]) for r in runs}
            seen = _executor_view(af.spark.url, [ROOT, driver, ml_models])
        # The executors ran the worker's own Python and SOLARIS from its own path, and saw none of the driver's files.
        assert seen["python"] == spk.worker_python and seen["solaris"].startswith(str(site / "solaris.zip")), seen
        assert seen["hidden"] == [[], [], []], seen
        cfg = store_config.load(ROOT / "feature_repo", yaml_path)
        assert set(ends) <= set(materialized_intervals(cfg))
    for run_id, by_task in tis.items():
        assert {t: ti["state"] for t, ti in by_task.items()} == dict.fromkeys(by_task, "success") and \
            len(by_task) == 8, run_id
        embed = by_task["embed"]
        assert (embed["queue"], embed["pool"], embed["hostname"]) == (FM_QUEUE, FM_QUEUE, "fm"), embed
        others = {t: (ti["queue"], ti["hostname"]) for t, ti in by_task.items() if t != "embed"}
        assert {q for q, _ in others.values()} == {"default"} and "fm" not in {h for _, h in others.values()}
    retried = tis[backfill[0]["dag_run_id"]]["select"]
    assert retried["try_number"] == 2 and retried["hostname"] == "default-2", retried
    ref.result()                  # the in-process run raised here if it failed
    for end in ends:
        counts = assert_same_outputs(shared / "offline", s.offline, end, rtol=1e-5, atol=1e-6)
        assert counts["pair_embeddings"] > 0 and counts["neighbours"] > 0, end
