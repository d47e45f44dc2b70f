"""The offline store's layout, in one place: interval keys, paths, completeness, atomic publication, and the
readers and writers every step uses (Spark jobs, the materializer, the report, the miss drain, the demo).

Layout (``offline`` is a URI pyarrow opens (``uris.filesystem``) and Spark writes: a path, ``file://``, ``s3a://``
(opened as ``s3://`` outside Spark, with the standard AWS settings: credentials, ``AWS_ENDPOINT_URL``), ``gs://``,
``hdfs://`` (needs libhdfs)), one folder per interval end::

    <offline>/<dataset>/end=YYYYMMDDTHHMMSSZ/_PUBLISHED.<seq>.<id>       {"run": "<id>", ...}: the newest one counts
    <offline>/<dataset>/end=YYYYMMDDTHHMMSSZ/run-<id>/part-*.parquet, _SUCCESS, _stats.json
    <offline>/misses/*.parquet                                           serving misses (user_id, item_id, missed_at)
    <offline>/reports/end=YYYYMMDDTHHMMSSZ/report.json

A write goes to a fresh folder (``<dataset>/_staging/<end key>-<id>``, hidden from readers of the whole dataset,
renamed to ``run-<id>`` on file systems that rename folders: local, HDFS; straight into ``run-<id>`` on object
stores). Then a new pointer file names it, with a sequence number above the older ones (a new name each time:
creating a file is atomic where replacing one is not), and then the older pointers and runs are removed. A reader
follows the newest pointer, so it sees the old whole output or the new whole output, never a half one; a write
that dies before its pointer leaves the old output in place (its unpublished folder is removed by a later write
of the interval once it is ``ORPHAN_AGE`` old, so that a concurrent writer's folder is never taken). A reader
that resolved the old run while the new one was published may find its files gone: it fails, and reads again,
never a mix. Nothing here goes through Spark's JVM (``spark._jvm``): a Spark Connect session works, and so do
the steps outside Spark (pyarrow's file systems).

Datasets: ``rejects`` (the interval's bad event rows, with a ``reason``), ``selection``, the interval's state
written by the selection (``user_histories``: every user's last events before T as the FM reads them;
``user_counters``, ``item_counters``: events, labelled events and positives), read by ``embed`` and
``neighbours`` and updated by the next interval's selection, ``pair_embeddings``,
``embedding_rejects`` (pairs whose FM output was not finite, with a ``reason``), ``user_aggregates``,
``user_embeddings`` (with each user's neighbour list and the time the vector was computed), ``neighbours``, and
``knn_index`` (the FAISS index of a full neighbours interval, files not parquet: ``index.faiss``, ``ids.npy``).
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs

from solaris_jobs.core.events import to_utc
from solaris_jobs.core.uris import filesystem, join

logger = logging.getLogger(__name__)

DATASETS = ("rejects", "selection", "user_histories", "user_counters", "item_counters", "covisit_counts",
            "user_seeds", "pair_embeddings", "embedding_rejects", "user_aggregates", "pair_fallbacks", "user_embeddings",
            "user_states", "neighbours")
# The interval's state: written by select from its read of the log, read by embed and neighbours instead of the
# log (``solaris_jobs.pipeline.jobs``); a cache of the log, not an output.
STATE_DATASETS = ("user_histories", "user_counters", "item_counters")
# The request simulator's state (the lookback's co-visit counts, each user's latest items), which select writes
# when the simulator runs and updates like the state.
SIMULATOR_STATE = ("covisit_counts", "user_seeds")
POINTER = "_PUBLISHED"
RUN = "run-"                # not key=value: plain directory readers do not make it a column (selection has a `run`)
STAGING = "_staging"


# ------------------------------------------------------------------------------------------------ paths

def interval_key(end) -> str:
    """``end=YYYYMMDDTHHMMSSZ`` for an interval end (naive times are UTC)."""
    return "end=" + to_utc(end).strftime("%Y%m%dT%H%M%SZ")


def parse_key(name: str) -> pd.Timestamp:
    return pd.Timestamp(pd.to_datetime(name.split("=", 1)[1], format="%Y%m%dT%H%M%SZ", utc=True))


def dataset_uri(offline, dataset: str) -> str:
    return join(offline, dataset)


def interval_uri(offline, dataset: str, end) -> str:
    """The interval's folder (holding its pointers and runs)."""
    return join(offline, dataset, interval_key(end))


