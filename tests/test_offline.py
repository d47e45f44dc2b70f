"""The offline store's layout: atomic publication (a writer killed between its data and its publish leaves the
old output whole), readers that follow the pointer to a complete run, file:// URIs."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from solaris_jobs.core import offline as off

END = pd.Timestamp("2026-01-05T01:00:00Z")
ROOT = Path(__file__).resolve().parent.parent

# A writer that stages a Spark DataFrame as the interval's new output and is SIGKILLed right before its publish.
KILLED_WRITER = """
import os, signal, sys
import pandas as pd
from solaris_jobs.core import offline as off
from solaris_jobs.pipeline.spark import spark_session
spark = spark_session("killed-writer", "local[1]", {"spark.ui.enabled": "false"}, driver_memory="1g")
df = spark.createDataFrame(pd.DataFrame({"user_id": range(100, 150), "v": 2.0}))
off._before_publish = lambda path: os.kill(os.getpid(), signal.SIGKILL)
off.write_interval(df, sys.argv[1], "user_aggregates", sys.argv[2])
"""


# A Spark job whose task on partition 1 has its Python worker SIGKILLed on the first attempt, writing an output.
TASK_KILLED = """
import os, signal, sys
import pandas as pd
from pyspark import TaskContext
from solaris_jobs.core import offline as off
from solaris_jobs.pipeline.spark import spark_session
spark = spark_session("task-killed", sys.argv[3], {"spark.ui.enabled": "false"}, driver_memory="1g")

def die_once(batches):
    ctx = TaskContext.get()
    for b in batches:
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        yield b

df = spark.createDataFrame(pd.DataFrame({"user_id": range(200, 300), "v": 4.0})).repartition(4)
off.write_interval(df.mapInPandas(die_once, df.schema), sys.argv[1], "user_aggregates", sys.argv[2])
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
    runs = sorted(p.name for p in folder.iterdir() if p.name.startswith(off.RUN))
    assert len(runs) == 2 and Path(first).name in runs               # the new data is all there, unpublished
    orphan = folder / next(r for r in runs if r != Path(first).name)
    pd.testing.assert_frame_equal(_rows(offline), old)               # readers still see the old output, whole
    assert off.published(offline, "user_aggregates", END) == first
    assert off.list_intervals(offline, "user_aggregates") == [END]
    # The next write publishes and removes the run it replaces; the unpublished one is left alone while it could
    # still be another writer's, and removed once it is older than that.
    new = pd.DataFrame({"user_id": range(5), "v": 3.0})
    second = off.write_interval(new, offline, "user_aggregates", END)
    pd.testing.assert_frame_equal(_rows(offline), new)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(off.RUN)) == sorted(
        [orphan.name, Path(second).name])
    aged = time.time() - off.ORPHAN_AGE.total_seconds() - 60
    os.utime(orphan, (aged, aged))
    latest = off.write_interval(new, offline, "user_aggregates", END)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"{off.POINTER}.0000000003.{Path(latest).name[len(off.RUN):]}", Path(latest).name], names


