"""Bulk writers into the Feast online store, in Feast's own layout (what ``FeatureStore.get_online_features`` reads).

Redis: one hash per entity key, as Feast writes it. A server-side script does, per key, what stock Feast does in a
read round trip plus a write: keep the row only if its event time is not older than the stored one (so that an
out-of-order backfill never overwrites fresher features; an equal time is overwritten, so reruns win), then HSET,
then move the key's expiry to this view's ``event time + ttl`` unless the key already lives longer (views that
share a key, such as the two user views, keep the longest). Requests are built as whole byte buffers with numpy
(every row of a batch has the same width) and pipelined on one connection: no per-row Python.

SQLite: Feast's table per view (``<project>_<view>``), upserted with the same newest-wins rule.

The three writers (``RedisWriter``, ``ClusterWriter``, ``SqliteWriter``) share one interface, ``OnlineWriter``:
write a group of rows that share an event time (``RowGroup``), flush, record a completed interval, close (also as
a context manager); ``open_writer`` picks the one the store configuration names.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import sqlite3
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from solaris_jobs.online import feast_format as ff
from solaris_jobs.online.resp import bulk, bulk_records, key_slots, open_raw
from solaris_jobs.online.store_config import StoreConfig, cluster_primaries, redis_client
from solaris_jobs.online.views import View

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

# Where a completely materialized interval is recorded, with its stats (``materialize.materialized_intervals``).
MARKER = "solaris:{project}:materialized"          # Redis: a hash, interval end -> stats
MARKER_TABLE = "solaris_materialized"              # SQLite: interval_end, stats

# KEYS: entity keys. ARGV: ts field, ts value, seconds, nanos, expire-at ms (0: none), shared (1: other views
# write the same keys: only ever extend the expiry), F, F field names, then F values per key.
# Returns {written, skipped as older}.
WRITE_SCRIPT = """
local function ts(b)
  local sec, nan, pos = 0, 0, 1
  while pos <= #b do
    local tag = string.byte(b, pos); pos = pos + 1
    local v, mul = 0, 1
    repeat
      local c = string.byte(b, pos); pos = pos + 1
      v = v + (c % 128) * mul; mul = mul * 128
    until c < 128
    if tag == 8 then sec = v elseif tag == 16 then nan = v end
  end
  return sec, nan
end
local tsf, tsv = ARGV[1], ARGV[2]
local sec, nan = tonumber(ARGV[3]), tonumber(ARGV[4])
local exp = ARGV[5]
local expn = tonumber(exp)
local shared = tonumber(ARGV[6])
local nf = tonumber(ARGV[7])
local base = 7 + nf
local written, skipped = 0, 0
for i, k in ipairs(KEYS) do
  local old = redis.call('HGET', k, tsf)
  local newer = true
  if old then
    local os, on = ts(old)
    newer = (sec > os) or (sec == os and nan >= on)
  end
  if newer then
    local args = {k, tsf, tsv}
    local off = base + (i - 1) * nf
    for j = 1, nf do
      args[2 * j + 2] = ARGV[7 + j]
      args[2 * j + 3] = ARGV[off + j]
    end
    redis.call('HSET', unpack(args))
    if expn > 0 then
      if shared == 0 then
        redis.call('PEXPIREAT', k, exp)
      else
        local cur = redis.call('PEXPIRETIME', k)
        if cur == -1 or cur < expn then redis.call('PEXPIREAT', k, exp) end
      end
    end
    written = written + 1
  else
    skipped = skipped + 1
  end
