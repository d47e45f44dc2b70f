"""A long-lived Spark for the refresh's tasks: a Spark Connect server on 127.0.0.1 and a free port.

``solaris airflow`` starts one beside the scheduler and points the tasks at it (their Spark master ``sc://...``),
so that the four Spark steps of a refresh connect to one running Spark instead of each starting a JVM.

The tasks share one server-side session (``shared_url``: ``sc://host:port/;session_id=<uuid>``, and no task stops
it). Spark Connect gives each session its own Python worker factory: with one session per task every task's
Python workers start afresh (the models load again) and, in Spark 4.3, the server keeps each session's Python
daemon and workers until it stops (measured: 3 more Python processes per session, never released). With the
shared session the workers, and the models they loaded, are reused from task to task, and the process count stays
flat (``tests/test_spark_submit.py``). A deployment runs its cluster's Spark Connect
endpoint instead and sets the Spark master setting to it. The tests use this class too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from solaris_jobs.core.ports import free_port


def local_parallelism(master: str) -> dict:
    """``spark.default.parallelism`` for a local master (its cores: ``local`` 1, ``local[N]`` / ``local[N,F]`` N,
    ``local[*]`` the machine's), else nothing. A Connect client has no SparkContext to ask for the parallelism, so
    the jobs read this setting (``pipeline.spark.parallelism``); unset, they would fall back to the shuffle
    partitions (32) and split e.g. the FM inference into 32 small tasks on 2 cores."""
    import re
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master.strip())
    if not m:
        return {}
    n = m.group(1)
    cores = 1 if n is None else (os.cpu_count() or 1) if n == "*" else int(n)
    return {"spark.default.parallelism": str(max(cores, 1))}


class SparkConnectServer:
    """``spark-submit --class ...SparkConnectServer`` with ``master`` as its Spark (``local[2]`` by default), bound to
    127.0.0.1 on ``port`` (a free one by default); its log is ``<workdir>/connect.log``. Spark Connect mode holds for
    a whole Python process, so clients run in other processes (Airflow's tasks, subprocesses in the tests).
    ``python``: the executors' Python where their hosts have it; ``conf``: further Spark settings (e.g.
    ``spark.submit.pyFiles``: the jobs' code for executors that do not have SOLARIS installed)."""

    def __init__(self, workdir: str | os.PathLike, master: str = "local[2]", driver_memory: str = "2g",
                 port: int | None = None, conf: dict | None = None, python: str | None = None):
        self.workdir = Path(workdir)
        self.master, self.driver_memory = master, driver_memory
        self.port = port or free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        # One session for every client of this server (a session id is a UUID): see the module's docstring.
        self.shared_url = f"{self.url}/;session_id={uuid.uuid4()}"
        self.conf = dict(conf or {})
        # The executors' Python (the server's PYSPARK_PYTHON: Spark Connect runs Python UDFs with it, whatever the
        # client's): this interpreter by default; on a cluster, where the executors' hosts have it.
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "connect.log"

    def start(self, timeout: float = 120) -> "SparkConnectServer":
        """Launches the server and returns when it accepts clients (or raises, the server stopped)."""
        self.launch()
        return self.wait_started(timeout)

    def launch(self) -> "SparkConnectServer":
        """Starts the server's process and returns at once (``wait_started`` waits for it): its JVM and its
        executors come up while the caller does something else."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        submit = str(Path(sys.executable).parent / "spark-submit")
        conf = {"spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": str(self.port),
                "spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1",
                **local_parallelism(self.master), **self.conf}
        args = [submit, "--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", self.master,
                *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")], "--driver-memory", self.driver_memory,
                "spark-internal"]
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": self.python}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_started(self, timeout: float = 120) -> "SparkConnectServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "Spark Connect server started" in self.log.read_text(errors="replace"):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Spark Connect server exited ({self.proc.returncode}):\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Spark Connect server did not start within {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (Python workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
