"""Airflow for real on one machine: API server (with the UI), scheduler, DAG processor and triggerer as separate
processes, LocalExecutor, SQLite metadata DB under ``home``, bound to 127.0.0.1. Used by ``solaris airflow``
(``make airflow``) and by the test that triggers the refresh DAG through the REST API.

With ``spark_connect=True`` a Spark Connect server starts first (``solaris_jobs.dev.spark_connect``) and every
Airflow process gets it as the Spark master setting (``sc://...``): the refresh's Spark steps then share one
long-lived Spark instead of each task starting its own JVM. Its master and driver memory are the ``spark_master``
(a ``local[...]`` or cluster master; default ``local[*]``, as for tasks without it) and ``spark_driver_memory``
settings' variables in ``env``;
the tasks share one session of it (``SparkConnectServer.shared_url``), so its Python workers and their models are
reused from task to task.

With ``executor="celery"`` it is the production topology on one machine: CeleryExecutor with a Redis broker
(``broker_url``) and a Postgres metadata DB (``metadata_db``, e.g. ``solaris_jobs.dev.postgres_local``); the
scheduler queues tasks and Celery workers, started one by one with ``start_worker`` (each its own queues and
concurrency, as on separate hosts), run them. ``fm_pool_slots`` creates the FM task's pool (named by
``settings.FM_POOL_ENV``).
``spark_conf`` and ``spark_python`` go to the Spark Connect server (its settings; its executors' Python, where a
cluster's hosts have it).

Production deployments use Airflow's own deployment (Postgres, Celery or Kubernetes executor) and their cluster's
Spark (Connect) endpoint; this is the project's DAGs under the real services, for trying them out and for tests.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from solaris_jobs.core.settings import FM_POOL_ENV, PROJECT_ROOT, env_var
from solaris_jobs.core.ports import free_port

DAGS = PROJECT_ROOT / "dags"
# sqlite3's connect arguments for the metadata DB (AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS names this): wait
# up to 30 s for another process's write lock instead of the default 5 s, so that the CLI (`airflow backfill
# create`) and the API server do not fail with "database is locked" while the scheduler writes.
SQLITE_CONNECT_ARGS = {"timeout": 30}
# The services `start` runs (each its own process); an API server alone shows an existing metadata DB (runs made by
# dag.test(), say) in the UI and the REST API without scheduling anything.
SERVICES = ("api-server", "scheduler", "dag-processor", "triggerer")
EXECUTORS = {"local": "LocalExecutor", "celery": "CeleryExecutor"}


WORKER_NAME_ENV = "LOCAL_AIRFLOW_WORKER"       # a worker's name, as its host name (dev only)


def worker_hostname() -> str:
    """The host name a worker of ``start_worker`` reports (Airflow's ``[core] hostname_callable``): its own name, as
    if it ran on a host of its own, so a task instance shows which worker ran it."""
    import socket
    return os.environ.get(WORKER_NAME_ENV) or socket.getfqdn()


def _tree(proc: subprocess.Popen) -> list:
    """``proc`` and every process under it, as psutil processes (each knows its start time: a signal never reaches
    a later process that reused a pid)."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(procs: list, sig: int) -> None:
    """``sig`` to each process still running (a task may have started a process group of its own)."""
    import psutil
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class LocalAirflow:
    def __init__(self, home: str | os.PathLike, port: int | None = None, env: dict | None = None,
                 user: str = "admin", password: str | None = None, parallelism: int = 4,
                 spark_connect: bool = False, dags_folder: str | os.PathLike | None = None,
                 services: tuple[str, ...] = SERVICES, executor: str = "local", metadata_db: str | None = None,
                 broker_url: str | None = None, fm_pool_slots: int | None = None, spark_conf: dict | None = None,
                 spark_python: str | None = None):
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {sorted(EXECUTORS)}, not {executor!r}")
        if executor == "celery" and (not broker_url or not metadata_db or metadata_db.startswith("sqlite")):
            raise ValueError("executor='celery' runs tasks on several workers: it needs broker_url (a Redis URL) and "
                             "metadata_db, a SQLAlchemy URL of a server database (Postgres), not SQLite")
        self.executor, self.metadata_db, self.broker_url = executor, metadata_db, broker_url
        self.fm_pool_slots = fm_pool_slots
        self.workers: dict[str, subprocess.Popen] = {}
        unknown = set(services) - set(SERVICES)
        if unknown or "api-server" not in services:
            raise ValueError(f"services must include api-server and be among {SERVICES}, not {sorted(unknown)}")
        self.services = tuple(services)
        self.home = Path(home).resolve()
        self.dags_folder = Path(dags_folder).resolve() if dags_folder else DAGS
        self.port = port or free_port()
        self.user, self.password = user, password or secrets.token_urlsafe(12)
        self.extra_env = dict(env or {})
        self.parallelism = parallelism
        self.procs: list[subprocess.Popen] = []
        self._token = None
        self.spark = None
        if spark_connect:
            from solaris_jobs.dev.spark_connect import SparkConnectServer
            given = {**os.environ, **self.extra_env}
            master = given.get(env_var("spark_master")) or "local[*]"
            if master.startswith("sc://"):
                raise ValueError(f"{env_var('spark_master')} is already a Spark Connect endpoint ({master}): "
                                 f"use it without spark_connect")
            memory = given.get(env_var("spark_driver_memory")) or "2g"
            self.spark = SparkConnectServer(self.home / "spark-connect", master=master, driver_memory=memory,
                                            conf=spark_conf, python=spark_python)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _db_env(self) -> dict:
        if self.metadata_db is None:
            return {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.SQLITE_CONNECT_ARGS"}
        out = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.metadata_db}
        if self.executor == "celery":
            out.update({"AIRFLOW__CELERY__BROKER_URL": self.broker_url,
                        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.metadata_db,
                        # a message of a task killed with its worker is redelivered after this (Airflow's default
                        # is 24 h); the scheduler's heartbeat timeout fails and retries the task long before
                        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "21600"})
        return out

    def env(self) -> dict:
        bin_dir = str(Path(sys.executable).parent)
        return {**os.environ, **self.extra_env,
                "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": EXECUTORS[self.executor],
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                **self._db_env(),
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__BASE_URL": self.url,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                "AIRFLOW__API_AUTH__JWT_SECRET": self._secret(),
                "AIRFLOW__CORE__AUTH_MANAGER":
                    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.user}:admin",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
                **({env_var("spark_master"): self.spark.shared_url} if self.spark is not None else {})}

    def _secret(self) -> str:
        path = self.home / "jwt_secret"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(32))
        return path.read_text()

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "w")
        p = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), *args], stdout=log,
                             stderr=subprocess.STDOUT, env={**self.env(), **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self, timeout: float = 120) -> "LocalAirflow":
        """Starts the Spark Connect server (if asked), migrates the DB and starts the services; on any failure
        (Ctrl-C included) stops whatever it started and raises."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> "LocalAirflow":
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({self.user: self.password}))
        if self.spark is not None:
            self.spark.launch()                   # its JVM and executors come up while the DB is migrated
        res = self.cli("db", "migrate", timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        pool = self.extra_env.get(FM_POOL_ENV)
        if self.fm_pool_slots is not None:
            if not pool:
                raise ValueError(f"fm_pool_slots needs the pool's name in env ({FM_POOL_ENV})")
            self.cli_checked("pools", "set", pool, str(self.fm_pool_slots), "SOLARIS FM inference (GPU workers)")
        args = {"api-server": ["api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                "scheduler": ["scheduler", "--skip-serve-logs"], "dag-processor": ["dag-processor"],
                "triggerer": ["triggerer", "--skip-serve-logs"]}
        for name in self.services:
            self._spawn(name, args[name])
        if self.spark is not None:
            self.spark.wait_started()
        # Healthy: the scheduler's heartbeat when one runs, else the API server's metadata DB.
        watch = "scheduler" if "scheduler" in self.services else "metadatabase"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"an Airflow service exited ({p.args}); logs in {self.home}")
            try:
                health = self._request("GET", "/api/v2/monitor/health", auth=False)
                if health.get(watch, {}).get("status") == "healthy":
                    return self
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"Airflow did not become healthy within {timeout:.0f}s; logs in {self.home}")

    def start_worker(self, name: str, queues: tuple[str, ...] = ("default",), concurrency: int = 2,
                     timeout: float = 120, wait: bool = True) -> subprocess.Popen:
        """A Celery worker (``executor="celery"``) serving ``queues``, as on a host of its own (its task instances
        report ``name`` as their host name); returns when it has joined the broker (at once with ``wait=False``:
        ``wait_worker`` waits, so several workers start together). Its log is ``<home>/worker-<name>.log``."""
        if self.executor != "celery":
            raise ValueError("Celery workers run under executor='celery'")
        p = self._spawn(f"worker-{name}", ["celery", "worker", "--celery-hostname", f"{name}@%h", "--queues",
                                            ",".join(queues), "--concurrency", str(concurrency), "--skip-serve-logs",
                                            "--without-gossip", "--without-mingle",
                                            "--pid", str(self.home / f"worker-{name}.pid")],
                        env={WORKER_NAME_ENV: name, "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{__name__}.worker_hostname"})
        self.workers[name] = p
        return self.wait_worker(name, timeout) if wait else p

    def wait_worker(self, name: str, timeout: float = 120) -> subprocess.Popen:
        """Returns when worker ``name`` has joined the broker; raises if it exits or ``timeout`` passes first."""
        p, log = self.workers[name], self.home / f"worker-{name}.log"
        deadline = time.monotonic() + timeout
        while " ready." not in (log.read_text() if log.exists() else ""):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Celery worker {name} did not start (exit {p.poll()}); see {log}")
            time.sleep(0.5)
        return p

    def kill_worker(self, name: str) -> None:
        """SIGKILL of a worker and every process under it (its running tasks too), as when its host dies."""
        p = self.workers.pop(name)
        _kill_tree(_tree(p), signal.SIGKILL)
        p.wait(30)
        self.procs.remove(p)
        (self.home / f"worker-{name}.pid").unlink(missing_ok=True)

    def cli_checked(self, *args: str, timeout: float = 300) -> str:
        """``airflow <args>``; raises with its output when it fails."""
        res = self.cli(*args, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(args)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        return res.stdout

    def _request(self, method: str, path: str, body=None, auth: bool = True) -> dict:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        return json.loads(text) if text else {}

    def token(self) -> str:
        if self._token is None:
            self._token = self._request("POST", "/auth/token", {"username": self.user, "password": self.password},
                                        auth=False)["access_token"]
        return self._token

    def api(self, method: str, path: str, body=None) -> dict:
        return self._request(method, path, body)

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.api("GET", f"/api/v2/dags/{dag_id}")
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            time.sleep(2)
        raise RuntimeError(f"DAG {dag_id} was not parsed within {timeout:.0f}s; see {self.home}/dag-processor.log")

    def trigger(self, dag_id: str, logical_date: str, data_interval_end: str | None = None) -> str:
        """Unpauses the DAG and creates a run for ``logical_date``; returns the run id."""
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        body = {"logical_date": logical_date}
        if data_interval_end:
            body.update(data_interval_start=logical_date, data_interval_end=data_interval_end)
        return self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)["dag_run_id"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 900) -> str:
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(3)
        raise TimeoutError(f"run {run_id} of {dag_id} still {state} after {timeout:.0f}s")

    def cli(self, *args: str, timeout: float = 300, attempts: int = 4) -> subprocess.CompletedProcess:
        """``airflow <args>`` against this installation (e.g. ``backfill create --dag-id ...``).

        SQLite answers "database is locked" at once, whatever the busy timeout, when a transaction that has read
        wants to write while the scheduler holds the write lock (waiting could deadlock). Airflow rolls such a
        command back (``backfill create`` deletes its partial backfill for that reason, so that it can be
        retried), so the command is run again, up to ``attempts`` times; any other failure is returned as is."""
        for attempt in range(attempts):
            res = subprocess.run([str(Path(sys.executable).parent / "airflow"), *args], env=self.env(),
                                 capture_output=True, text=True, timeout=timeout)
            if res.returncode == 0 or "database is locked" not in res.stdout + res.stderr:
                return res
            time.sleep(1 + attempt)
        return res

    def runs(self, dag_id: str, run_type: str | None = None) -> list[dict]:
        q = f"?run_type={run_type}" if run_type else ""
        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns{q}")["dag_runs"]

    def task_instances(self, dag_id: str, run_id: str) -> dict:
        """{task id: the task instance as the REST API gives it (state, try_number, hostname, queue, pool, ...)}."""
        tis = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {t["task_id"]: t for t in tis}

    def task_states(self, dag_id: str, run_id: str) -> dict:
        return {t: ti["state"] for t, ti in self.task_instances(dag_id, run_id).items()}

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of each service's (and worker's) process group and descendants (a running task
        ignores SIGTERM); then the Spark Connect server, if this started one."""
        live = [p for p in self.procs if p.poll() is None]
        trees = {p.pid: _tree(p) for p in live}           # listed before any dies (orphans are re-parented)
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_tree(trees[p.pid], signal.SIGKILL)
            p.wait(10)
        self.procs.clear()
        self.workers.clear()
        if self.spark is not None:
            self.spark.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