end
return {written, skipped}
"""


@dataclass
class Encoded:
    """One view's rows, ready to send: fixed-width keys and, per feature, fixed-width records or bytes lists."""
    keys: np.ndarray            # void records (entity key + project suffix for Redis)
    values: list                # per feature: void records (fixed width) or list[bytes]

    def __len__(self):
        return len(self.keys)

    def take(self, s) -> "Encoded":
        """Rows ``s`` (a slice or an index array)."""
        def pick(v):
            if v is None or isinstance(v, np.ndarray) or isinstance(s, slice):
                return v if v is None else v[s]
            return [v[i] for i in s]
        return Encoded(self.keys[s], [pick(v) for v in self.values])

    def value_block(self) -> bytes:
        """RESP bulk strings of the values, key by key (F per key)."""
        if all(isinstance(v, np.ndarray) for v in self.values):
            parts = [bulk_records(v) for v in self.values]
            rec = np.empty(len(self.keys), np.dtype([(f"f{j}", p.dtype) for j, p in enumerate(parts)]))
            for j, p in enumerate(parts):
                rec[f"f{j}"] = p
            return rec.tobytes()
        cols = [[bulk(x.tobytes()) for x in v] if isinstance(v, np.ndarray) else [bulk(x) for x in v]
                for v in self.values]
        return b"".join(b"".join(row) for row in zip(*cols))


@dataclass(frozen=True)
class RowGroup:
    """Rows of one view that share an event time (so one expiry): what an ``OnlineWriter`` writes in one call.

    Attributes:
        rows: the encoded rows, keys ending with the writer's ``key_suffix``.
        expire_at: when the rows' keys expire (Redis; Feast's SQLite store keeps no expiry).
        written_at: the write's clock (SQLite's ``created_ts``).
        shared: other views write the same entity keys (then a key's expiry is only ever extended).
        check_newer: compare each key's stored event time (a newer stored row is kept); False when the caller
            knows no stored row is newer.
    """
    view: View
    rows: Encoded
    event_time: pd.Timestamp
    expire_at: pd.Timestamp
    written_at: pd.Timestamp
    shared: bool = True
    check_newer: bool = True


class OnlineWriter(ABC):
    """A bulk writer into the online store, in Feast's layout. Usable as a context manager (closed on exit).

    ``key_suffix``: what the store's entity keys end with (Feast's Redis keys end with the project; SQLite's
    with nothing): ``RowGroup.rows`` are encoded with it.
    """
    key_suffix: bytes = b""

    @abstractmethod
    def write_group(self, group: RowGroup) -> None:
        """Writes (or queues) one group of rows; a stored row with a newer event time is kept."""

    @abstractmethod
    def flush(self) -> tuple[int, int]:
        """Waits for every write; returns (written, skipped because a newer row is stored) since the last flush."""

    @abstractmethod
    def mark_materialized(self, interval_end: str, stats: str) -> None:
        """Records the interval ending at ``interval_end`` (ISO) as completely materialized, with its stats
        (JSON)."""

    @abstractmethod
    def close(self) -> None:
        """Closes what the writer opened."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# How long a bulk write may wait for one reply at least: a pipelined batch of 50,000 rows, a Redis busy forking for
# a snapshot; reads and checks wait the store's own timeout (``store_timeout_seconds``).
WRITE_TIMEOUT_S = 60.0


def open_writer(cfg: StoreConfig, timeout_s: float | None = None) -> OnlineWriter:
    """The writer of the configured store: Redis, Redis Cluster or SQLite.

    Args:
        timeout_s: how long one Redis reply may take before the write is given up (None: the store's
            ``timeout_s``, the ``store_timeout_seconds`` setting, or ``WRITE_TIMEOUT_S`` if longer).

    Raises:
        redis.RedisError: Redis could not be reached.
    """
    if cfg.kind != "redis":
        return SqliteWriter(cfg.sqlite_path, cfg.project)
    cfg = dataclasses.replace(cfg, timeout_s=timeout_s if timeout_s is not None else max(cfg.timeout_s,
                                                                                         WRITE_TIMEOUT_S))
    client = redis_client(cfg)
    try:
        if cfg.redis_type == "redis_cluster":
            return ClusterWriter(client, cfg)
        return RedisWriter(client, project=cfg.project)
    except BaseException:
        client.close()
        raise


class _RedisStore(OnlineWriter):
    """What the two Redis writers share: Feast's Redis keys, fields and event times, and the interval record."""
    client = None
    project: str | None = None
    _fields: dict            # view name -> its Redis field names, set by the subclasses


    @property
    def key_suffix(self) -> bytes:
        return self.project.encode() if self.project is not None else b""

    def write_group(self, group: RowGroup) -> None:
        view, ns = group.view, group.event_time.value
        fields = self._fields.get(view.name)
        if fields is None:
            fields = self._fields[view.name] = [ff.field_name(view.name, c) for c in view.columns]
        self.write(view, group.rows, ns // 10**9, ns % 10**9, group.expire_at.value // 10**6, fields,
                   shared=group.shared, check_newer=group.check_newer)

    def mark_materialized(self, interval_end: str, stats: str) -> None:
        if self.project is None:
            raise ValueError("this Redis writer was opened without a project: it cannot record an interval")
        self.client.hset(MARKER.format(project=self.project), interval_end, stats)

    @abstractmethod
    def write(self, view: View, enc: Encoded, ts_seconds: int, ts_nanos: int, expire_at_ms: int,
              fields: list[bytes], shared: bool = True, check_newer: bool = True) -> None:
        """Queues ``enc`` (rows sharing one event time) for writing, in Feast's Redis layout."""


