"""The production-ordered replay: the refresh and the serving client walked over a logged period the way production
runs them, interleaved, so that every logged request gets exactly the features the store would have served it.

For each refresh k (cutoff ``T_k``; the cadence ``every``): the refresh's Spark steps run with the DAG's own job
functions (``solaris_jobs.jobs``; one process and Spark session, the event log read once), on events before
``T_k`` only; the outputs become visible at ``T_k + delay``, ``delay`` being the declared upper bound of the
refresh's latency (or the measured latency when a refresh took longer, counted); the requests of
``[T_k, T_k + delay)`` are served from the store as it was, the interval is materialized with the replay's clock,
and the requests of ``[T_k + delay, T_k+1)`` are served after it. Requests go through ``FeatureReader`` one by one
in time order with the miss queue live (its misses are written where the next selection reads them), so TTLs,
model versions, "no row newer than the request" and misses act exactly as in serving.

What is recorded per logged row (``served.parquet``): user, item, time, request, tier, the embedding served (D
floats, zeros for tier none) and its age in seconds (NaN for tier none), and the refresh whose store served it.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from solaris_jobs import jobs
from solaris_jobs import offline as off
from solaris_jobs.event_source import EventTable, event_source
from solaris_jobs.events import to_utc
from solaris_jobs.model_refs import ModelSet
from solaris_jobs.settings import Settings
from solaris_jobs.store_config import StoreConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayPlan:
    """When the replay refreshes and serves.

    Attributes:
        start: the first refresh's cutoff (t1: the models were trained before it).
        end: the last served request is before this (t3).
        every: the refresh cadence.
        delay: the declared latency bound: a refresh's outputs are visible this long after its cutoff (longer when
            the measured latency is longer).
        ttls: the views' TTLs as environment (``settings.ttl_env``) for materialization and serving.
    """
    start: pd.Timestamp
    end: pd.Timestamp
    every: pd.Timedelta
    delay: pd.Timedelta = pd.Timedelta(minutes=10)
    ttls: dict = field(default_factory=dict)

    def cutoffs(self) -> list[pd.Timestamp]:
        out, t = [], to_utc(self.start)
        while t < to_utc(self.end):
            out.append(t)
            t = t + self.every
        return out


def requests(events: pa.Table) -> pd.DataFrame:
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


def replay_store(folder: Path, project: str = "solaris_replay") -> StoreConfig:
    """A fresh SQLite online store (the embedded default's layout) for one replay."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "online_store.db"
    if path.exists():
        path.unlink()
    sqlite3.connect(path).close()           # the reader opens it read-only from the first request on
    return StoreConfig(kind="sqlite", project=project, repo=folder, yaml_path=folder / "feature_store.yaml",
                       sqlite_path=path)


class Server:
    """Serves the logged requests of a period through ``FeatureReader``, in time order, and records what each row
    got: ``serve_until(t)`` serves every request before ``t`` not served yet; ``refresh`` is the refresh whose
    outputs the store holds (recorded with each row). Misses (with ``misses_dir``) are written when
    ``flush_misses`` is called: one file per refresh interval."""

    def __init__(self, events: pa.Table, store: StoreConfig, version: str, dim: int, env: dict,
                 misses_dir: str | None = None):
        from solaris_jobs.serving import FeatureReader
        self.events, self.dim = events, dim
        self.reader = FeatureReader(store, version, dim, budget_ms=1000.0, cooldown_s=0.0,
                                    misses="auto" if misses_dir else None, misses_dir=misses_dir,
                                    miss_queue_size=1_000_000, env=env, miss_flush_s=3600.0)
        req = requests(events)
        self.ts, self.users, self.items = req["ts_us"].to_numpy(), req["user_id"].to_numpy(), req["item_id"].to_numpy()
        self.rows = req["row"].to_numpy()
        r = req["request"].to_numpy()
        self.starts = np.flatnonzero(np.concatenate([[True], np.diff(r) != 0])) if len(r) else np.zeros(0, np.int64)
        n = events.num_rows
        self.emb = np.zeros((n, dim), np.float32)
        self.tier = np.full(n, 3, np.int8)
        self.age = np.full(n, np.nan)
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
            f = self.reader.read(int(self.users[r0]), self.items[r0:r1], self.ts[r0] / 1e6)
            idx = self.rows[r0:r1]
            self.emb[idx], self.tier[idx], self.age[idx] = f.embeddings, f.tiers, f.ages_s
            self.refresh_of[idx] = self.refresh
        served = max(stop - self.cursor, 0)
        self.cursor = max(stop, self.cursor)
        return int(served)

    def flush_misses(self) -> None:
        if self.reader.misses is not None:
            self.reader.misses.flush()

    def table(self) -> pa.Table:
        e = self.events
        return pa.table({
            "user_id": e.column("user_id"), "item_id": e.column("item_id"),
            "event_timestamp": e.column("event_timestamp"), "label": e.column("label"),
            "request_id": e.column("request_id"), "tier": pa.array(self.tier), "age_s": pa.array(self.age),
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
    from models.vm import TIERS
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


def _write(out: Path, server: Server, result: dict) -> dict:
    pq.write_table(server.table(), out / "served.parquet")
    result.update(rows=int(server.events.num_rows), requests=int(server.n_requests), serving=server.metrics())
    (out / "replay.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def run(spark, s: Settings, events, models: ModelSet, plan: ReplayPlan, out: Path, *, dim: int | None = None,
        store: StoreConfig | None = None, progress: bool = False) -> dict:
    """Walks ``plan`` and writes ``<out>/served.parquet`` and ``<out>/replay.json``.

    Args:
        s: the refresh's settings (``offline`` is where this replay's outputs and misses go).
        events: the whole log (an ``EventTable``, read once); only rows before each cutoff reach its refresh.
        models: the FM, autoencoder and verifier, resolved once (trained before ``plan.start``).
        dim: the embedding width (default: the autoencoder's code width).
        store: the online store (default: a fresh SQLite store under ``out``).

    Returns:
        The replay's record: per refresh its stats, latency and visibility, the serving metrics, wall time.
    """
    from solaris_jobs.materialize import materialize
    t_all = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = event_source(events)
    if not isinstance(source, EventTable):
        source = EventTable(source.table(), source.describe())
    cutoffs = plan.cutoffs()
    if not cutoffs:
        raise ValueError(f"replay plan {plan}: no refresh between start and end")
    store = store or replay_store(out / "online")
    env = dict(plan.ttls)
    server = Server(source.table(cutoffs[0], plan.end), store, models.embedding_version,
                    dim or int(models.ae.config["d_code"]), env, off.misses_uri(s.offline))
    record = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(cutoffs), unit="refresh", desc="replay")
    try:
        for k, T in enumerate(cutoffs):
            t0 = time.perf_counter()
            stats = jobs.run(spark, s, T - plan.every, T, events=source, models=models, clock=lambda T=T: T)
            mat_t0 = time.perf_counter()
            latency = pd.Timedelta(seconds=mat_t0 - t0)
            visible = T + max(plan.delay, latency)
            n_before = server.serve_until(visible)          # still served by the previous refresh's outputs
            mat = materialize(store, s.offline, T, expire_from="event", now=visible, start=T - plan.every,
                              env=env)
            server.refresh = k
            n_after = server.serve_until(cutoffs[k + 1] if k + 1 < len(cutoffs) else plan.end)
            server.flush_misses()                           # where the next selection reads them
            sel = stats["select"]
            # Visibility is decided before materializing (requests before it are served first); the flag also
            # counts the materialization's own time, measured now.
            mat_s = round(mat["seconds"], 2)
            record.append({"cutoff": T.isoformat(), "latency_s": round(latency.total_seconds(), 2),
                           "latency_over_delay": bool(latency + pd.Timedelta(seconds=mat_s) > plan.delay),
                           "visible_at": visible.isoformat(), "materialize_s": mat_s,
                           "requests_before_visible": n_before, "requests_after_visible": n_after,
                           "pairs_selected": sel["pairs_selected"], "budget_pairs": sel.get("budget_pairs"),
                           "expected_rows": sel.get("expected_rows"), "pool": sel.get("by_source"),
                           "pairs_embedded": stats["embed"]["pairs"], "aggregates": stats["aggregate"]["users"],
                           "users_embedded": stats["neighbours"]["users_with_history"],
                           "neighbours": stats["neighbours"]["users_with_neighbour_embedding"],
                           "written": {v: m["written"] for v, m in mat["views"].items()},
                           "seconds": {st: stats[st]["seconds"] for st in stats}})
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{T.isoformat()} {latency.total_seconds():.0f}s")
            logger.info("replay %s: refresh %.1fs, %d + %d requests served", T, latency.total_seconds(), n_before,
                        n_after)
    finally:
        if bar is not None:
            bar.close()
        server.close()
    return _write(out, server, {
        "kind": "replay", "refreshes": record, "embedding_version": models.embedding_version, "dim": server.dim,
        "ttls": env, "every": str(plan.every), "delay": str(plan.delay), "start": to_utc(plan.start).isoformat(),
        "end": to_utc(plan.end).isoformat(), "wall_s": round(time.perf_counter() - t_all, 1)})


def serve_again(s: Settings, models: ModelSet, plan: ReplayPlan, events, visible: list[tuple[pd.Timestamp,
                pd.Timestamp]], out: Path, *, dim: int | None = None) -> dict:
    """Serves the same requests again from outputs already in ``s.offline`` (no refresh): refresh ``T`` becomes
    visible at its time in ``visible`` ((cutoff, visible_at) pairs, in order), as recorded by the replay they
    derive from. The budget and cadence curves use it (``solaris_jobs.evaluation.curves``)."""
    from solaris_jobs.materialize import materialize
    t_all = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = event_source(events)
    store = replay_store(out / "online")
    env = dict(plan.ttls)
    server = Server(source.table(plan.start, plan.end), store, models.embedding_version,
                    dim or int(models.ae.config["d_code"]), env)
    try:
        for k, (T, at) in enumerate(visible):
            server.serve_until(at)
            materialize(store, s.offline, T, expire_from="event", now=at, start=T - plan.every, env=env)
            server.refresh = k
        server.serve_until(plan.end)
    finally:
        server.close()
    return _write(out, server, {"kind": "served again", "refreshes": [
        {"cutoff": T.isoformat(), "visible_at": at.isoformat()} for T, at in visible], "ttls": env,
        "every": str(plan.every), "start": to_utc(plan.start).isoformat(), "end": to_utc(plan.end).isoformat(),
        "wall_s": round(time.perf_counter() - t_all, 1)})


def read_served(out: Path) -> pa.Table:
    """The rows a replay served (``run``'s ``served.parquet``)."""
    return pq.read_table(Path(out) / "served.parquet")