def misses_uri(offline) -> str:
    return join(offline, "misses")


def report_uri(offline, end) -> str:
    return join(offline, "reports", interval_key(end), "report.json")


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(uri) -> bytes | None:
    """A small file's bytes, None if it does not exist."""
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write_then_move(uri, write) -> None:
    """``write(fs, tmp_path)`` under a temporary name beside ``uri``, then renamed to it, so that readers see the
    old file or the whole new one (atomic on local and HDFS file systems; an object store's put is atomic)."""
    fs, path = filesystem(uri)
    parent, name = path.rsplit("/", 1)
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        write(fs, tmp)
        fs.move(tmp, path)
    except BaseException:
        _remove(fs, tmp, is_dir=False)                   # a full disk must not stay full of our half file
        raise


def _remove(fs: pafs.FileSystem, path: str, is_dir: bool) -> None:
    """Removes a file or folder of our own, if it is there (after a failed write; errors are logged, the write's
    error is the one raised)."""
    try:
        if _exists(fs, path):
            fs.delete_dir(path) if is_dir else fs.delete_file(path)
    except OSError as e:
        logger.warning("could not remove %s after a failed write: %s", path, e)


def write_bytes(uri, data: bytes) -> None:
    """Writes a small file atomically (``_write_then_move``)."""
    def write(fs, tmp):
        with fs.open_output_stream(tmp) as f:
            f.write(data)
    _write_then_move(uri, write)


def write_json(uri, obj) -> None:
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(uri) -> dict | None:
    raw = read_bytes(uri)
    return json.loads(raw) if raw is not None else None


# ------------------------------------------------------------------------------------------------ publication

def _pointers(fs: pafs.FileSystem, folder: str) -> list[tuple[int, str, str]]:
    """(sequence, run, path) of an interval folder's pointer files, newest last."""
    out = []
    for info in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
        parts = info.base_name.split(".")
        if info.type == pafs.FileType.File and len(parts) == 3 and parts[0] == POINTER and parts[1].isdigit():
            out.append((int(parts[1]), parts[2], info.path))
    return sorted(out)


def published(offline, dataset: str, end) -> str | None:
    """The folder of the interval's published output (None: the interval has no complete output)."""
    folder = interval_uri(offline, dataset, end)
    fs, path = filesystem(folder)
    pointers = _pointers(fs, path)
    if pointers:
        run = join(folder, RUN + pointers[-1][1])
        # A pointer to a run that is gone (removed by hand, or by another writer) is no output, not an empty one.
        return run if _exists(fs, f"{filesystem(run)[1]}/_SUCCESS") else None
    return None


def is_complete(offline, dataset: str, end) -> bool:
    return published(offline, dataset, end) is not None


def require(offline, dataset: str, end) -> str:
    """The published output's folder.

    Raises:
        FileNotFoundError: the interval has no complete output (run the step that makes it first).
    """
    path = published(offline, dataset, end)
    if path is None:
        raise FileNotFoundError(f"{interval_uri(offline, dataset, end)}: no complete {dataset} output for the "
                                f"interval ending {pd.Timestamp(end).isoformat()} (run the step that makes it first)")
    return path


def list_intervals(offline, dataset: str, since=None, before=None, last: int | None = None) -> list[pd.Timestamp]:
    """Ends of the intervals of ``dataset`` with a complete output, oldest first.

    Args:
        since, before: only ends with ``since <= end < before`` (None: no bound), filtered before anything is read.
        last: only the newest ``last`` complete ones (checked newest first, so older ones are not read).
    """
    ends = [e for e in interval_ends(offline, dataset)
            if (since is None or e >= since) and (before is None or e < before)]
    out = []
    for e in reversed(ends):
        if last is not None and len(out) >= last:
            break
        if is_complete(offline, dataset, e):
            out.append(e)
    return out[::-1]


