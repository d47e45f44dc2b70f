"""Materialization: one interval's offline outputs (pair embeddings, user aggregates, neighbours) into the online
store, in the layout the stock Feast SDK reads, each key expiring with its own view's TTL.

Rows that cannot be served (null key, missing or wrongly sized embedding, non-finite values, no timestamp) are set
aside with a count per reason in the returned stats. A failure part-way raises; only a complete interval is
recorded as materialized (``materialized_intervals``).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from solaris_jobs.core import offline as off
from solaris_jobs.core.events import to_utc as _utc
from solaris_jobs.online import feast_format as ff
from solaris_jobs.online.store_config import StoreConfig, StoreUnavailable, redis_client
from solaris_jobs.online.views import EMBEDDING, MODEL_VERSION, View, views
from solaris_jobs.online.writer import MARKER, MARKER_TABLE, Encoded, OnlineWriter, RowGroup, open_writer

logger = logging.getLogger(__name__)


def _embedding_matrix(col: pa.ChunkedArray | pa.Array, where: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(n, D) float32 and the rows that are valid (D = the most common width); reasons for the others."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lens = pc.list_value_length(col).fill_null(-1).to_numpy(zero_copy_only=False)
    good_lens = lens[lens > 0]
    if not len(good_lens):
        return np.zeros((len(col), 0), np.float32), np.zeros(len(col), bool), {"no embedding": int(len(col))}
    widths, counts = np.unique(good_lens, return_counts=True)
    d = int(widths[np.argmax(counts)])
    ok = lens == d
    reasons = Counter()
    reasons["no embedding"] += int((lens <= 0).sum())
    reasons[f"embedding width is not {d}"] += int(((lens > 0) & ~ok).sum())
    m = np.zeros((len(col), d), np.float32)
    if ok.any():
        flat = pc.list_flatten(col.filter(pa.array(ok))).to_numpy(zero_copy_only=False).astype(np.float32)
        m[ok] = flat.reshape(-1, d)
    finite = np.isfinite(m).all(1)
    reasons["non-finite embedding value"] += int((ok & ~finite).sum())
    ok &= finite
    logger.debug("%s: embedding width %d", where, d)
    return m, ok, {k: v for k, v in reasons.items() if v}


def encode(view: View, table: pa.Table, suffix: bytes) -> tuple[Encoded, pd.DataFrame, dict]:
    """Encodes a batch of one view's rows.

    Returns:
        (encoded valid rows, their (event_timestamp, model_version) frame, rejected counts by reason).
    """
    missing = [c for c in (*view.join_keys, *view.columns, "event_timestamp") if c not in table.column_names]
    if missing:
        raise ValueError(f"{view.name}: offline output lacks columns {missing}")
    n = table.num_rows
    ok = np.ones(n, bool)
    reasons: Counter = Counter()
    for k in view.join_keys:
        null = table.column(k).is_null().to_numpy(zero_copy_only=False)
        reasons[f"null {k}"] += int((null & ok).sum())
        ok &= ~null
    ts = table.column("event_timestamp").cast(pa.timestamp("us", tz="UTC"))
    null = ts.is_null().to_numpy(zero_copy_only=False)
    reasons["null event_timestamp"] += int((null & ok).sum())
    ok &= ~null
    emb, emb_ok, why = _embedding_matrix(table.column(EMBEDDING), view.name)
    for r, c in why.items():
        reasons[r] += c
    ok &= emb_ok
    keep = pa.array(ok)
    t = table.filter(keep)
    meta = pd.DataFrame({"ts": t.column("event_timestamp").cast(pa.timestamp("us", tz="UTC")).to_pandas(),
                         "version": t.column(MODEL_VERSION).to_pandas().fillna("").astype(str)})
    keys = ff.entity_keys({k: t.column(k).to_numpy() for k in view.join_keys}, suffix)
    values = []
    for col, kind in view.features:
        if col == EMBEDDING:
            values.append(ff.float_lists(emb[ok]))
        elif col == MODEL_VERSION:
            values.append(None)             # one value per (event time, version) group: see _constant_version
        elif kind == "int32":
            values.append(ff.int32_values(t.column(col).fill_null(0).to_numpy()))
        elif kind == "int64_list":
            values.append([ff.int64_list(v or []) for v in t.column(col).to_pylist()])
        elif kind == "float_list":
            values.append([ff.float_list(v or []) for v in t.column(col).to_pylist()])
        else:
            raise ValueError(f"{view.name}.{col}: unsupported kind {kind}")
    return Encoded(keys, values), meta, {k: v for k, v in reasons.items() if v}


def _groups(meta: pd.DataFrame):
    """Row indices per (event time, model version): one script header each."""
    for (ts, version), idx in meta.groupby(["ts", "version"], sort=True).indices.items():
        yield pd.Timestamp(ts), version, idx


def _constant_version(enc: Encoded, view: View, idx: np.ndarray, version: str) -> Encoded:
    """Rows of one group, with the model version as fixed-width records (one shared value)."""
    part = enc.take(idx)
    j = view.columns.index(MODEL_VERSION)
    b = ff.string_value(version)
    part.values[j] = np.frombuffer(b * len(idx), dtype=np.dtype((np.void, len(b))))
    return part


class MaterializeError(StoreUnavailable):
    """The online store failed part-way through an interval (dropped, killed, hung past the timeout, refused a
    write): the interval is not recorded as materialized, and a rerun writes it whole."""


@dataclass(frozen=True)
class _Interval:
    """What every write of one interval shares.

    Attributes:
        end: the interval's end (UTC); its outputs are keyed by it.
        now: the clock for ``expire_from``; ``created`` of SQLite's rows.
        expire_from: ``event`` or ``write`` (``materialize``'s argument).
        names: the views to write, in order.
        views: every view, by name.
        shared: per view, whether other views write the same entity keys (the user views share the user's hash).
        check_newer: compare each key's stored event time (a later interval was materialized before, or asked).
    """
    end: pd.Timestamp
    now: pd.Timestamp
    expire_from: str
    names: tuple[str, ...]
    views: dict
    shared: dict
    check_newer: bool


def materialize(cfg: StoreConfig, offline: str, end, view_names=None, expire_from: str = "event",
                now=None, batch_rows: int = 50_000, env=None, always_check: bool = False, start=None,
                timeout_s: float | None = None) -> dict:
    """Writes the interval ending at ``end`` into the online store.

    Args:
        start: the interval's start, recorded with it (the training DAG re-embeds ``[start, end)``).
        expire_from: ``event``: a key expires at its row's event time + the view's TTL (rows already past it are
            not written, and counted); ``write``: at the write time + TTL (replays of old data, the demo).
        now: the clock for ``expire_from`` (default: the wall clock).
        always_check: compare every key's stored event time even when no later interval was materialized
            (when something else also writes these views).
        timeout_s: how long one Redis reply may take before the write is given up (None: the store's
            ``timeout_s``, or ``writer.WRITE_TIMEOUT_S`` if longer).

    Returns:
        Stats per view: rows read, written, skipped (a newer row is stored), expired, rejected by reason, seconds.

    Raises:
        FileNotFoundError: the interval has no complete output for a view.
        redis.RedisError: Redis could not be reached when the write started.
        MaterializeError: the store failed part-way (the message names the view and the rows read so far); the
            interval is not marked materialized, and a rerun writes it whole.
    """
    iv = _plan(cfg, end, view_names, expire_from, now, env, always_check)
    out = {"interval_end": iv.end.isoformat(),
           "interval_start": _utc(start).isoformat() if start is not None else None,
           "checked_newer": iv.check_newer, "store": cfg.describe(), "expire_from": expire_from, "views": {}}
    t_all = time.perf_counter()
    name, st = None, Counter()          # the view being written and its counts so far (for the error message)
    with open_writer(cfg, timeout_s) as writer:
        try:
            for name in iv.names:
                st = Counter()
                out["views"][name] = _write_view(writer, iv, iv.views[name], offline, batch_rows, st)
            out["seconds"] = round(time.perf_counter() - t_all, 3)
            writer.mark_materialized(iv.end.isoformat(), json.dumps(out, sort_keys=True, default=str))
        except _store_errors() as e:
            raise MaterializeError(
                f"materializing the interval ending {iv.end.isoformat()} into {cfg.describe()} failed in view {name} "
                f"after {int(st['rows'])} of its rows ({type(e).__name__}: {e}); the interval is not recorded as "
                f"materialized: rerun the materialize step once the store is back") from e
    logger.info("materialized %s into %s: %s", iv.end, cfg.describe(),
                {k: (v["written"], v["rows"]) for k, v in out["views"].items()})
    return out


def _plan(cfg: StoreConfig, end, view_names, expire_from: str, now, env, always_check: bool) -> _Interval:
    """The interval's shared write settings, its arguments checked.

    Raises:
        ValueError: ``expire_from`` is neither ``event`` nor ``write``, or a view name is unknown.
    """
    if expire_from not in ("event", "write"):
        raise ValueError(f"expire_from must be 'event' or 'write', not {expire_from!r}")
    all_views = views(env)
    names = tuple(view_names or all_views)
    unknown = set(names) - set(all_views)
    if unknown:
        raise ValueError(f"unknown feature views {sorted(unknown)}; known: {sorted(all_views)}")
    end = _utc(end)
    now = _utc(pd.Timestamp.now(tz="UTC") if now is None else now)
    shared = {n: sum(v.join_keys == all_views[n].join_keys for v in all_views.values()) > 1 for n in all_views}
    # Rows newer than this interval's can only be in the store if a later interval was materialized before
    # (a backfill): only then must each key be compared with what is stored.
    later = [e for e in materialized_intervals(cfg) if e > end]
    return _Interval(end, now, expire_from, names, all_views, shared, bool(later) or always_check)


def _write_view(writer: OnlineWriter, iv: _Interval, view: View, offline: str, batch_rows: int,
                st: Counter) -> dict:
    """Writes one view's output of the interval; counts into ``st`` as it goes (rows read, expired, written,
    skipped as older). Returns the view's stats."""
    rejected: Counter = Counter()
    t0 = time.perf_counter()
    for batch in off.read_batches(offline, view.name, iv.end, batch_rows):
        table = pa.Table.from_batches([batch])
        st["rows"] += table.num_rows
        enc, meta, why = encode(view, table, writer.key_suffix)
        rejected.update(why)
        for ts, version, idx in _groups(meta):
            expire_at = (iv.now if iv.expire_from == "write" else ts) + view.ttl
            if expire_at <= iv.now:
                st["expired"] += len(idx)
                continue
            writer.write_group(RowGroup(view, _constant_version(enc, view, idx, version), ts, expire_at, iv.now,
                                        shared=iv.shared[view.name], check_newer=iv.check_newer))
    st["written"], st["skipped_older"] = writer.flush()
    secs = time.perf_counter() - t0
    for reason, count in rejected.items():
        logger.warning("%s %s: %d rows set aside: %s", view.name, iv.end, count, reason)
    return {**{k: int(st[k]) for k in ("rows", "written", "skipped_older", "expired")},
            "rejected": dict(rejected), "ttl_seconds": int(view.ttl.total_seconds()), "seconds": round(secs, 3),
            "rows_per_s": round(st["rows"] / secs, 1) if secs > 0 else None}


def _store_errors() -> tuple:
    """What a store failing under a write raises: socket errors (a dropped, killed or hung Redis), redis-py's
    errors, a refused write (``RuntimeError`` from the writers), SQLite's errors; not the offline reads' errors
    (a missing output stays a ``FileNotFoundError``)."""
    import sqlite3

    import redis
    return ConnectionError, TimeoutError, redis.RedisError, sqlite3.Error, RuntimeError


def materialized_intervals(cfg: StoreConfig) -> dict[pd.Timestamp, dict]:
    """Intervals recorded as completely materialized in the store, with their stats."""
    if cfg.kind == "redis":
        client = redis_client(cfg)
        try:
            raw = client.hgetall(MARKER.format(project=cfg.project))
        finally:
            client.close()
        return {pd.Timestamp(k.decode()): json.loads(v) for k, v in raw.items()}
    import sqlite3
    if not cfg.sqlite_path.exists():
        return {}
    conn = sqlite3.connect(str(cfg.sqlite_path))
    try:
        rows = conn.execute(f"SELECT interval_end, stats FROM {MARKER_TABLE}").fetchall()
    except sqlite3.OperationalError:
        rows = []
    finally:
        conn.close()
    return {pd.Timestamp(k): json.loads(v) for k, v in rows}
