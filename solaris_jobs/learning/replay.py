"""The production-ordered replay: the refresh and the serving client walked over a logged period the way production
runs them, interleaved, so that every logged request gets exactly the features the store would have served it.

For each refresh k (cutoff ``T_k``; the cadence ``every``): the refresh's Spark steps run with the DAG's own job
functions (``solaris_jobs.pipeline.jobs``; one process and Spark session, the event log read once), on events before
``T_k`` only; the outputs become visible at ``T_k + delay``, ``delay`` being the declared upper bound of the
refresh's latency (or the measured latency when a refresh took longer, counted); the requests of
``[T_k, T_k + delay)`` are served from the store as it was, the interval is materialized with the replay's clock,
and the requests of ``[T_k + delay, T_k+1)`` are served after it. Requests go through ``FeatureReader`` one by one
in time order with the miss queue live (its misses are written where the next selection reads them), so TTLs,
model versions, "no row newer than the request" and misses act exactly as in serving.

What is recorded per logged row (``served.parquet``): user, item, time, request, tier, the embedding served (D
floats, zeros for tier none), its age in seconds (NaN for tier none), the FM embeddings behind it (``n_behind``: 1
for a pair, the aggregate's pairs, the neighbours; 0 for none), and the refresh whose store served it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from solaris_jobs.core import offline as off
from solaris_jobs.core.events import to_utc
from solaris_jobs.core.settings import Settings
from solaris_jobs.online.coverage import Server
from solaris_jobs.online.reader import DEFAULT_TIERS, READER_BUDGET_MS, READER_COOLDOWN_S
from solaris_jobs.online.store_config import StoreConfig
from solaris_jobs.pipeline import jobs
from solaris_jobs.pipeline.event_source import EventTable, event_source
from solaris_jobs.pipeline.model_refs import ModelSet

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
        budget_ms, cooldown_s: the serving reader's time budget and cooldown after a failure (``FeatureReader``'s
            defaults: what production serves with; the cooldown on the requests' clock). A read that times out
            fails open, as in serving (only a Redis store times out).
        store: the online store the replay serves from when none is given (``serving_store``): ``sqlite`` (the
            embedded default) or ``redis`` (a local redis-server: the production store kind, misses through the
            Redis stream and its drain).
        tiers: the fallback tiers the reader serves (``FeatureReader``'s ``tiers``; default its ``DEFAULT_TIERS``).
    """
    start: pd.Timestamp
    end: pd.Timestamp
    every: pd.Timedelta
    delay: pd.Timedelta = pd.Timedelta(minutes=10)
    ttls: dict = field(default_factory=dict)
    budget_ms: float = READER_BUDGET_MS
    cooldown_s: float = READER_COOLDOWN_S
    store: str = "sqlite"
    tiers: tuple = DEFAULT_TIERS

    def cutoffs(self) -> list[pd.Timestamp]:
        out, t = [], to_utc(self.start)
        while t < to_utc(self.end):
            out.append(t)
            t = t + self.every
        return out


