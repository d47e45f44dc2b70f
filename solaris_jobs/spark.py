"""Spark session and I/O helpers shared by the jobs (``spark_jobs/``) and the tests.

Sessions run in UTC with Arrow transfers on; local sessions get ``$SOLARIS_SPARK_DRIVER_MEMORY`` (default 4g) of
driver heap, which in local mode is also the executors' heap, and log at ``$SOLARIS_SPARK_LOG_LEVEL`` (WARN).
``master`` defaults to ``$SOLARIS_SPARK_MASTER`` or ``local[*]``; under ``spark-submit`` the master given there
wins (``getOrCreate`` returns that session).
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def spark_session(app_name: str = "solaris", master: str | None = None, conf: dict | None = None):
    """Returns a SparkSession (creating one if needed) configured for SOLARIS jobs.

    Args:
        app_name: shown in the Spark UI.
        master: e.g. ``local[2]`` or ``spark://host:7077``; None keeps an existing session's master, else
            ``$SOLARIS_SPARK_MASTER``, else ``local[*]``.
        conf: extra Spark settings.
    """
    # Python workers must run the interpreter that has the project's packages.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    master = master or os.environ.get("SOLARIS_SPARK_MASTER")
    if master:
        builder = builder.master(master)
    elif not SparkSession.getActiveSession() and "spark.master" not in os.environ.get("SPARK_CONF", ""):
        builder = builder.master(os.environ.get("MASTER", "local[*]"))
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Many small shuffle partitions, coalesced by adaptive execution: less memory per task at scale.
        "spark.sql.shuffle.partitions": "32",
        "spark.sql.adaptive.enabled": "true",
        # In local mode the driver is also the executor; ignored when the JVM is already running.
        "spark.driver.memory": os.environ.get("SOLARIS_SPARK_DRIVER_MEMORY", "4g"),
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        **(conf or {}),
    }
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("SOLARIS_SPARK_LOG_LEVEL", "WARN"))
    return spark


def read_events(spark, root: str, start=None, end=None):
    """Events with start <= event_timestamp < end as a Spark DataFrame (partition columns dropped)."""
    from pyspark.sql import functions as F

    from solaris_jobs import events as ev
    df = spark.read.option("basePath", str(ev.events_dir(root))).parquet(str(ev.events_dir(root)))
    if start is not None:
        s = ev.to_utc(start)
        df = df.where(F.col("date") >= F.lit(s.date())).where(F.col("event_timestamp") >= F.lit(s.to_pydatetime()))
    if end is not None:
        e = ev.to_utc(end)
        df = df.where(F.col("date") <= F.lit(e.date())).where(F.col("event_timestamp") < F.lit(e.to_pydatetime()))
    return df.select(*ev.EVENT_SCHEMA.names)
