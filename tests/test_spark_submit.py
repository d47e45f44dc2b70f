"""The refresh jobs outside the test's own Spark session: under spark-submit against a Spark standalone master and
worker started on loopback, and through a Spark Connect server."""
import json
import subprocess
import sys
from dataclasses import replace

from tests.support import ML_END, ML_START, assert_same_outputs, SparkConnectServer, SparkStandalone


def test_refresh_under_spark_submit_matches_in_process(ml_run, tmp_path):
    """spark_jobs/refresh.py with the README's individual flags (not --settings), on a real cluster's executor:
    the same rows as the in-process run of the same settings. The driver's environment names another master for
    in-process steps: under spark-submit, spark-submit's master is used all the same."""
    from solaris_jobs.core.settings import env_var
    s, stats = ml_run
    offline = tmp_path / "offline"
    with SparkStandalone(tmp_path / "cluster") as cluster:
        res = cluster.submit("spark_jobs/refresh.py", [
            "--data", s.data, "--offline", str(offline), "--models", s.models,
            "--start", ML_START.isoformat(), "--end", ML_END.isoformat(), "--lookback-days", "30",
            "--active-hours", str(24 * 14), "--history-len", "10", "--batch-size", "256", "--candidates", "60",
            "--stats-out", str(tmp_path / "stats.json")], env={env_var("spark_master"): "local[1]"})
        worker_log = (tmp_path / "cluster" / "worker.log").read_text()
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Asked to launch executor" in worker_log          # the work ran on the cluster's executor
    printed = json.loads((tmp_path / "stats.json").read_text())
    assert printed["embed"]["pairs"] == stats["embed"]["pairs"]
    counts = assert_same_outputs(s.offline, offline, ML_END, rtol=1e-5, atol=1e-6)
    assert counts["pair_embeddings"] == stats["embed"]["pairs"] > 0


def test_refresh_through_spark_connect_matches_in_process(ml_run, tmp_path):
    """`solaris refresh --master sc://...`: the same settings (--settings) and the same rows as in-process, through a
    Spark Connect server; the jobs and the offline layout need no JVM on the client's side (no spark._jvm)."""
    s, stats = ml_run
    offline = tmp_path / "offline"
    with SparkConnectServer(tmp_path / "connect") as server:
        res = subprocess.run([sys.executable, "-m", "solaris_jobs.flows.cli", "refresh",
                              "--settings", replace(s, offline=str(offline)).to_json(), "--master", server.url,
                              "--start", ML_START.isoformat(), "--end", ML_END.isoformat()],
                             capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout)
    assert out["embed"]["pairs"] == stats["embed"]["pairs"]
    assert f"Spark Connect session at {server.url}" in res.stderr
    counts = assert_same_outputs(s.offline, offline, ML_END, rtol=1e-5, atol=1e-6)
    assert counts["pair_embeddings"] > 0 and counts["neighbours"] > 0


CLIENT = """
import os, sys
from solaris_jobs.pipeline.spark import spark_session
spark = spark_session("client", sys.argv[1])

def pids(frames):
    import pandas as pd
    for pdf in frames:
        yield pd.DataFrame({"pid": [os.getpid()] * len(pdf)})

print(sorted({r.pid for r in spark.range(64, numPartitions=2).mapInPandas(pids, "pid long").collect()}))
"""


def test_clients_of_the_shared_spark_connect_session_reuse_its_python_workers(tmp_path):
    """What `solaris airflow` gives its tasks: three client processes in a row on the server's shared session run
    their Python UDFs in the same Python workers (so the executors' model cache outlives a task), and the server's
    Python processes do not grow; each client on a session of its own gets new workers and leaves them behind."""
    import psutil

    def run(url):
        res = subprocess.run([sys.executable, "-c", CLIENT, url], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    def pythons(server):
        return sum("python" in p.name() for p in psutil.Process(server.proc.pid).children(recursive=True))

    with SparkConnectServer(tmp_path / "connect") as server:
        shared = [run(server.shared_url) for _ in range(3)]
        after_shared = pythons(server)
        own = [run(server.url) for _ in range(2)]
        after_own = pythons(server)
    assert shared[0] == shared[1] == shared[2] and len(shared[0]) >= 1
    assert not set(own[0]) & set(own[1]) and not set(own[0]) & set(shared[0])
    assert after_own > after_shared > 0
