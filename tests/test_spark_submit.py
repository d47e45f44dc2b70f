"""The refresh jobs under spark-submit against a Spark standalone master and worker started on loopback."""
import json

import numpy as np
import pandas as pd

from solaris_jobs import offline as off
from tests.servers import SparkStandalone
from tests.conftest import ML_END


def test_refresh_under_spark_submit_matches_in_process(spark, ml_run, tmp_path):
    job, stats = ml_run
    offline = tmp_path / "offline"
    with SparkStandalone(tmp_path / "cluster") as cluster:
        res = cluster.submit("spark_jobs/refresh.py", [
            "--data", job.data, "--offline", str(offline), "--models", job.models,
            "--start", job.start, "--end", job.end, "--lookback-days", "0", "--active-hours", str(24 * 14),
            "--history-len", "10", "--batch-size", "256", "--candidates", "60",
            "--stats-out", str(tmp_path / "stats.json")])
        worker_log = (tmp_path / "cluster" / "worker.log").read_text()
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Asked to launch executor" in worker_log          # the work ran on the cluster's executor
    printed = json.loads((tmp_path / "stats.json").read_text())
    assert printed["embed"]["pairs"] == stats["embed"]["pairs"]
    for d in off.DATASETS:
        a = off.read_interval(spark, job.offline, d, ML_END).toPandas()
        b = off.read_interval(spark, str(offline), d, ML_END).toPandas()
        key = [c for c in ("user_id", "item_id") if c in a.columns]
        a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
        assert a.shape == b.shape, d
        for c in a.columns:
            if a[c].dtype == object and len(a) and isinstance(a[c].iloc[0], (np.ndarray, list)):
                np.testing.assert_allclose(np.stack(a[c]), np.stack(b[c]), rtol=1e-5, atol=1e-6, err_msg=d)
            else:
                pd.testing.assert_series_equal(a[c], b[c], check_names=False, obj=f"{d}.{c}")
