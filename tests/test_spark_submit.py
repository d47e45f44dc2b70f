"""The refresh jobs under spark-submit against a Spark standalone master and worker started on loopback."""
import json

from tests.conftest import ML_END, ML_START
from tests.outputs import assert_same_outputs
from tests.servers import SparkStandalone


def test_refresh_under_spark_submit_matches_in_process(ml_run, tmp_path):
    """spark_jobs/refresh.py with the README's individual flags (not --settings), on a real cluster's executor:
    the same rows as the in-process run of the same settings."""
    s, stats = ml_run
    offline = tmp_path / "offline"
    with SparkStandalone(tmp_path / "cluster") as cluster:
        res = cluster.submit("spark_jobs/refresh.py", [
            "--data", s.data, "--offline", str(offline), "--models", s.models,
            "--start", ML_START.isoformat(), "--end", ML_END.isoformat(), "--lookback-days", "0",
            "--active-hours", str(24 * 14), "--history-len", "10", "--batch-size", "256", "--candidates", "60",
            "--stats-out", str(tmp_path / "stats.json")])
        worker_log = (tmp_path / "cluster" / "worker.log").read_text()
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Asked to launch executor" in worker_log          # the work ran on the cluster's executor
    printed = json.loads((tmp_path / "stats.json").read_text())
    assert printed["embed"]["pairs"] == stats["embed"]["pairs"]
    counts = assert_same_outputs(s.offline, offline, ML_END, rtol=1e-5, atol=1e-6)
    assert counts["pair_embeddings"] == stats["embed"]["pairs"] > 0