class RedisWriter(_RedisStore):
    """Pipelined writes to one Redis node.

    ``write`` sends and returns; replies are read ``depth`` requests behind, so that encoding the next batch
    overlaps with Redis executing the last one. ``flush`` waits for all replies and returns the totals.
    """

    def __init__(self, client, batch: int = 2000, depth: int = 32, *, project: str | None = None):
        self.client, self.batch, self.depth, self.project = client, batch, depth, project
        self._fields = {}
        self.sha = client.script_load(WRITE_SCRIPT)
        # Raw pipelining on a connection of our own (``open_raw``). Every reply here is an integer, an array of
        # integers or an error: one line each (or 3), checked in bulk.
        self.raw = open_raw(client)
        self.sock = self.raw.sock
        self.buf = b""
        self.pending = 0
        self.kinds = collections.deque()
        self.written = self.skipped = 0

    def _payload(self, enc: Encoded, header: list[bytes]) -> bytes:
        n, nf = len(enc), len(enc.values)
        count = 3 + n + len(header) + n * nf
        head = b"*%d\r\n" % count + bulk(b"EVALSHA") + bulk(self.sha.encode()) + bulk(b"%d" % n)
        return b"".join([head, bulk_records(enc.keys).tobytes(), *map(bulk, header), enc.value_block()])

    def _lines(self, k: int) -> list[bytes]:
        """The next ``k`` reply lines (without CRLF)."""
        while self.buf.count(b"\r\n") < k:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("redis closed the connection during materialization")
            self.buf += data
        parts = self.buf.split(b"\r\n", k)
        self.buf = parts[k]
        lines = parts[:k]
        errors = [x for x in lines if x.startswith(b"-")]
        if errors:
            raise RuntimeError(f"redis refused a write: {errors[0][1:].decode(errors='replace')}")
        return lines

    def _read_one(self) -> None:
        kind, n = self.kinds.popleft()
        if kind == "script":
            # *2, :written, :skipped; or one error line (raised by _lines): so the head is read on its own, not
            # waited for with the two lines that an error reply does not have.
            head, = self._lines(1)
            if head != b"*2":
                raise RuntimeError(f"unexpected reply to the write script: {head!r}")
            w, k = self._lines(2)
            self.written, self.skipped = self.written + int(w[1:]), self.skipped + int(k[1:])
        else:
            lines = self._lines(2 * n)          # HSET's new-field count, then PEXPIREAT's 1, per key (an error
            #                                     reply is one line too)
            if lines[1::2].count(b":1") != n:
                raise RuntimeError("PEXPIREAT did not set an expiry on a key just written")
            self.written += n
        self.pending -= 1

    def _send(self, payload: bytes, kind: str, n: int) -> None:
        try:
            self.sock.sendall(payload)
            self.kinds.append((kind, n))
            self.pending += 1
            while self.pending > self.depth:
                self._read_one()
        except BaseException:
            self.abort()
            raise

    def _send_plain(self, enc: Encoded, tsf: bytes, tsv: bytes, expire_at_ms: int, fields: list[bytes]) -> None:
        for s in range(0, len(enc), self.batch):
            part = enc.take(slice(s, s + self.batch))
            self._send(self._plain_payload(part, tsf, tsv, expire_at_ms, fields), "plain", len(part))

    def _plain_payload(self, enc: Encoded, tsf: bytes, tsv: bytes, expire_at_ms: int, fields: list[bytes]) -> bytes:
        """HSET key f1 v1 ... _ts:view ts + PEXPIREAT key t, per key: one fixed-width record per key."""
        keys = bulk_records(enc.keys)
        parts = [("h", b"*%d\r\n" % (4 + 2 * len(fields)) + bulk(b"HSET"))]
        cols = {"k": keys}
        for j, (f, v) in enumerate(zip(fields, enc.values)):
            parts.append((f"f{j}", bulk(f)))
            cols[f"v{j}"] = bulk_records(v)
        parts.append(("t", bulk(tsf) + bulk(tsv) + b"*3\r\n" + bulk(b"PEXPIREAT")))
        cols["k2"] = keys
        parts.append(("x", bulk(b"%d" % expire_at_ms)))
        order = ["h", "k"] + [x for j in range(len(fields)) for x in (f"f{j}", f"v{j}")] + ["t", "k2", "x"]
        const = dict(parts)
        dt = np.dtype([(n, ("u1", (len(const[n]),)) if n in const else cols[n].dtype) for n in order])
        rec = np.empty(len(enc), dt)
        for n in order:
            rec[n] = np.frombuffer(const[n], np.uint8) if n in const else cols[n]
        return rec.tobytes()

    def write(self, view: View, enc: Encoded, ts_seconds: int, ts_nanos: int, expire_at_ms: int,
              fields: list[bytes], shared: bool = True, check_newer: bool = True) -> None:
        """Queues ``enc`` (rows sharing one event time) for writing.

        ``shared``: other views write the same entity keys (then a key's expiry is only ever extended).
        ``check_newer=False``: the caller knows no stored row is newer (in-order materialization of a key space
        only this view writes): plain pipelined HSET + PEXPIREAT, about twice the rate of the scripted path.
        """
        if not check_newer and not shared and expire_at_ms > 0 and all(isinstance(v, np.ndarray) for v in enc.values):
            self._send_plain(enc, ff.ts_field(view.name), ff.timestamp(ts_seconds, ts_nanos), expire_at_ms, fields)
            return
        header = [ff.ts_field(view.name), ff.timestamp(ts_seconds, ts_nanos), b"%d" % ts_seconds,
                  b"%d" % ts_nanos, b"%d" % expire_at_ms, b"%d" % int(shared), b"%d" % len(fields), *fields]
        for s in range(0, len(enc), self.batch):
            self._send(self._payload(enc.take(slice(s, s + self.batch)), header), "script", 1)

    def flush(self) -> tuple[int, int]:
        """Waits for every reply; returns (written, skipped because a newer row is stored) since the last flush."""
        try:
            while self.pending:
                self._read_one()
        except BaseException:
            self.abort()
            raise
        out = (self.written, self.skipped)
        self.written = self.skipped = 0
        return out

    def abort(self) -> None:
        """Drops the connection (replies may be outstanding: it must not be reused)."""
        if self.raw is not None:
            self.raw.close()

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
            self.raw = self.sock = None
        self.client.close()


