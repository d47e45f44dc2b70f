"""What the tests (and the benchmarks) share: real servers on 127.0.0.1 and a free port picked at run time, stopped
afterwards (Redis, Redis Cluster, Spark standalone, an S3-API server; Spark Connect is ``solaris_jobs.dev.spark_connect``);
comparing offline outputs row for row (``python -m tests.support A B`` compares two offline stores); tiny models;
the MovieLens test interval.
Fixtures live in ``conftest.py``; tests import helpers from here, never from ``conftest``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from solaris_jobs.core import offline as off
from solaris_jobs.core.settings import PrecomputeConfig, SimulatorConfig
from solaris_jobs.core.ports import free_port
from solaris_jobs.online.local_redis import LocalRedis, stop_process, wait_for
from solaris_jobs.dev.spark_connect import SparkConnectServer  # noqa: F401  (the tests' Spark Connect)

# ------------------------------------------------------------------------------------------------ MovieLens interval

ML_END = pd.Timestamp("1998-03-01T00:00:00Z")
ML_START = ML_END - pd.Timedelta(hours=1)
# A 30-day lookback (as the DAG tests use): the reference computations in the tests read the same window
# (ML_LOOKBACK_START), not the whole 7-month log.
# The per-user top share (not the defaults' budget): the MovieLens tests check that path's selection, exclusion and
# forced misses, and what the DAGs, spark-submit and the stores do with any selection.
ML_CFG = PrecomputeConfig.per_user_share(lookback_days=30, active_hours=24 * 14, history_len=10, batch_size=256,
                                         simulator=SimulatorConfig().with_candidates(60))
ML_LOOKBACK_START = ML_END - pd.Timedelta(days=ML_CFG.lookback_days)


def dag_precompute_json(lookback_days: int = ML_CFG.lookback_days) -> str:
    """``SOLARIS_PRECOMPUTE`` of the tests that run the refresh DAG: users active in the last 2 days (ML_CFG's 2
    weeks selects ~6x the pairs), so an interval takes about half the time. ``lookback_days``: the first interval
    rebuilds its state from this many days of the log (hourly files: MovieLens's last 30 days are 299 of them, its
    last week 79)."""
    c = ML_CFG
    return json.dumps({"lookback_days": lookback_days, "active_hours": 48, "history_len": c.history_len,
                       "batch_size": c.batch_size, "budget_per_row": c.budget_per_row, "recent_hours": c.recent_hours,
                       "select_priority": c.select_priority, "exclusion_runs": c.exclusion_runs,
                       "simulator": {"n_candidates": c.simulator.n_candidates, "n_popular": c.simulator.n_popular}})


def train_tiny_models(root, out, history_len=10, max_train_rows=20_000):
    """Small FM, AE and VM checkpoints (seconds to train) for the pipeline tests: fm.pt, ae.pt, vm.pt."""
    from solaris_jobs.learning import training
    data = training.load_dataset(str(root), history_len=history_len, max_train_rows=max_train_rows)
    cfg = training.TrainConfig(epochs=1, history_len=history_len, max_train_rows=max_train_rows)
    training.train_fm(data, out / "fm.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    training.train_ae(data, out / "fm.pt", out / "ae.pt", cfg, d_code=8)
    training.train_verifier(data, out / "vm.pt", cfg)
    return out


# ------------------------------------------------------------------------------------------------ servers

def feast_yaml(path: Path, online: str, registry: Path | None = None) -> Path:
    """Writes a feature_store.yaml for project solaris: ``online`` is the indented body of ``online_store:``."""
    path.write_text(f"project: solaris\nprovider: local\nregistry: {registry or path.parent / 'registry.db'}\n"
                    f"online_store:\n{online}\noffline_store:\n  type: file\nentity_key_serialization_version: 3\n")
    return path


class SparkStandalone:
    """A Spark standalone master and one worker on loopback: a real cluster deployment on one machine. ``gpus``: the
    GPU addresses the worker's discovery script reports (fake ones on a machine without GPUs: Spark schedules
    them as resources without touching a device).

    ``hide``: folders the worker must not see, as on a host of its own: it runs in a mount namespace of its own
    (``unshare -m``) with an empty tmpfs over each (the driver's project, venv and artifacts). Its Python is then this
    venv bound at another path (``worker_python``: the same packages installed elsewhere, as on another host, with
    no SOLARIS on its path); ``worker_env`` is added to its environment (and its executors'), e.g. the object
    store's settings, and ``PYTHONPATH`` with SOLARIS's code as the worker's host has it installed
    (``project_zip``)."""

    def __init__(self, workdir: Path, cores: int = 2, memory: str = "2g", gpus: tuple[str, ...] = (),
                 hide: tuple[Path, ...] = (), worker_env: dict | None = None):
        self.workdir = Path(workdir)
        self.port, self.ui, self.worker_ui = free_port(), free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.cores, self.memory, self.gpus = cores, memory, tuple(gpus)
        self.hide = tuple(Path(h).resolve() for h in hide)
        self.worker_env = dict(worker_env or {})
        self.worker_root = self.workdir / "worker-root"          # the worker's own view: its venv is bound here
        self.procs: list[subprocess.Popen] = []

    @property
    def worker_python(self) -> str:
        """The executors' Python: this venv where the isolated worker sees it (else this interpreter)."""
        return str(self.worker_root / "venv" / "bin" / "python") if self.hide else sys.executable

    def env(self) -> dict:
        out = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_MASTER_HOST": "127.0.0.1",
               "SPARK_WORKER_DIR": str(self.workdir / "work"), "SPARK_LOG_DIR": str(self.workdir / "logs"),
               "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        if self.gpus:
            script = self.workdir / "gpus.sh"
            script.write_text("#!/bin/sh\necho '%s'\n" % json.dumps({"name": "gpu", "addresses": list(self.gpus)}))
            script.chmod(0o755)
            out["SPARK_WORKER_OPTS"] = (f"-Dspark.worker.resource.gpu.amount={len(self.gpus)} "
                                        f"-Dspark.worker.resource.gpu.discoveryScript={script}")
        return out

    def _spark_class(self) -> str:
        spark_class = shutil.which("spark-class", path=str(Path(sys.executable).parent))
        if spark_class is None:
            raise RuntimeError("spark-class not found beside the interpreter: is pyspark installed in this venv?")
        return spark_class

    def _start(self, cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
        out = open(log, "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _worker_cmd(self, args: list[str]) -> tuple[list[str], dict]:
        """The worker's command and environment: as is, or isolated (``hide``) in a mount namespace of its own."""
        env = {**self.env(), **self.worker_env}
        if not self.hide:
            return [self._spark_class(), "org.apache.spark.deploy.worker.Worker", *args], env
        if shutil.which("unshare") is None or os.geteuid() != 0:
            raise RuntimeError("an isolated Spark worker needs unshare (util-linux) and root (a mount namespace)")
        venv = Path(sys.prefix).resolve()
        bound = self.worker_root / "venv"
        # The same path in both views: here a link to this venv (the Spark Connect driver hands its executors a
        # Python by path and checks it itself); in the worker's namespace, a tmpfs over worker_root with this venv
        # bound at it before the tmpfs hides the original.
        self.worker_root.mkdir(parents=True, exist_ok=True)
        if not bound.is_symlink():
            bound.symlink_to(venv, target_is_directory=True)
        import pyspark
        spark_home = bound / Path(pyspark.__file__).resolve().parent.relative_to(venv)
        env.update(PYSPARK_PYTHON=str(bound / "bin" / "python"), PYSPARK_DRIVER_PYTHON=str(bound / "bin" / "python"),
                   SPARK_HOME=str(spark_home), PYTHONPATH=self.worker_env.get("PYTHONPATH", ""), VIRTUAL_ENV=str(bound),
                   PATH=f"{bound / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        hide = " ".join(f"mount -t tmpfs -o size=1m tmpfs '{h}' &&" for h in self.hide)
        script = (f"mount --make-rprivate / && mount -t tmpfs -o size=1m tmpfs '{self.worker_root}' && "
                  f"mkdir '{bound}' && mount --bind '{venv}' '{bound}' && {hide} "
                  f"exec '{spark_home}/bin/spark-class' org.apache.spark.deploy.worker.Worker \"$@\"")
        return ["unshare", "-m", "sh", "-c", script, "worker", *args], env

    def __enter__(self):
        try:
            return self._up()
        except BaseException:
            self.__exit__()                       # the master stopped too when the worker did not come up
            raise

    def _up(self) -> "SparkStandalone":
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        mlog, wlog = self.workdir / "master.log", self.workdir / "worker.log"
        self._start([self._spark_class(), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                     str(self.port), "--webui-port", str(self.ui)], mlog, self.env())
        wait_for(lambda: "I have been elected leader" in mlog.read_text(), 90, "Spark master", mlog)
        cmd, env = self._worker_cmd([self.url, "--host", "127.0.0.1", "--webui-port", str(self.worker_ui), "--cores",
                                     str(self.cores), "--memory", self.memory, "--work-dir",
                                     str(self.workdir / "work")])
        self._start(cmd, wlog, env)
        wait_for(lambda: "Successfully registered with master" in wlog.read_text(), 90, "Spark worker", wlog)
        return self

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            stop_process(p)


def enter_together(stack, *servers) -> list:
    """Starts ``servers`` (context managers whose exit is safe to call on a half-started or stopped one) at once, each
    in a thread, and registers their exits on ``stack`` (a ``contextlib.ExitStack``), all of them, even when one fails
    to start (then the first failure is raised). Returns what each ``__enter__`` returned, in order."""
    from concurrent.futures import ThreadPoolExecutor
    for server in servers:
        stack.push(server.__exit__)
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
    return [f.result() for f in futures]


class _Server:
    """A server process of the tests (``self.proc``, started by ``start``): stopped by ``stop`` or on leaving
    ``with``."""
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class RedisServer(LocalRedis):
    """``LocalRedis`` (a real ``redis-server`` on 127.0.0.1 and a free port, no persistence; ``stop()``/``start()``
    mid-test). With ``tls_dir`` it speaks only TLS (a self-signed certificate for 127.0.0.1 made there,
    ``tls_dir/cert.pem``); with ``password`` it requires AUTH. ``connection_string`` is what a feature_store.yaml
    names it by."""

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple = (), tls_dir: Path | None = None,
                 password: str | None = None):
        super().__init__(workdir, port, extra)
        self.tls_dir, self.password = (Path(tls_dir) if tls_dir else None), password

    @property
    def connection_string(self) -> str:
        out = self.url
        if self.password:
            out += f",password={self.password}"
        if self.tls_dir:
            out += f",ssl=true,ssl_ca_certs={self.tls_dir / 'cert.pem'}"
        return out

    def _args(self) -> list[str]:
        if self.tls_dir is None:
            args = ["--port", str(self.port)]
        else:
            self_signed_cert(self.tls_dir)
            args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls_dir / "cert.pem"),
                    "--tls-key-file", str(self.tls_dir / "key.pem"), "--tls-ca-cert-file",
                    str(self.tls_dir / "cert.pem"), "--tls-auth-clients", "no"]
        return args + (["--requirepass", self.password] if self.password else [])

    def _up(self) -> bool:
        if not (self.tls_dir or self.password):
            return super()._up()
        try:
            with socket.create_connection(("127.0.0.1", self.port), 0.2):
                return True                           # it listens; the test's own client says the rest
        except OSError:
            return False


# ------------------------------------------------------------------------------------------------ Feast, browser

FEATURE_REPO = Path(__file__).resolve().parent.parent / "feature_repo"


def feast_repo(workdir: Path, env: dict) -> tuple[Path, dict, callable]:
    """A copy of the project's Feast repo under ``workdir`` (its own SQLite registry and online store), ``feast
    apply``-ed with ``env`` on top of the environment: (repo, the environment, ``feast(*args)`` running the stock
    CLI there)."""
    repo = Path(workdir) / "repo"
    shutil.copytree(FEATURE_REPO, repo, ignore=shutil.ignore_patterns("data", "__pycache__"))
    full = {**os.environ, "PYTHONPATH": str(FEATURE_REPO.parent), **env}
    full.pop("FEAST_FS_YAML_FILE_PATH", None)
    exe = [str(Path(sys.executable).parent / "feast"), "--chdir", str(repo)]

    def feast(*args, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*exe, *args], env=full, capture_output=True, text=True, timeout=timeout)
    res = feast("apply")
    if res.returncode != 0:
        raise RuntimeError(f"feast apply failed:\n{res.stderr[-3000:]}")
    return repo, full, feast


class FeastUI(_Server):
    """``feast ui`` (the stock Feast web UI) over a repo, on 127.0.0.1 and a free port."""

    def __init__(self, repo: Path, env: dict):
        self.repo, self.env, self.port = Path(repo), env, free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "FeastUI":
        import urllib.request
        log = self.repo / "feast-ui.log"
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "feast"), "--chdir", str(self.repo), "ui",
                                      "-h", "127.0.0.1", "-p", str(self.port)], env=self.env,
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"feast ui exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(up, 120, "feast ui", log)
        return self


