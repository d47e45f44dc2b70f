"""Spark session and I/O helpers shared by the jobs (``solaris_jobs.pipeline.jobs``) and the tests.

Sessions run in UTC with Arrow transfers on. Their settings (master, driver memory, log level) come from the
caller, i.e. from ``Settings`` (``jobs.session``); ``master`` None keeps spark-submit's master (or pyspark's default,
``local[*]``), and ``sc://host:port`` opens a Spark Connect session. Nothing in the jobs needs the JVM gateway
(``spark._jvm``, ``sparkContext``), so the same code runs on a classic and a Connect session.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def loopback_only(master: str | None, env=None) -> bool:
    """Whether a session for ``master`` is wholly on this host, so that its driver may bind 127.0.0.1 (what
    ``spark_session`` then sets ``SPARK_LOCAL_IP`` to, unless it is set): a ``local`` master, or none given and no
    JVM launched by spark-submit (then ``local[*]``). A driver of a remote master (``spark://``, ``yarn``, ``k8s://``)
    must advertise an address its executors can reach: Spark's own choice, or ``SPARK_LOCAL_IP`` as set."""
    env = os.environ if env is None else env
    if master is None:
        if "PYSPARK_GATEWAY_PORT" in env:            # under spark-submit: its JVM, its master, its address
            return False
        master = env.get("MASTER", "local[*]")
    return master.startswith("local")


LOG4J2 = Path(__file__).with_name("log4j2.properties")


def quiet_start(conf: dict | None) -> dict:
    """The driver option that starts Spark with ``LOG4J2`` (no default-profile banner, no native-Hadoop warning),
    unless the user configures the driver's Java options or log4j2 themselves (their conf, ``spark-defaults.conf``
    or a ``log4j2.properties`` in ``SPARK_CONF_DIR``), or the project's path has a space: then nothing."""
    if "spark.driver.extraJavaOptions" in (conf or {}) or " " in str(LOG4J2):
        return {}
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (os.environ.get("SPARK_HOME") and
                                                    os.path.join(os.environ["SPARK_HOME"], "conf"))
    if conf_dir:
        if os.path.exists(os.path.join(conf_dir, "log4j2.properties")):
            return {}
        defaults = os.path.join(conf_dir, "spark-defaults.conf")
        if os.path.exists(defaults) and "spark.driver.extraJavaOptions" in Path(defaults).read_text():
            return {}
    return {"spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG4J2}"}


def spark_session(app_name: str = "solaris", master: str | None = None, conf: dict | None = None, *,
                  driver_memory: str | None = None, log_level: str | None = None):
    """Returns a SparkSession (creating one if needed) configured for SOLARIS jobs.

    Args:
        app_name: shown in the Spark UI.
        master: e.g. ``local[2]``, ``spark://host:7077`` or ``sc://host:15002`` (Spark Connect); None keeps an
            existing session's or spark-submit's master, else ``local[*]``.
        conf: extra Spark settings.
        driver_memory: heap of a local driver (in local mode also the executors'); ignored when the JVM runs.
            None: the Settings default.
        log_level: Spark's log level (classic sessions); None: the Settings default.
    """
    from solaris_jobs.core.settings import default_of
    driver_memory = driver_memory or default_of("spark_driver_memory")
    log_level = log_level or default_of("spark_log_level")
    # Python workers must run the interpreter that has the project's packages.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if loopback_only(master or (conf or {}).get("spark.master")):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    # Session settings: what a Spark Connect server's sessions take too. The jobs' results depend on these:
    # they are set on every session, also one that is already running.
    sql = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    }
    # Tuning only (the results do not depend on it): set when the session is created, so that a session already
    # running (a test suite's, a notebook's) keeps its own.
    tuning = {
        # Many small shuffle partitions, coalesced by adaptive execution: less memory per task at scale.
        "spark.sql.shuffle.partitions": "32",
        "spark.sql.adaptive.enabled": "true",
        # Adaptive execution may coalesce the partitions of a cached frame too (Spark keeps a cached plan's 32 by
        # default): the jobs cache small pools and states, then run a Python UDF over them, about 0.3 s of task
        # time per partition however few its rows (select at 10K: 25.5 -> 19.0 s, the same outputs).
        "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
    }
    if master and master.startswith("sc://"):
        # A Spark Connect client: the session is the server's; SOLARIS's jobs need no JVM on this side. (Spark
        # Connect mode holds for the whole Python process: no classic session may exist in it.)
        builder = SparkSession.builder.remote(master).appName(app_name)
        for k, v in {**sql, **tuning, **(conf or {})}.items():
            builder = builder.config(k, v)
        spark = builder.getOrCreate()
        logger.info("Spark Connect session at %s (Spark %s)", master, spark.version)
        return spark
    from pyspark import SparkContext
    # A JVM already running in this process (from any thread: the active session is per thread).
    running = SparkContext._active_spark_context is not None
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    elif not running and "spark.master" not in os.environ.get("SPARK_CONF", ""):
        builder = builder.master(os.environ.get("MASTER", "local[*]"))
    settings = {
        **sql,
        **({} if running else tuning),
        # In local mode the driver is also the executor; ignored when the JVM is already running.
        "spark.driver.memory": driver_memory,
        "spark.ui.showConsoleProgress": "false",
        **({} if running else quiet_start(conf)),
        **(conf or {}),
    }
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    from pyspark.sql.utils import is_remote
    if not is_remote():                  # SPARK_REMOTE in the environment makes even this a Connect session
        spark.sparkContext.setLogLevel(log_level)
    return spark