def interval_ends(offline, dataset: str) -> list[pd.Timestamp]:
    """Ends of every interval folder of ``dataset``, complete or not, oldest first."""
    fs, base = filesystem(dataset_uri(offline, dataset))
    return sorted(parse_key(i.base_name) for i in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("end="))


def abandoned(offline, dataset: str, end) -> bool:
    """Whether an interval folder with no complete output is a dead writer's: nothing in it (the folder included,
    where the file system knows its time) younger than ``ORPHAN_AGE``."""
    fs, folder = filesystem(interval_uri(offline, dataset, end))
    old = pd.Timestamp.now(tz="UTC") - ORPHAN_AGE
    infos = [fs.get_file_info(folder), *fs.get_file_info(pafs.FileSelector(folder, recursive=True,
                                                                            allow_not_found=True))]
    return all(i.mtime is None or to_utc(i.mtime) < old for i in infos)


def remove_interval(offline, dataset: str, end, dry_run: bool = False) -> int:
    """Removes an interval's output: its pointers first, so that from then on no reader takes it for an output (a
    removal cut short leaves an incomplete interval, never a half one that is read), then its folder.

    Returns:
        The bytes its files held (what was freed, or with ``dry_run`` would be).
    """
    fs, folder = filesystem(interval_uri(offline, dataset, end))
    infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    size = sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)
    if dry_run:
        return size
    for _, _, path in _pointers(fs, folder):
        fs.delete_file(path)
    if _exists(fs, folder):
        fs.delete_dir(folder)
    logger.info("removed %s (%d bytes)", interval_uri(offline, dataset, end), size)
    return size


def _renames_folders(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, (pafs.LocalFileSystem, pafs.HadoopFileSystem))


class PublishError(RuntimeError):
    """A staged output cannot be published (its data is gone)."""


@dataclass
class Staged:
    """An interval's new output, written but not yet published: read it (``path``), then ``publish`` it."""
    offline: str
    dataset: str
    end: pd.Timestamp
    run: str
    path: str                   # where the data is now

    def publish(self, stats: dict | None = None, published_at=None) -> str:
        """Writes ``_stats.json`` beside the data, makes this run the interval's output (a new pointer file whose
        sequence number is above every earlier one), then removes the older pointers and runs.

        Returns:
            The published folder.

        Raises:
            PublishError: the staged data is not there (complete) any more; nothing was published.
        """
        fs, staged = filesystem(self.path)
        if not _exists(fs, f"{staged}/_SUCCESS"):
            raise PublishError(f"{self.path}: the staged {self.dataset} output is gone or incomplete (removed by "
                               f"another writer of this interval?); nothing published, the earlier output stays")
        folder = interval_uri(self.offline, self.dataset, self.end)
        final = join(folder, RUN + self.run)
        _, fpath = filesystem(folder)
        where = staged
        try:
            if stats is not None:
                write_json(join(self.path, "_stats.json"), stats)
            if self.path != final:
                fs.create_dir(fpath, recursive=True)
                fs.move(staged, filesystem(final)[1])
                where = filesystem(final)[1]
            _before_publish(final)
            earlier = _pointers(fs, fpath)
            seq = earlier[-1][0] + 1 if earlier else 1
            # A new name every time: a rename onto a name that does not exist yet is atomic on every file system
            # (replacing a file is not, on HDFS through pyarrow).
            write_json(join(folder, f"{POINTER}.{seq:010d}.{self.run}"), {"run": self.run, "published_at": pd.Timestamp(
                published_at if published_at is not None else pd.Timestamp.now(tz="UTC")).isoformat()})
        except Exception:
            _remove(fs, where, is_dir=True)     # not published (a full disk, a lost store): the old output stays
            raise
        _clean(fs, fpath, self.run, {run for _, run, _ in earlier},
               filesystem(join(dataset_uri(self.offline, self.dataset), STAGING))[1], interval_key(self.end))
        logger.info("published %s", final)
        return final


