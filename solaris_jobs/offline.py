"""The offline store: each job's output for an interval, keyed by the interval's end, overwritten on rerun.

Layout (any URI Spark's Hadoop file system reads: local path, ``file://``, ``s3a://``, ``hdfs://``)::

    <offline>/<dataset>/end=YYYYMMDDTHHMMSSZ/part-*.parquet, _SUCCESS, _stats.json

Datasets: ``rejects`` (the interval's bad event rows, with a ``reason``), ``selection`` (scored candidate pairs
and what was selected), ``pair_embeddings``, ``user_aggregates``, ``user_embeddings``, ``neighbours``;
``misses/`` holds serving misses (parquet with ``user_id``, ``item_id``, ``missed_at``). A write goes to a
staging folder first and is renamed into place, so a reader sees the old complete output or the new complete
output, never half of one.
"""
from __future__ import annotations

import json
import logging
import uuid

import pandas as pd

logger = logging.getLogger(__name__)

DATASETS = ("rejects", "selection", "pair_embeddings", "user_aggregates", "user_embeddings", "neighbours")


def interval_key(end) -> str:
    """``end=YYYYMMDDTHHMMSSZ`` for an interval end (naive times are UTC)."""
    from solaris_jobs.events import to_utc
    return "end=" + to_utc(end).strftime("%Y%m%dT%H%M%SZ")


def parse_key(name: str) -> pd.Timestamp:
    return pd.Timestamp(pd.to_datetime(name.split("=", 1)[1], format="%Y%m%dT%H%M%SZ", utc=True))


def interval_path(offline: str, dataset: str, end) -> str:
    return f"{str(offline).rstrip('/')}/{dataset}/{interval_key(end)}"


def _fs(spark, path: str):
    jvm = spark._jvm
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark._jsc.hadoopConfiguration()), p, jvm


def write_interval(df, offline: str, dataset: str, end, stats: dict | None = None) -> str:
    """Writes ``df`` as the ``dataset`` output of the interval ending at ``end``, replacing any earlier one.

    Returns:
        The output path.
    """
    spark = df.sparkSession
    target = interval_path(offline, dataset, end)
    staging = f"{str(offline).rstrip('/')}/{dataset}/_staging-{interval_key(end)[4:]}-{uuid.uuid4().hex[:8]}"
    df.write.mode("overwrite").parquet(staging)
    if stats is not None:
        write_stats(spark, staging, stats)
    fs, tpath, jvm = _fs(spark, target)
    if fs.exists(tpath):
        fs.delete(tpath, True)
    if not fs.rename(jvm.org.apache.hadoop.fs.Path(staging), tpath):
        raise IOError(f"could not move {staging} to {target}")
    logger.info("wrote %s", target)
    return target


def write_text(spark, path: str, text: str) -> None:
    fs, p, _ = _fs(spark, path)
    out = fs.create(p, True)
    try:
        out.write(bytearray(text.encode()))
    finally:
        out.close()


def write_stats(spark, path: str, stats: dict) -> None:
    """Writes a job's stats as ``<path>/_stats.json`` (Spark readers skip files starting with ``_``)."""
    write_text(spark, f"{path}/_stats.json", json.dumps(stats, indent=2, sort_keys=True, default=str))


def read_text(spark, path: str) -> str | None:
    fs, p, jvm = _fs(spark, path)
    if not fs.exists(p):
        return None
    stream = fs.open(p)
    try:
        reader = jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8"))
        lines = []
        while (line := reader.readLine()) is not None:
            lines.append(line)
        return "\n".join(lines)
    finally:
        stream.close()


def read_stats(spark, offline: str, dataset: str, end) -> dict | None:
    text = read_text(spark, f"{interval_path(offline, dataset, end)}/_stats.json")
    return json.loads(text) if text else None


def list_intervals(spark, offline: str, dataset: str) -> list[pd.Timestamp]:
    """Ends of the complete (``_SUCCESS``) intervals of ``dataset``, oldest first."""
    fs, base, jvm = _fs(spark, f"{str(offline).rstrip('/')}/{dataset}")
    if not fs.exists(base):
        return []
    ends = []
    for st in fs.listStatus(base):
        name = st.getPath().getName()
        if st.isDirectory() and name.startswith("end=") and fs.exists(
                jvm.org.apache.hadoop.fs.Path(st.getPath(), "_SUCCESS")):
            ends.append(parse_key(name))
    return sorted(ends)


def read_interval(spark, offline: str, dataset: str, end):
    """The ``dataset`` output of one interval.

    Raises:
        FileNotFoundError: that interval has no complete output (run the job that makes it first).
    """
    path = interval_path(offline, dataset, end)
    fs, p, jvm = _fs(spark, path)
    if not fs.exists(jvm.org.apache.hadoop.fs.Path(p, "_SUCCESS")):
        raise FileNotFoundError(f"{path}: no complete {dataset} output for the interval ending {end}")
    return spark.read.parquet(path)


def read_intervals(spark, offline: str, dataset: str, ends):
    """Union of several intervals' outputs (None if ``ends`` is empty)."""
    out = None
    for e in ends:
        df = read_interval(spark, offline, dataset, e)
        out = df if out is None else out.unionByName(df)
    return out


def read_misses(spark, offline: str, start, end):
    """Serving misses with ``start <= missed_at < end`` from ``<offline>/misses`` (None if there are none)."""
    from pyspark.sql import functions as F
    path = f"{str(offline).rstrip('/')}/misses"
    fs, p, _ = _fs(spark, path)
    if not fs.exists(p):
        return None
    df = spark.read.option("recursiveFileLookup", "true").parquet(path)
    missing = {"user_id", "item_id", "missed_at"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: miss records lack columns {sorted(missing)} (need user_id, item_id, missed_at)")
    s, e = pd.Timestamp(start).to_pydatetime(), pd.Timestamp(end).to_pydatetime()
    return df.where((F.col("missed_at") >= F.lit(s)) & (F.col("missed_at") < F.lit(e))) \
        .select(F.col("user_id").cast("long"), F.col("item_id").cast("long"))
