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
            "--start", ML_START.isoformat(), "--end", ML_END.isoformat(), "--lookback-days", "0",
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