class ClusterWriter(_RedisStore):
    """Writes to a Redis Cluster: rows grouped by the primary that owns their key's slot, one ``RedisWriter``
    (raw pipelining) per primary. Scripted writes go one slot at a time (a script's keys must share a slot).
    A slot that moves during the write (resharding) fails the write with the MOVED error."""

    def __init__(self, client, cfg: StoreConfig):
        self.client, self.project, self._fields = client, cfg.project, {}
        self.names, subs, self.node_of_slot = cluster_primaries(client, cfg)
        self.writers: dict[str, RedisWriter] = {n: RedisWriter(c) for n, c in zip(self.names, subs)}

    def write(self, view: View, enc: Encoded, ts_seconds: int, ts_nanos: int, expire_at_ms: int,
              fields: list[bytes], shared: bool = True, check_newer: bool = True) -> None:
        slots = key_slots(enc.keys)
        nodes = self.node_of_slot[slots]
        scripted = check_newer or shared
        for j, name in enumerate(self.names):
            idx = np.flatnonzero(nodes == j)
            if not len(idx):
                continue
            groups = [idx]
            if scripted:
                idx = idx[np.argsort(slots[idx], kind="stable")]
                groups = np.split(idx, np.flatnonzero(np.diff(slots[idx])) + 1)
            for g in groups:
                self.writers[name].write(view, enc.take(g), ts_seconds, ts_nanos, expire_at_ms, fields, shared,
                                         check_newer)

    def flush(self) -> tuple[int, int]:
        """Waits for every node's replies; returns (written, skipped as older) since the last flush."""
        totals = [w.flush() for w in self.writers.values()]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.client.close()


