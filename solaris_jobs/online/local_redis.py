"""A local ``redis-server`` for one process's lifetime: 127.0.0.1, a free port picked at run time, no persistence.

The replay evaluation serves its logged requests from one (the production store kind, read by ``FeatureReader`` with
its production budget, misses through the Redis stream); the tests start theirs with the same class
(``tests/support.py``'s ``RedisServer`` adds TLS and a password). Debian's ``redis-server`` (``make sysdeps``).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from solaris_jobs.core.ports import free_port


def wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    """Polls ``predicate`` until true; after ``timeout`` seconds a ``RuntimeError`` with the log's tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{what} did not come up within {timeout:.0f}s\n{tail}")


def stop_process(proc: subprocess.Popen) -> None:
    """Stops a server started in its own process group (SIGTERM, then SIGKILL)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


class LocalRedis:
    """``redis-server`` on 127.0.0.1 and a free port, its files and log under ``workdir``; ``start()``/``stop()``
    or ``with``. ``connection_string`` is what a feature_store.yaml names it by; ``store(project)`` the online
    store config for it."""

    def __init__(self, workdir: str | os.PathLike, port: int | None = None, extra: tuple = ()):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.extra = list(extra)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def connection_string(self) -> str:
        return self.url

    def _args(self) -> list[str]:
        return ["--port", str(self.port)]

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout: float = 20) -> "LocalRedis":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (make sysdeps, or apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        self.proc = subprocess.Popen([exe, "--bind", "127.0.0.1", *self._args(), "--save", "", "--appendonly", "no",
                                      *self.extra, "--dir", str(self.workdir), "--logfile", str(log)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._up, timeout, "redis-server", log)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def store(self, project: str, repo: Path | None = None):
        """The online store config of a Feast project on this server (keys end with the project's name, so two
        projects on one server do not meet)."""
        from solaris_jobs.online.store_config import StoreConfig
        repo = Path(repo or self.workdir)
        return StoreConfig(kind="redis", project=project, repo=repo, yaml_path=repo / "feature_store.yaml",
                           redis_type="redis", nodes=(("127.0.0.1", self.port),))

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