def test_a_spark_task_killed_mid_job_is_retried_or_fails_with_nothing_published(tmp_path):
    """A task's Python worker SIGKILLed mid-job: under a master that retries tasks (``local[2,3]``) the job
    completes and publishes the whole output; under one that does not (``local[2]``) the job fails, nothing is
    published, the old output stays whole, and no staged folder is left behind."""
    offline = tmp_path / "offline"
    old = pd.DataFrame({"user_id": range(10), "v": 1.0})
    off.write_interval(old, offline, "user_aggregates", END)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", TASK_KILLED, str(offline), END.isoformat(), "local[2]"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "Python worker exited unexpectedly" in res.stderr, res.stderr[-3000:]
    pd.testing.assert_frame_equal(_rows(offline), old)
    staging = offline / "user_aggregates" / off.STAGING
    assert not staging.exists() or not any(staging.iterdir())
    res = subprocess.run([sys.executable, "-c", TASK_KILLED, str(offline), END.isoformat(), "local[2,3]"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Python worker exited unexpectedly" in res.stderr                # the kill happened, and was retried
    pd.testing.assert_frame_equal(_rows(offline), pd.DataFrame({"user_id": range(200, 300), "v": 4.0}))


def test_publish_checks_its_data_and_readers_check_the_run(tmp_path, monkeypatch):
    offline = tmp_path / "offline"
    # Where folders do not rename (object stores), a run is written in place and published the same way.
    monkeypatch.setattr(off, "_renames_folders", lambda fs: False)
    staged = off.stage_table(pa.table({"user_id": [1, 2]}), offline, "selection", END)
    assert staged.path.startswith(off.interval_uri(offline, "selection", END) + "/" + off.RUN)
    assert not off.is_complete(offline, "selection", END)            # written, not published
    assert staged.publish({"rows": 2}) == staged.path
    assert off.read_table(offline, "selection", END).num_rows == 2
    # A staged output that vanished (another writer of the interval removed it) is never published.
    gone = off.stage_table(pa.table({"user_id": [3]}), offline, "selection", END)
    shutil.rmtree(gone.path)
    with pytest.raises(off.PublishError, match="staged selection output is gone"):
        gone.publish({"rows": 1})
    assert off.read_table(offline, "selection", END).num_rows == 2
    # A pointer to a run that is not there is no output at all, not an empty one.
    shutil.rmtree(staged.path)
    assert not off.is_complete(offline, "selection", END) and off.list_intervals(offline, "selection") == []


def test_layout_needs_a_complete_run_and_reads_file_uris(tmp_path):
    # A published run whose _SUCCESS is gone (a partial copy, a hand edit) is no output.
    run = Path(off.write_interval(pa.table({"user_id": [1, 2]}), tmp_path, "neighbours", END))
    assert off.read_table(tmp_path, "neighbours", END).column("user_id").to_pylist() == [1, 2]
    (run / "_SUCCESS").unlink()
    assert not off.is_complete(tmp_path, "neighbours", END)          # no _SUCCESS: not complete
    with pytest.raises(FileNotFoundError, match="no complete neighbours output for the interval ending"):
        off.read_table(tmp_path, "neighbours", END)
    # Rewriting it publishes a whole new run and removes the incomplete one.
    off.write_interval(pa.table({"user_id": [3]}), tmp_path, "neighbours", END)
    assert off.read_table(tmp_path, "neighbours", END).column("user_id").to_pylist() == [3]
    assert not run.exists()
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


def test_a_full_disk_fails_the_write_and_keeps_the_old_output(tmp_path, spark):
    """An offline store on a 1 MiB file system (a real tmpfs, mounted for the test): an output too big for it
    fails with the file system's ENOSPC, from the writers outside Spark and from Spark alike; readers still get
    the old output whole, the failed write leaves no half-written folder or file (outside Spark the space is given
    back at once; Spark's failed task may hold its deleted files open a while), and the next write that fits
    publishes."""
    import errno

    import numpy as np
    import pyarrow.fs as pafs
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert done.returncode == 0, f"mounting a tmpfs for the disk-full test needs root: {done.stderr}"
    offline = str(mnt / "offline")

    def leftovers():
        fs = pafs.LocalFileSystem()
        return [i.path for i in fs.get_file_info(pafs.FileSelector(offline, recursive=True))
                if i.type == pafs.FileType.File and ("/_staging/" in i.path or i.path.endswith(".tmp"))]
    try:
        old = pd.DataFrame({"user_id": [1, 2, 3], "v": [1.0, 2.0, 3.0]})
        off.write_interval(old, offline, "user_aggregates", END)
        off.write_report(offline, END, {"coverage": {"pair": 0.5}})
        used_before = shutil.disk_usage(mnt).used
        rng = np.random.default_rng(0)
        big = pd.DataFrame({"user_id": np.arange(400_000), "v": rng.random(400_000)})    # 6 MB of random floats
        with pytest.raises(OSError) as full:
            off.write_interval(big, offline, "user_aggregates", END)
        assert full.value.errno == errno.ENOSPC, full.value
        with pytest.raises(OSError) as full:
            off.write_report(offline, END, {"coverage": {"pair": 0.9}, "pad": "x" * 2_000_000})
        assert full.value.errno == errno.ENOSPC, full.value
        pd.testing.assert_frame_equal(off.read_table(offline, "user_aggregates", END).to_pandas(), old)
        assert off.read_report(offline, END) == {"coverage": {"pair": 0.5}}
        assert leftovers() == [] and shutil.disk_usage(mnt).used == used_before        # the space is given back
        new = old.assign(v=old.v * 10)
        off.write_interval(new, offline, "user_aggregates", END)
        pd.testing.assert_frame_equal(off.read_table(offline, "user_aggregates", END).to_pandas(), new)

        with pytest.raises(Exception, match=r"TASK_WRITE_FAILED|No space left"):
            off.write_interval(spark.createDataFrame(big), offline, "user_aggregates", END)
        pd.testing.assert_frame_equal(off.read_table(offline, "user_aggregates", END).to_pandas(), new)
        assert leftovers() == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_prune_removes_old_intervals_pointers_first_and_keeps_what_the_jobs_read_back(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from solaris_jobs.core.settings import PrecomputeConfig
    from solaris_jobs.flows.cli import main
    from solaris_jobs.pipeline import retention
    ends = [END + pd.Timedelta(hours=h) for h in range(30)]          # 30 hourly intervals, END .. END + 29 h
    for d in ("selection", "pair_embeddings", "neighbours", "knn_index", "covisit_counts", "user_histories"):
        for e in ends:
            off.write_interval(pa.table({"user_id": [int(e.hour)] * 100}), tmp_path, d, e)
    # Older than every interval: a dead writer's folder (no pointer, 7 h old) and a live writer's (no pointer, just
    # made: it stays).
    hour = pd.Timedelta(hours=1)
    for h, name in ((3, "run-dead"), (2, "run-live")):
        run = Path(off.interval_uri(tmp_path, "selection", END - h * hour)) / name
        run.mkdir(parents=True)
        (run / "part-0.parquet").write_bytes(b"x" * 10)
        if name == "run-dead":
            then = time.time() - 7 * 3600
            for path in (run / "part-0.parquet", run, run.parent):
                os.utime(path, (then, then))
    cfg = PrecomputeConfig(exclusion_runs=3, aggregate_hours=24.0, knn_rebuild_hours=12.0, state_keep_hours=2.0)

    # A bound past every interval: each dataset keeps only what the next refresh reads back.
    got = retention.prune(tmp_path, cfg, ("selection", "pair_embeddings", "neighbours", "knn_index"),
                          ends[-1] + pd.Timedelta(1))
    assert off.list_intervals(tmp_path, "selection") == ends[-3:]                    # negative exclusion's 3 runs
    assert off.list_intervals(tmp_path, "pair_embeddings") == ends[-25:]             # the aggregate's 24 h
    assert off.list_intervals(tmp_path, "knn_index") == ends[-13:]                   # the index's 12 h
    assert off.list_intervals(tmp_path, "neighbours") == ends[-1:]                   # materialize's input
    assert off.interval_ends(tmp_path, "selection") == [END - 2 * hour, *ends[-3:]]  # the dead one went
    assert got["selection"]["kept_for_jobs"] == 3 and len(got["selection"]["removed"]) == 28
    assert got["pair_embeddings"]["kept_for_jobs"] == 25 and got["neighbours"]["kept_for_jobs"] == 1
    assert got["selection"]["bytes"] > 27 * 100                                      # what the files held
    assert off.read_table(tmp_path, "selection", ends[-1]).num_rows == 100           # the kept ones read whole

    # Select's own pruning: relative to the interval it wrote, never that one or a later one (a backfill of an
    # older interval leaves the newer state alone).
    assert retention.prune_state(tmp_path, cfg, ends[10])["intervals"] == 8         # END .. END + 7 h
    assert off.list_intervals(tmp_path, "covisit_counts") == ends[8:]
    assert off.list_intervals(tmp_path, "user_histories") == ends[8:]

    # A removal cut short after the pointers leaves an incomplete interval, which no reader takes for an output;
    # select's own pruning then only warns (its outputs are whole).
    class NoDirDeletes:                         # the local file system, failing to remove folders
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):
            return getattr(self.fs, name)

        def delete_dir(self, path):
            raise OSError(f"{path}: I/O error")
    real = off.filesystem
    monkeypatch.setattr(off, "filesystem", lambda uri: (NoDirDeletes(real(uri)[0]), real(uri)[1]))
    with pytest.raises(OSError):
        off.remove_interval(tmp_path, "covisit_counts", ends[8])
    assert ends[8] not in off.list_intervals(tmp_path, "covisit_counts")
    with pytest.raises(FileNotFoundError, match="no complete covisit_counts output"):
        off.read_table(tmp_path, "covisit_counts", ends[8])
    assert "I/O error" in retention.prune_state(tmp_path, cfg, ends[12])["error"]
    monkeypatch.undo()

    # The CLI: --keep-hours from each dataset's newest, a dry run changes nothing, an unknown dataset is named
    # before anything is removed, groups and names mix.
    run = CliRunner().invoke(main, ["prune", "--offline", str(tmp_path), "--keep-hours", "5", "--datasets",
                                    "state", "--dry-run"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.output)
    # The one cut short (ends[8]: no pointer, files just written) waits for ORPHAN_AGE like a live writer's.
    assert out["dry_run"] and out["datasets"]["covisit_counts"]["removed"][0] == ends[9].isoformat()
    assert len(out["datasets"]["covisit_counts"]["removed"]) == 15                   # ends[9] .. ends[23]
    assert off.interval_ends(tmp_path, "covisit_counts") == ends[8:]
    run = CliRunner().invoke(main, ["prune", "--offline", str(tmp_path), "--keep-hours", "0",
                                    "--datasets", "user_histories,pairs"])
    assert run.exit_code != 0 and "'pairs': not an offline dataset" in run.output
    assert off.list_intervals(tmp_path, "user_histories") == ends[9:]              # (ends[8]: cut short above)
    run = CliRunner().invoke(main, ["prune", "--offline", str(tmp_path), "--keep-hours", "5", "--datasets",
                                    "state,pair_embeddings"])
    assert run.exit_code == 0, run.output
    assert off.interval_ends(tmp_path, "covisit_counts") == [ends[8], *ends[-6:]]
    assert off.list_intervals(tmp_path, "pair_embeddings") == ends[-25:]           # the aggregate's still
    assert off.list_intervals(tmp_path, "selection") == ends[-3:]