class SqliteWriter(OnlineWriter):
    """Upserts into Feast's SQLite online tables (created if `feast apply` has not run yet), newest wins."""

    def __init__(self, path, project: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path), timeout=30)
        self.project = project
        self.written = self.skipped = 0

    def table(self, view: View) -> str:
        name = f"{self.project}_{view.name}"
        self.conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{name}" (entity_key BLOB, feature_name TEXT, value BLOB, value_text TEXT, '
            f'vector_value BLOB, event_ts timestamp, created_ts timestamp, PRIMARY KEY(entity_key, feature_name))')
        self.conn.execute(f'CREATE INDEX IF NOT EXISTS "{name}_ek" ON "{name}" (entity_key)')
        return name

    def write(self, view: View, enc: Encoded, event_ts: int, created_ts: int, fields: list[str]) -> None:
        """``event_ts``/``created_ts``: epoch seconds, as Feast 0.67's SQLite adapter stores datetimes."""
        table = self.table(view)
        before = self.conn.total_changes
        sql = (f'INSERT INTO "{table}" (entity_key, feature_name, value, event_ts, created_ts) VALUES (?,?,?,?,?) '
               f'ON CONFLICT(entity_key, feature_name) DO UPDATE SET value = excluded.value, '
               f'event_ts = excluded.event_ts, created_ts = excluded.created_ts '
               f'WHERE excluded.event_ts >= "{table}".event_ts')
        keys = [k.tobytes() for k in enc.keys]
        with self.conn:
            for name, vals in zip(fields, enc.values):
                vals = [v.tobytes() for v in vals] if isinstance(vals, np.ndarray) else vals
                self.conn.executemany(sql, ((k, name, v, event_ts, created_ts) for k, v in zip(keys, vals)))
        changed = (self.conn.total_changes - before) // max(len(fields), 1)
        self.written, self.skipped = self.written + changed, self.skipped + len(enc) - changed

    def write_group(self, group: RowGroup) -> None:
        self.write(group.view, group.rows, int(group.event_time.timestamp()), int(group.written_at.timestamp()),
                   group.view.columns)

    def flush(self) -> tuple[int, int]:
        """Returns (written, skipped as older) since the last flush (each write is committed as it is made)."""
        out = (self.written, self.skipped)
        self.written = self.skipped = 0
        return out

    def mark_materialized(self, interval_end: str, stats: str) -> None:
        with self.conn:
            self.conn.execute(f"CREATE TABLE IF NOT EXISTS {MARKER_TABLE} (interval_end TEXT PRIMARY KEY, stats TEXT)")
            self.conn.execute(f"INSERT OR REPLACE INTO {MARKER_TABLE} VALUES (?, ?)", (interval_end, stats))

    def close(self) -> None:
        self.conn.close()