def replay_store(folder: Path, project: str = "solaris_replay") -> StoreConfig:
    """A fresh SQLite online store (the embedded default's layout) for one replay."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "online_store.db"
    if path.exists():
        path.unlink()
    sqlite3.connect(path).close()           # the reader opens it read-only from the first request on
    return StoreConfig(kind="sqlite", project=project, repo=folder, yaml_path=folder / "feature_store.yaml",
                       sqlite_path=path)


@contextlib.contextmanager
def serving_store(folder: Path, kind: str = "sqlite", project: str = "solaris_replay"):
    """A fresh online store for one replay, as a context: SQLite under ``folder`` (``replay_store``), or a local
    ``redis-server`` with its files under ``folder`` (stopped on leaving)."""
    if kind == "sqlite":
        yield replay_store(folder, project)
    elif kind == "redis":
        from solaris_jobs.online.local_redis import LocalRedis
        folder.mkdir(parents=True, exist_ok=True)
        with LocalRedis(folder / "redis") as server:
            yield server.store(project, repo=folder)
    else:
        raise ValueError(f"replay store {kind!r}: use 'sqlite' or 'redis'")


def expiry(store: StoreConfig, now) -> dict:
    """How a replay's materialization at replay time ``now`` sets keys' expiry: on SQLite from the event on the
    replay's clock; on Redis, whose expiry runs on the server's wall clock (where a logged period's events plus their
    TTL are long past: every key would vanish as written), from the write on the wall clock. The reader checks each
    row's TTL against the request's time either way, so what is served is the same."""
    return {"expire_from": "event", "now": now} if store.kind == "sqlite" else {"expire_from": "write", "now": None}


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
        store: the online store (default: a fresh store of ``plan.store`` under ``out``).

    Returns:
        The replay's record: per refresh its stats, latency and visibility, the serving metrics, wall time.
    """
    if store is None:
        with serving_store(Path(out) / "online", plan.store) as fresh:
            return run(spark, s, events, models, plan, out, dim=dim, store=fresh, progress=progress)
    from solaris_jobs.online.materialize import materialize
    t_all = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = event_source(events)
    if not isinstance(source, EventTable):
        source = EventTable(source.table(), source.describe())
    cutoffs = plan.cutoffs()
    if not cutoffs:
        raise ValueError(f"replay plan {plan}: no refresh between start and end")
    env = dict(plan.ttls)
    server = Server(source.table(cutoffs[0], plan.end), store, models.embedding_version,
                    dim or int(models.ae.config["d_code"]), env, offline=s.offline, budget_ms=plan.budget_ms,
                    cooldown_s=plan.cooldown_s, tiers=plan.tiers)
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
            mat = materialize(store, s.offline, T, **expiry(store, visible), start=T - plan.every,
                              env=env)
            server.refresh = k
            n_after = server.serve_until(cutoffs[k + 1] if k + 1 < len(cutoffs) else plan.end)
            drained = server.flush_misses()                 # where the next selection reads them
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
                           "users_embedded": stats["neighbours"]["users_embedded"],
                           "neighbours": stats["neighbours"]["users_with_neighbour_embedding"],
                           "written": {v: m["written"] for v, m in mat["views"].items()},
                           "misses_drained": drained["pairs"] if drained else None,
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
        "store": store.kind, "budget_ms": plan.budget_ms, "cooldown_s": plan.cooldown_s,
        "tiers": list(plan.tiers),
        "ttls": env, "every": str(plan.every), "delay": str(plan.delay), "start": to_utc(plan.start).isoformat(),
        "end": to_utc(plan.end).isoformat(), "wall_s": round(time.perf_counter() - t_all, 1)})


def serve_again(s: Settings, models: ModelSet, plan: ReplayPlan, events, visible: list[tuple[pd.Timestamp,
                pd.Timestamp]], out: Path, *, dim: int | None = None, store: StoreConfig | None = None) -> dict:
    """Serves the same requests again from outputs already in ``s.offline`` (no refresh): refresh ``T`` becomes
    visible at its time in ``visible`` ((cutoff, visible_at) pairs, in order), as recorded by the replay they
    derive from. The budget and cadence curves use it (``solaris_jobs.evaluation.curves``)."""
    if store is None:
        with serving_store(Path(out) / "online", plan.store) as fresh:
            return serve_again(s, models, plan, events, visible, out, dim=dim, store=fresh)
    from solaris_jobs.online.materialize import materialize
    t_all = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = event_source(events)
    env = dict(plan.ttls)
    server = Server(source.table(plan.start, plan.end), store, models.embedding_version,
                    dim or int(models.ae.config["d_code"]), env, budget_ms=plan.budget_ms, cooldown_s=plan.cooldown_s,
                    tiers=plan.tiers)
    try:
        for k, (T, at) in enumerate(visible):
            server.serve_until(at)
            materialize(store, s.offline, T, **expiry(store, at), start=T - plan.every, env=env)
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
