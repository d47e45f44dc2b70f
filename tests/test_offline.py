"""The offline store's layout: atomic publication (a writer killed between its data and its publish leaves the
old output whole), readers that follow the pointer, outputs of earlier versions, file:// URIs."""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from solaris_jobs import offline as off

END = pd.Timestamp("2026-01-05T01:00:00Z")
ROOT = Path(__file__).resolve().parent.parent

# A writer that stages a Spark DataFrame as the interval's new output and is SIGKILLed right before its publish.
KILLED_WRITER = """
import os, signal, sys
import pandas as pd
from solaris_jobs import offline as off
from solaris_jobs.spark import spark_session
spark = spark_session("killed-writer", "local[1]", {"spark.ui.enabled": "false"}, driver_memory="1g")
df = spark.createDataFrame(pd.DataFrame({"user_id": range(100, 150), "v": 2.0}))
off._before_publish = lambda path: os.kill(os.getpid(), signal.SIGKILL)
off.write_interval(df, sys.argv[1], "user_aggregates", sys.argv[2])
"""


def _rows(offline) -> pd.DataFrame:
    return off.read_table(offline, "user_aggregates", END).to_pandas().sort_values("user_id").reset_index(drop=True)


def test_a_writer_killed_before_its_publish_leaves_the_old_output_whole(tmp_path):
    offline = tmp_path / "offline"
    old = pd.DataFrame({"user_id": range(10), "v": 1.0})
    first = off.write_interval(old, offline, "user_aggregates", END, stats={"rows": 10})
    assert off.read_stats(offline, "user_aggregates", END) == {"rows": 10}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(offline), END.isoformat()], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -9, res.stderr[-3000:]                  # killed, by SIGKILL, in the seam
    folder = Path(off.interval_uri(offline, "user_aggregates", END))
    runs = sorted(p.name for p in folder.iterdir() if p.name.startswith("run="))
    assert len(runs) == 2 and Path(first).name in runs               # the new data is all there, unpublished
    pd.testing.assert_frame_equal(_rows(offline), old)               # readers still see the old output, whole
    assert off.published(offline, "user_aggregates", END) == first
    assert off.list_intervals(offline, "user_aggregates") == [END]
    # The next write publishes and removes both the old run and the orphan the killed writer left.
    new = pd.DataFrame({"user_id": range(5), "v": 3.0})
    latest = off.write_interval(new, offline, "user_aggregates", END)
    pd.testing.assert_frame_equal(_rows(offline), new)
    assert sorted(p.name for p in folder.iterdir()) == [off.POINTER, Path(latest).name]


def test_layout_reads_earlier_outputs_and_file_uris(tmp_path):
    # An output as earlier versions wrote it: parquet and _SUCCESS directly in end=..., no _PUBLISHED.
    legacy = Path(off.interval_uri(tmp_path, "neighbours", END))
    legacy.mkdir(parents=True)
    pd.DataFrame({"user_id": [1, 2]}).to_parquet(legacy / "part-0.parquet")
    assert not off.is_complete(tmp_path, "neighbours", END)          # no _SUCCESS: not complete
    (legacy / "_SUCCESS").touch()
    assert off.read_table(tmp_path, "neighbours", END).column("user_id").to_pylist() == [1, 2]
    # Rewriting it moves it to the new layout and removes the old files.
    off.write_interval(pa.table({"user_id": [3]}), tmp_path, "neighbours", END)
    assert off.read_table(tmp_path, "neighbours", END).column("user_id").to_pylist() == [3]
    assert not list(legacy.glob("part-*")) and not (legacy / "_SUCCESS").exists()
    # The same store through a file:// URI; an interval that was never written is a clear error.
    uri = f"file://{tmp_path}"
    assert off.list_intervals(uri, "neighbours") == [END]
    assert off.read_table(uri, "neighbours", END).num_rows == 1
    with pytest.raises(FileNotFoundError, match="no complete neighbours output for the interval ending"):
        off.read_table(uri, "neighbours", END + pd.Timedelta(hours=1))
    off.write_report(uri, END, {"coverage": {"pair": 0.5}})
    assert off.read_report(tmp_path, END) == {"coverage": {"pair": 0.5}}
    with pytest.raises(ValueError, match="nosuchfs://x/neighbours/.*: cannot open this file system outside Spark"):
        off.read_stats("nosuchfs://x", "neighbours", END)
