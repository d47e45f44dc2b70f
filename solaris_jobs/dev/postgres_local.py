"""A real PostgreSQL server on 127.0.0.1 and a free port, for Airflow's metadata DB under a distributed executor
(``LocalAirflow(executor="celery")``): Debian's ``postgresql`` binaries, a throw-away cluster, stopped and removed
by ``stop()``.

PostgreSQL refuses to run as root: when this process is root, the cluster lives in a folder of its own owned by
the ``postgres`` user and the server runs as that user (``runuser``); its log is copied into ``workdir`` on stop.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from solaris_jobs.core.ports import free_port


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL server binaries (the newest installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise RuntimeError("PostgreSQL's server is not installed (/usr/lib/postgresql/*/bin/postgres): "
                           "apt-get install postgresql (make pgdeps)")
    return Path(found[-1]).parent


class LocalPostgres:
    """``with LocalPostgres(workdir) as pg: pg.url`` -- a SQLAlchemy URL (psycopg2) of database ``airflow``."""

    def __init__(self, workdir: str | os.PathLike, user: str = "airflow", database: str = "airflow"):
        self.workdir = Path(workdir)
        self.user, self.database = user, database
        self.port = free_port()
        self.bin = postgres_bin()
        self.as_root = os.geteuid() == 0
        self.data: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str, **kw) -> subprocess.CompletedProcess:
        cmd = ["runuser", "-u", "postgres", "--", *args] if self.as_root else list(args)
        return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)

    def _checked(self, *args: str) -> None:
        res = self._run(*args, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")

    def start(self, timeout: float = 60) -> "LocalPostgres":
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The cluster's folder: the server's user must own it (and reach it: root's temp folders are not closed).
        self.data = Path(tempfile.mkdtemp(prefix="solaris-pg-"))
        if self.as_root:
            shutil.chown(self.data, "postgres", "postgres")
        try:
            self._checked(str(self.bin / "initdb"), "-D", str(self.data / "db"), "-U", self.user, "--auth=trust",
                          "-E", "UTF8", "--no-sync")
            cmd = [str(self.bin / "postgres"), "-D", str(self.data / "db"), "-p", str(self.port), "-h", "127.0.0.1",
                   "-k", str(self.data), "-c", "fsync=off", "-c", "max_connections=200"]
            if self.as_root:
                cmd = ["runuser", "-u", "postgres", "--", *cmd]
            with open(self.data / "postgres.log", "w") as log:     # the server inherits the descriptor
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while True:
                ready = self._run(str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), timeout=10)
                if ready.returncode == 0:
                    break
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start on 127.0.0.1:{self.port} (exit {self.proc.poll()})")
                time.sleep(0.3)
            self._checked(str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                          "-U", self.user, "-d", "postgres", "-c", f'CREATE DATABASE "{self.database}"')
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            # pg_ctl's fast shutdown (as root the process here is runuser, which would SIGKILL the server 2 s after
            # passing a SIGTERM on); a server that does not stop is killed by its postmaster pid.
            if self.proc.poll() is None:
                res = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data / "db"), "-m", "fast", "-w", "-t", "20",
                                "stop", timeout=60)
                if res.returncode != 0:
                    pid_file = self.data / "db" / "postmaster.pid"
                    if pid_file.exists():
                        try:
                            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        if self.data is not None:
            if (self.data / "postgres.log").exists():
                shutil.copy(self.data / "postgres.log", self.workdir / "postgres.log")
            shutil.rmtree(self.data, ignore_errors=True)
            self.data = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