def parallelism(spark) -> int:
    """The session's default parallelism (Spark Connect: ``spark.default.parallelism``, else the shuffle
    partitions), at least 1."""
    try:
        return max(spark.sparkContext.defaultParallelism, 1)
    except Exception:         # Spark Connect sessions have no SparkContext
        conf = spark.conf.get("spark.default.parallelism", None) or spark.conf.get("spark.sql.shuffle.partitions")
        return max(int(conf), 1)


def event_folders(base, start=None, end=None) -> list[str] | None:
    """What Spark should list of a local event log for events of ``[start, end)``: the day folders
    (``date=YYYY-MM-DD``) that can hold them, or ``[base]`` when that is every day of the log; None when ``base`` is
    not a local folder or holds no day folder (then Spark lists all of it, and fails on what is not a log). Only
    folder names are read here, so a run over a long log lists and opens its lookback's days, not the log. (Days, not hours: passing Spark thousands of folders costs more
    than listing them; the time filter drops the boundary days' other hours.)"""
    import re
    from pathlib import Path
    from urllib.parse import urlparse

    import pandas as pd

    from solaris_jobs.core import events as ev
    text = str(base)
    scheme = urlparse(text).scheme if ":" in text.split("/")[0] else ""
    if scheme not in ("", "file"):
        return None
    root = Path(urlparse(text).path if scheme else text)           # file:/x and file:///x are both /x
    prefix = "file://" if scheme else ""
    if not root.is_dir():
        return None
    days = [d for d in sorted(root.iterdir()) if d.is_dir() and re.fullmatch(ev.DAY_FOLDER, d.name)]
    if not days:
        return None                          # not the contract's layout: Spark reads (and fails on) the folder
    keep = [d for d in days if ev.overlaps(pd.Timestamp(d.name.removeprefix("date="), tz="UTC"), pd.Timedelta(days=1),
                                           start, end)]
    return [prefix + str(root)] if len(keep) == len(days) else [prefix + str(d) for d in keep]


def read_events_df(spark, root: str, start=None, end=None):
    """Events with start <= event_timestamp < end as a Spark DataFrame (partition columns dropped). Of a local log
    only the days of the bounds are listed and read (``event_folders``)."""
    from pyspark.sql import functions as F

    from solaris_jobs.core import events as ev
    base = ev.events_uri(root)
    folders = event_folders(base, start, end)
    if folders is not None and not folders:
        return spark.createDataFrame(ev.EVENT_SCHEMA.empty_table()).select(*ev.EVENT_SCHEMA.names)
    df = spark.read.option("basePath", base).parquet(*(folders if folders is not None else [base]))
    if start is not None:
        s = ev.to_utc(start)
        df = df.where(F.col("date") >= F.lit(s.date())).where(F.col("event_timestamp") >= F.lit(s.to_pydatetime()))
    if end is not None:
        e = ev.to_utc(end)
        df = df.where(F.col("date") <= F.lit(e.date())).where(F.col("event_timestamp") < F.lit(e.to_pydatetime()))
    return df.select(*ev.EVENT_SCHEMA.names)