def headless_chromium(width: int = 1400, height: int = 900):
    """Debian's chromium through its chromedriver (Selenium), headless. Raises, not skips, when either is missing
    (``make browserdeps``, part of ``make test``, installs them)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        raise RuntimeError("chromium and chromedriver are needed for the browser test (make browserdeps, or apt-get "
                           "install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--window-size={width},{height}"):
        opts.add_argument(a)
    opts.binary_location = browser
    return webdriver.Chrome(options=opts, service=Service(driver))


def wait_for_text(browser, needles, timeout: float = 60, until=None) -> str:
    """The page's visible text once it contains every one of ``needles`` (a single-page app renders late);
    ``until()`` is called between looks (e.g. to unfold what rendered folded); raises with what it shows instead."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = browser.find_element("tag name", "body").text
        if all(n in text for n in needles):
            return text
        if until is not None:
            until()
        time.sleep(0.5)
    missing = [n for n in needles if n not in text]
    raise AssertionError(f"{browser.current_url} never showed {missing}; it shows:\n{text[:3000]}")


def self_signed_cert(folder: Path) -> None:
    """``cert.pem`` and ``key.pem`` in ``folder``: a one-day self-signed certificate for 127.0.0.1 (made with
    ``cryptography``, already a dependency)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    folder = Path(folder)
    if (folder / "cert.pem").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                                       serialization.NoEncryption()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class S3Server(_Server):
    """An S3-API server on 127.0.0.1 and a free port: moto's server mode, from its own venv (``.venv-s3``, made by
    ``make test``; see requirements-s3.txt). ``env`` holds the standard AWS settings that point pyarrow (and so
    every SOLARIS step outside Spark) at it; ``bucket(name)`` creates a bucket."""

    VENV = Path(__file__).resolve().parent.parent / ".venv-s3"

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "solaris-test",
                "AWS_SECRET_ACCESS_KEY": "solaris-test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self) -> "S3Server":
        exe = self.VENV / "bin" / "python"
        if not exe.exists():
            raise RuntimeError(f"{exe}: no S3 test server (make test makes {self.VENV.name} from requirements-s3.txt)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "moto.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(exe), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def up():
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2):
                    return True
            except OSError:
                return False
        wait_for(up, 30, "moto S3 server", log)
        return self

    def bucket(self, name: str) -> str:
        import pyarrow.fs as pafs
        pafs.S3FileSystem(endpoint_override=self.endpoint, access_key="solaris-test", secret_key="solaris-test",
                          region="us-east-1", allow_bucket_creation=True).create_dir(name)
        return name



def _free_cluster_port() -> int:
    """A free port p whose cluster bus port p + 10000 is free too."""
    for _ in range(100):
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterServer:
    """A real Redis Cluster of ``n`` primaries on 127.0.0.1 and free ports, created with redis-cli; ``replicas``
    replicas per primary (a failover takes over a killed primary's slots after ``node_timeout_ms``)."""

    def __init__(self, workdir: Path, n: int = 3, replicas: int = 0, node_timeout_ms: int = 5000):
        self.workdir, self.n, self.replicas = Path(workdir), n, replicas
        self.nodes = [RedisServer(self.workdir / f"node{i}", _free_cluster_port(),
                                  extra=("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf",
                                         "--cluster-node-timeout", str(node_timeout_ms)))
                      for i in range(n * (1 + replicas))]

    @property
    def url(self) -> str:
        """The startup nodes: the primaries as created (a failover moves the role, not the list)."""
        return ",".join(node.url for node in self.nodes[:self.n])

    def roles(self) -> dict[int, tuple[str, int | None]]:
        """{port: (role, port of its primary or None)} as the live nodes see the cluster now (``CLUSTER NODES``);
        a failed node shows as ``fail``."""
        import redis as redis_py
        out = {}
        for node in self.nodes:
            try:
                text = redis_py.Redis(port=node.port, socket_timeout=2).execute_command("CLUSTER NODES")
            except redis_py.RedisError:
                continue
            nodes = {info["node_id"]: (int(addr.split("@")[0].rsplit(":", 1)[1]), info) for addr, info in text.items()}
            for port, info in nodes.values():
                flags = info["flags"].split(",")
                role = "fail" if "fail" in flags else "primary" if "master" in flags else "replica"
                primary = nodes.get(info.get("master_id"))
                out[port] = (role, primary[0] if primary else None)
            break
        return out

    def __enter__(self):
        try:
            return self._start()
        except BaseException:
            self.__exit__()                       # nothing left running when the cluster did not come up
            raise

    def _start(self) -> "RedisClusterServer":
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
        res = subprocess.run([cli, "--cluster", "create", *[n.url for n in self.nodes], "--cluster-replicas",
                              str(self.replicas), "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{res.stdout}\n{res.stderr}")

        def ok():
            for node in self.nodes:
                out = subprocess.run([cli, "-p", str(node.port), "cluster", "info"], capture_output=True, text=True)
                if "cluster_state:ok" not in out.stdout:
                    return False
            # every replica in sync with its primary (a replica that never synced does not fail over)
            import redis as redis_py
            return all(redis_py.Redis(port=node.port).info("replication").get("master_link_status") == "up"
                       for node in self.nodes if self.roles().get(node.port, ("",))[0] == "replica") and \
                sum(r == "replica" for r, _ in self.roles().values()) == self.n * self.replicas
        wait_for(ok, 30, "redis cluster")
        return self

    def __exit__(self, *exc):
        for node in self.nodes:
            node.stop()


# ------------------------------------------------------------------------------------------------ outputs

def read_sorted(offline, dataset: str, end) -> pd.DataFrame:
    """One interval's published output through the layout module, rows sorted by every column that is not an
    array (keys first), so that equal outputs compare equal whatever order their files and rows came in."""
    df = off.read_table(offline, dataset, end).to_pandas()
    if not len(df):
        return df
    scalar = [c for c in df.columns if not isinstance(df[c].iloc[0], (np.ndarray, list))]
    key = [c for c in ("user_id", "item_id") if c in scalar] + [c for c in scalar if c not in ("user_id", "item_id")]
    return df.sort_values(key, kind="mergesort").reset_index(drop=True)


def assert_same_frames(x: pd.DataFrame, y: pd.DataFrame, name: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Same columns and rows; array columns within ``rtol``/``atol`` (exactly equal by default)."""
    assert list(x.columns) == list(y.columns), (name, list(x.columns), list(y.columns))
    assert x.shape == y.shape, (name, x.shape, y.shape)
    for c in x.columns:
        if len(x) and isinstance(x[c].iloc[0], (np.ndarray, list)):
            assert [len(v) for v in x[c]] == [len(v) for v in y[c]], (name, c)
            if sum(len(v) for v in x[c]):
                np.testing.assert_allclose(np.concatenate(x[c].to_list()), np.concatenate(y[c].to_list()),
                                           rtol=rtol, atol=atol, err_msg=f"{name}.{c}")
        else:
            pd.testing.assert_series_equal(x[c], y[c], check_names=False, obj=f"{name}.{c}")


def assert_same_outputs(a, b, end, datasets=off.DATASETS, rtol: float = 0.0, atol: float = 0.0) -> dict:
    """Asserts that two offline stores hold the same rows for the interval ending ``end``; returns the row counts
    per dataset."""
    counts = {}
    for d in datasets:
        x = read_sorted(a, d, end)
        assert_same_frames(x, read_sorted(b, d, end), d, rtol, atol)
        counts[d] = len(x)
    return counts


def main(argv=None) -> None:
    """``python -m tests.support A B``: compares every interval of every dataset two offline stores hold (either
    layout), rows sorted, exactly; a dataset only one holds must be empty there. Prints the row counts."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    for d in off.DATASETS:
        ends_a, ends_b = off.list_intervals(args.a, d), off.list_intervals(args.b, d)
        for e in sorted(set(ends_a) | set(ends_b)):
            if e in ends_a and e in ends_b:
                n = assert_same_outputs(args.a, args.b, e, [d])[d]
                print(f"{d:18s} {e.isoformat()}  {n:7d} rows, identical")
            else:
                only, store = (args.a, "a") if e in ends_a else (args.b, "b")
                if d in (*off.STATE_DATASETS, *off.SIMULATOR_STATE):  # a cache of the log older versions did not write
                    print(f"{d:18s} {e.isoformat()}  only in {store} (the interval's state), not compared")
                    continue
                n = off.read_table(only, d, e).num_rows
                assert n == 0, f"{d} {e}: {n} rows only in {store}"
                print(f"{d:18s} {e.isoformat()}  only in {store}, empty")


if __name__ == "__main__":
    main()


def processes_with_env(key: str, value: str) -> list[int]:
    """PIDs of the live processes whose environment has ``key=value`` (e.g. every service and worker of one
    ``AIRFLOW_HOME``, whatever session or parent it has)."""
    want = f"{key}={value}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if want in env and "zombie" not in state:
            out.append(int(d.name))
    return out


# ------------------------------------------------------------------------------------------------ a user's own FM

def save_user_fm(model, path, trained_until: str | None = "2026-01-07T00:00:00+00:00") -> None:
    """Writes an FM the way a user's own code might: a plain ``torch.save`` of its config and weights, not a SOLARIS
    checkpoint (no kind, format or version), with the end of its training data (None: not declared)."""
    import dataclasses

    import torch
    torch.save({"config": dataclasses.asdict(model.cfg), "weights": model.state_dict(),
                "trained_until": trained_until}, path)


def user_fm(path, map_location="cpu"):
    """The factory of that user's FM (``tests.support:user_fm``): builds it from the plain file, as it is; it keeps
    ``models.protocol`` (the recurrent family's class, wrapped, so that it is none of SOLARIS's own classes)."""
    import torch

    from models.gru4rec import GRU4RecFM, GRUConfig

    class UserFM(GRU4RecFM):
        pass
    state = torch.load(path, map_location=map_location, weights_only=True)
    model = UserFM(GRUConfig(**state["config"]))
    model.load_state_dict(state["weights"])
    if state["trained_until"] is not None:
        model.trained_until = state["trained_until"]
    return model.to(map_location)


def project_zip(dest: Path) -> Path:
    """This project's packages (``solaris_jobs``, ``models``, ``spark_jobs``) as one zip: SOLARIS's code as an
    isolated Spark worker's host has it installed (on its ``PYTHONPATH``), or for spark-submit's ``--py-files``."""
    import zipfile
    root = Path(__file__).resolve().parent.parent
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for pkg in ("solaris_jobs", "models", "spark_jobs"):
            for f in sorted((root / pkg).rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    z.write(f, f.relative_to(root))
    return dest
