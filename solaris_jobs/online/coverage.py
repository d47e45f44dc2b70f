"""Coverage as the serving client resolves it: logged requests served again through ``FeatureReader`` at their
own times (``Server``), and the one coverage definition every report uses (``tier_summary``: the refresh DAG's
``report`` task and the replay evaluation).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.events import to_utc
from solaris_jobs.online.reader import FeatureReader
from solaris_jobs.online.store_config import StoreConfig


def group_requests(events: pa.Table) -> pd.DataFrame:
    """The logged rows grouped into ranking requests, in time order: one request per ``request_id``, or per (user,
    timestamp) where the log has none. Columns: user_id, item_id, ts_us, request (0..n-1), row (the row's index in
    ``events``)."""
    df = pd.DataFrame({"user_id": events.column("user_id").to_numpy(),
                       "item_id": events.column("item_id").to_numpy(),
                       "ts_us": events.column("event_timestamp").cast(pa.int64()).to_numpy(),
                       "rid": events.column("request_id").to_pandas()})
    df["row"] = np.arange(len(df))
    key = np.where(df["rid"].isna(), -1, df["rid"].fillna(-1).astype(np.int64))
    df["_k"] = key
    df = df.sort_values(["ts_us", "user_id", "_k", "row"], kind="stable")
    first = ((df["ts_us"].diff() != 0) | (df["user_id"].diff() != 0) | (df["_k"].diff() != 0)).to_numpy()
    df["request"] = np.cumsum(first) - 1
    return df.drop(columns=["rid", "_k"]).reset_index(drop=True)


class Server:
    """Serves the logged requests of a period through ``FeatureReader``, in time order, and records what each row
    got: ``serve_until(t)`` serves every request before ``t`` not served yet; ``refresh`` is the refresh whose
    outputs the store holds (recorded with each row).

    ``budget_ms``, ``cooldown_s`` and ``tiers`` are the reader's (the replay evaluation passes the production reader's; the
    cooldown runs on the requests' clock, so it lasts as long in replayed time as in serving). With ``offline``,
    misses go where the next selection reads them when ``flush_misses`` is called (at each refresh interval's
    end): on a Redis store through the miss stream and its drain (``misses.drain_misses``, as the refresh DAG
    does), else as parquet under ``<offline>/misses/``. The miss queue holds a million requests (flushed at each
    interval's end: a replay serves an hour of requests in seconds, and the reader's default bound, meant for
    requests spread over that hour, would drop what serving would not)."""

    def __init__(self, events: pa.Table, store: StoreConfig, version: str, dim: int, env: dict,
                 offline: str | None = None, budget_ms: float = 1000.0, cooldown_s: float = 0.0, tiers=None):
        from solaris_jobs.core.offline import misses_uri
        self.events, self.dim, self.store, self.offline = events, dim, store, offline
        self._now_s = 0.0                    # the request being served: the reader's cooldown runs on replayed time
        self.reader = FeatureReader(store, version, dim, budget_ms=budget_ms, cooldown_s=cooldown_s,
                                    misses="auto" if offline else None,
                                    misses_dir=misses_uri(offline) if offline else None,
                                    miss_queue_size=1_000_000, env=env, miss_flush_s=3600.0,
                                    clock=lambda: self._now_s, tiers=tiers)
        req = group_requests(events)
        self.ts, self.users, self.items = req["ts_us"].to_numpy(), req["user_id"].to_numpy(), req["item_id"].to_numpy()
        self.rows = req["row"].to_numpy()
        r = req["request"].to_numpy()
        self.starts = np.flatnonzero(np.concatenate([[True], np.diff(r) != 0])) if len(r) else np.zeros(0, np.int64)
        n = events.num_rows
        self.emb = np.zeros((n, dim), np.float32)
        self.tier = np.full(n, TIERS.index("none"), np.int8)
        self.age = np.full(n, np.nan)
        self.count = np.zeros(n, np.int32)
        self.refresh_of = np.full(n, -1, np.int32)
        self.refresh = -1
        self.cursor = 0                      # index into self.starts of the next request to serve
        self.n_requests = len(self.starts)

    def serve_until(self, t) -> int:
        """Serves the requests strictly before ``t``; returns how many."""
        t_us = to_utc(t).value // 1000
        stop = np.searchsorted(self.ts[self.starts], t_us, side="left")
        edges = np.append(self.starts, len(self.ts))
        for j in range(self.cursor, stop):
            r0, r1 = edges[j], edges[j + 1]
            self._now_s = self.ts[r0] / 1e6
            f = self.reader.read(int(self.users[r0]), self.items[r0:r1], self._now_s)
            idx = self.rows[r0:r1]
            self.emb[idx], self.tier[idx], self.age[idx], self.count[idx] = f.embeddings, f.tiers, f.ages_s, f.counts
            self.refresh_of[idx] = self.refresh
        served = max(stop - self.cursor, 0)
        self.cursor = max(stop, self.cursor)
        return int(served)

    def flush_misses(self) -> dict | None:
        """Writes the queued misses where the next selection reads them; the drain's counts on a Redis store."""
        if self.reader.misses is None:
            return None
        self.reader.misses.flush()
        if self.store.kind == "redis":
            from solaris_jobs.online.misses import drain_misses
            return drain_misses(self.store, self.offline)
        return None

    def table(self) -> pa.Table:
        e = self.events
        return pa.table({
            "user_id": e.column("user_id"), "item_id": e.column("item_id"),
            "event_timestamp": e.column("event_timestamp"), "label": e.column("label"),
            "request_id": e.column("request_id"), "tier": pa.array(self.tier), "age_s": pa.array(self.age),
            "n_behind": pa.array(self.count),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(self.emb.ravel()), self.dim),
            "refresh": pa.array(self.refresh_of)})

    def metrics(self) -> dict:
        m = self.reader.metrics.snapshot()
        return {"counts": {k: v for k, v in m.items() if not k.startswith("latency")},
                "latency_ms": {k: v for k, v in m.items() if k.startswith("latency")}}

    def close(self) -> None:
        self.reader.close()


def tier_summary(tiers: np.ndarray, ages_s: np.ndarray) -> dict:
    """The coverage definition every report uses (the refresh DAG's and the evaluation's): per tier, the rows
    ``FeatureReader`` served from it (count and share) and the age of what it served (hours: mean, median, 90th
    percentile; None for a tier that served nothing)."""
    tiers = np.asarray(tiers)
    ages_h = np.asarray(ages_s, np.float64) / 3600.0
    n = len(tiers)
    counts = {name: int((tiers == k).sum()) for k, name in enumerate(TIERS)}
    ages = {}
    for k, name in enumerate(TIERS[:-1]):
        a = ages_h[tiers == k]
        ages[name] = ({"mean_h": round(float(a.mean()), 4), "p50_h": round(float(np.median(a)), 4),
                       "p90_h": round(float(np.quantile(a, 0.9)), 4)} if len(a) else None)
    return {"coverage": {k: (v / n if n else None) for k, v in counts.items()}, "coverage_counts": counts,
            "age_hours": ages}