def _before_publish(path: str) -> None:
    """A seam for the fault-injection test (a process killed between its data and its publish)."""


ORPHAN_AGE = pd.Timedelta(hours=6)      # unpublished folders younger than this may be another writer's, in progress


def _clean(fs: pafs.FileSystem, folder: str, keep: str, superseded: set, staging: str, key: str) -> None:
    """After a publish: removes the older pointers, the runs they named, and unpublished runs and staging folders
    of this interval older than ``ORPHAN_AGE`` (left by killed writers)."""
    old = pd.Timestamp.now(tz="UTC") - ORPHAN_AGE

    def orphan(info) -> bool:
        return info.mtime is not None and to_utc(info.mtime) < old

    doomed = []
    for info in fs.get_file_info(pafs.FileSelector(folder)):
        name = info.base_name
        if info.type == pafs.FileType.File:
            parts = name.split(".")
            if parts[0] == POINTER and len(parts) == 3 and parts[2] != keep:
                doomed.append((info, False))
        elif name.startswith(RUN) and name != RUN + keep and (name[len(RUN):] in superseded or orphan(info)):
            doomed.append((info, True))
    for info in fs.get_file_info(pafs.FileSelector(staging, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith(key + "-") and orphan(info):
            doomed.append((info, True))
    for info, is_dir in doomed:
        try:
            fs.delete_dir(info.path) if is_dir else fs.delete_file(info.path)
        except (FileNotFoundError, OSError) as e:       # another process removed it first: nothing to do
            logger.debug("could not remove %s: %s", info.path, e)


def _new_run(offline, dataset: str, end) -> Staged:
    end = to_utc(end)
    run = uuid.uuid4().hex[:12]
    folder = interval_uri(offline, dataset, end)
    fs, _ = filesystem(folder)
    path = (join(dataset_uri(offline, dataset), STAGING, f"{interval_key(end)}-{run}") if _renames_folders(fs)
            else join(folder, RUN + run))
    return Staged(str(offline), dataset, end, run, path)


def stage(df, offline, dataset: str, end) -> Staged:
    """Writes a Spark DataFrame as a new, unpublished output of the interval ending at ``end``."""
    staged = _new_run(offline, dataset, end)
    with _removed_on_failure(staged):
        df.write.mode("overwrite").parquet(staged.path)
    return staged


class _removed_on_failure:
    """A staged folder that its write failed to finish (a full disk, a killed task) is removed at once: it is
    this writer's own (a fresh name), and left behind it would keep the disk full until ``ORPHAN_AGE``."""

    def __init__(self, staged: Staged):
        self.staged = staged

    def __enter__(self):
        return self.staged

    def __exit__(self, kind, *_):
        if kind is not None:
            fs, path = filesystem(self.staged.path)
            _remove(fs, path, is_dir=True)
        return False


# Rows per parquet row group of a table written outside Spark: Spark splits its reads by row group, so a table of
# millions of users (user_embeddings: 2M x ~180 values) is read by many tasks of bounded memory, not a few huge ones.
ROW_GROUP_ROWS = 65_536


def stage_table(table: pa.Table, offline, dataset: str, end) -> Staged:
    """``stage`` for an Arrow table or pandas frame made outside Spark (one parquet file in row groups of
    ``ROW_GROUP_ROWS``, microsecond times)."""
    import pyarrow.parquet as pq
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    staged = _new_run(offline, dataset, end)
    fs, path = filesystem(staged.path)
    with _removed_on_failure(staged):
        fs.create_dir(path, recursive=True)
        pq.write_table(table, f"{path}/part-00000.parquet", filesystem=fs, coerce_timestamps="us",
                       allow_truncated_timestamps=True, row_group_size=ROW_GROUP_ROWS)
        with fs.open_output_stream(f"{path}/_SUCCESS"):
            pass
    return staged


def stage_files(offline, dataset: str, end, files: dict) -> Staged:
    """``stage`` for named binary files (e.g. a serialized index): ``files`` maps a name to bytes or a buffer."""
    staged = _new_run(offline, dataset, end)
    fs, path = filesystem(staged.path)
    with _removed_on_failure(staged):
        fs.create_dir(path, recursive=True)
        for name, data in files.items():
            with fs.open_output_stream(f"{path}/{name}") as f:
                f.write(data)
        with fs.open_output_stream(f"{path}/_SUCCESS"):
            pass
    return staged


def write_interval(df, offline, dataset: str, end, stats: dict | None = None) -> str:
    """Writes and publishes ``df`` (a Spark DataFrame, an Arrow table or a pandas frame) as the interval's
    ``dataset`` output; returns the published folder."""
    spark_frame = hasattr(df, "sparkSession")
    return (stage(df, offline, dataset, end) if spark_frame else stage_table(df, offline, dataset, end)).publish(stats)


# ------------------------------------------------------------------------------------------------ readers

def read_stats(offline, dataset: str, end) -> dict | None:
    path = published(offline, dataset, end)
    return read_json(join(path, "_stats.json")) if path else None


def read_interval(spark, offline, dataset: str, end):
    """The ``dataset`` output of one interval as a Spark DataFrame.

    Raises:
        FileNotFoundError: that interval has no complete output.
    """
    return spark.read.parquet(require(offline, dataset, end))


def read_intervals(spark, offline, dataset: str, ends):
    """Union of several intervals' outputs (None if ``ends`` is empty)."""
    out = None
    for e in ends:
        df = read_interval(spark, offline, dataset, e)
        out = df if out is None else out.unionByName(df)
    return out


def _arrow_dataset(path: str):
    import pyarrow.dataset as ds
    fs, p = filesystem(path)
    return ds.dataset(p, filesystem=fs, format="parquet", partitioning=None)


def read_batches(offline, dataset: str, end, batch_rows: int):
    """Record batches of one interval's published output (no Spark)."""
    return _arrow_dataset(require(offline, dataset, end)).to_batches(batch_size=batch_rows)


def read_table(offline, dataset: str, end, columns: list[str] | None = None) -> pa.Table:
    """One interval's published output as an Arrow table (no Spark)."""
    return _arrow_dataset(require(offline, dataset, end)).to_table(columns=columns)


def read_misses(spark, offline, start, end):
    """Serving misses with ``start <= missed_at < end`` from ``<offline>/misses`` (None if there are none)."""
    from pyspark.sql import functions as F
    path = misses_uri(offline)
    fs, p = filesystem(path)
    if not _exists(fs, p):
        return None
    df = spark.read.option("recursiveFileLookup", "true").parquet(path)
    missing = {"user_id", "item_id", "missed_at"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: miss records lack columns {sorted(missing)} (need user_id, item_id, missed_at)")
    s, e = pd.Timestamp(start).to_pydatetime(), pd.Timestamp(end).to_pydatetime()
    return df.where((F.col("missed_at") >= F.lit(s)) & (F.col("missed_at") < F.lit(e))) \
        .select(F.col("user_id").cast("long"), F.col("item_id").cast("long"), F.col("missed_at").cast("timestamp"))


def write_parquet(folder, table: pa.Table, name: str) -> str:
    """One parquet file ``<folder>/<name>`` (e.g. misses under ``misses_uri``), under a temporary name first."""
    import pyarrow.parquet as pq
    uri = join(folder, name)
    _write_then_move(uri, lambda fs, tmp: pq.write_table(table, tmp, filesystem=fs))
    return uri


def write_report(offline, end, report: dict) -> str:
    uri = report_uri(offline, end)
    write_json(uri, report)
    return uri


def read_report(offline, end) -> dict | None:
    return read_json(report_uri(offline, end))
