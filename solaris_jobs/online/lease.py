"""One refresh of an interval at a time: a lease per interval, held in the online store both runs write to.

Two runs of the same interval (``solaris backfill`` beside the scheduler, two backfills, a manual rerun during a
scheduled one) would both publish the interval's outputs and write the same keys, each step possibly reading the
other run's half-made outputs. So every step of a run first takes (or renews) the interval's lease for its run
(``owner``: an Airflow run id, or one id per ``solaris backfill``); a lease held by another owner that has not
expired stops the step with ``LeaseHeld``, naming the holder; the last step (materialize) releases it. A lease that
is not renewed expires after ``ttl_s`` (a crashed run does not block the interval for ever); the default TTL
(``Settings.lease_minutes``, 6 h) is as long as a DAG run may last (its ``dagrun_timeout``), so a live run, waiting
between its steps included, does not lose its lease to another.

The lease lives where both runs meet: Redis (``SET NX PX`` through a script that also renews the owner's own
lease; a Redis Cluster too: one key) or the SQLite online store's file (one table, changed in ``BEGIN IMMEDIATE``
transactions). Times are the wall clock's (leases are about real concurrency, not replay time).
"""
from __future__ import annotations

import sqlite3
import time

import pandas as pd

from solaris_jobs.core.offline import interval_key
from solaris_jobs.online.store_config import StoreConfig, redis_client

KEY = "solaris:{project}:lease:{interval}"
TABLE = "solaris_leases"

_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1], tonumber(ARGV[2])}
end
return {0, cur, redis.call('PTTL', KEYS[1])}
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseHeld(RuntimeError):
    """The interval is being refreshed by another run."""

    def __init__(self, end, holder: str, expires_in_s: float, store: str):
        self.holder, self.expires_in_s = holder, expires_in_s
        super().__init__(f"interval ending {pd.Timestamp(end).isoformat()} is being refreshed by run {holder!r} "
                         f"(lease in {store}, expires in {expires_in_s:.0f}s unless renewed): wait for it, or rerun "
                         "this run when that one has finished or failed (a failed run's lease: `solaris lease "
                         "release --end ... --owner ...`)")


def acquire(cfg: StoreConfig, end, owner: str, ttl_s: float) -> dict:
    """Takes or renews the interval's lease for ``owner``.

    Returns:
        {"owner", "expires_in_s"}.

    Raises:
        LeaseHeld: another owner holds an unexpired lease.
    """
    if not owner:
        raise ValueError("a lease needs an owner (a run id)")
    ms = max(1, int(ttl_s * 1000))
    if cfg.kind == "redis":
        client = redis_client(cfg)
        try:
            ok, holder, left_ms = client.eval(_ACQUIRE, 1, _key(cfg, end), owner, ms)
        finally:
            client.close()
        holder = holder.decode() if isinstance(holder, bytes) else holder
        if not ok:
            raise LeaseHeld(end, holder, max(0, int(left_ms)) / 1000, cfg.describe())
        return {"owner": owner, "expires_in_s": ms / 1000}
    now = time.time()
    with _sqlite(cfg) as conn:
        row = conn.execute(f"SELECT owner, expires_at FROM {TABLE} WHERE interval_end = ?", (_iso(end),)).fetchone()
        if row is not None and row[0] != owner and row[1] > now:
            raise LeaseHeld(end, row[0], row[1] - now, cfg.describe())
        conn.execute(f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, ?)", (_iso(end), owner, now + ms / 1000))
    return {"owner": owner, "expires_in_s": ms / 1000}


def release(cfg: StoreConfig, end, owner: str) -> bool:
    """Drops ``owner``'s lease of the interval (False: it held none, e.g. it had expired and another took it)."""
    if cfg.kind == "redis":
        client = redis_client(cfg)
        try:
            return bool(client.eval(_RELEASE, 1, _key(cfg, end), owner))
        finally:
            client.close()
    with _sqlite(cfg) as conn:
        return conn.execute(f"DELETE FROM {TABLE} WHERE interval_end = ? AND owner = ?",
                            (_iso(end), owner)).rowcount > 0


def holder(cfg: StoreConfig, end) -> str | None:
    """Who holds the interval's unexpired lease, if anyone."""
    if cfg.kind == "redis":
        client = redis_client(cfg)
        try:
            v = client.get(_key(cfg, end))
        finally:
            client.close()
        return v.decode() if v is not None else None
    # A read: opened read-only, so that asking (``solaris status``) neither takes the write lock nor creates a
    # store; no store or no lease table yet means nobody holds a lease.
    if not cfg.sqlite_path.exists():
        return None
    conn = sqlite3.connect(f"file:{cfg.sqlite_path}?mode=ro", uri=True, timeout=30)
    try:
        row = conn.execute(f"SELECT owner, expires_at FROM {TABLE} WHERE interval_end = ?", (_iso(end),)).fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):
            raise
        row = None
    finally:
        conn.close()
    return row[0] if row is not None and row[1] > time.time() else None


def _key(cfg: StoreConfig, end) -> str:
    return KEY.format(project=cfg.project, interval=interval_key(end))


def _iso(end) -> str:
    return pd.Timestamp(end).isoformat()


class _sqlite:
    """A connection in one ``BEGIN IMMEDIATE`` transaction (other writers wait for it), committed on exit."""

    def __init__(self, cfg: StoreConfig):
        cfg.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(cfg.sqlite_path), timeout=30, isolation_level=None)

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} "
                          "(interval_end TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at REAL NOT NULL)")
        return self.conn

    def __exit__(self, exc_type, *_):
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.conn.close()
