"""The replays of one seed's run, cached under its folder: the replay at the largest budget any point needs, the
smaller budgets and slower cadences derived from it (``curves.derive``), and the fast-cadence replay warmed from
it. ``SeedContext`` is what every step of a seed's run takes.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.evaluation import curves
from solaris_jobs.evaluation.config import EvalConfig, refresh_settings
from solaris_jobs.evaluation.protocol import REPLAY_CODE, Protocol, code_version, data_version
from solaris_jobs.online.views import views

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeedContext:
    """One seed's run of one data set: its settings, data, output folder, protocol, and the log and Spark session
    its replays run on."""
    cfg: EvalConfig
    root: Path
    out: Path
    protocol: Protocol
    seed: int
    events: object          # EventTable
    spark: object


def cached_json(path: Path, key: dict) -> dict | None:
    """The JSON at ``path`` if it was written for ``key``, else None."""
    if path.exists():
        got = json.loads(path.read_text())
        if got.get("key") == json.loads(json.dumps(key, default=str)):
            return got
    return None


def run_replay(ctx: SeedContext, models, models_dir: Path, name: str, plan, budget: float,
               warm: Callable | None = None, warm_key: str = "") -> dict:
    """The replay ``plan`` at ``budget`` into ``ctx.out / name`` (reused when run before for the same inputs and
    code); ``warm(settings, store)`` fills the online store it starts from (``warm_key`` names what it holds)."""
    from solaris_jobs.learning import replay
    out = ctx.out / name
    key = {"cfg": ctx.cfg.replay_key(), "seed": ctx.seed, "models": models.to_dict(), "plan": str(plan),
           "budget": budget, "root": str(ctx.root), "warm": warm_key, "code": code_version(REPLAY_CODE),
           "data": data_version(ctx.root)}
    done = cached_json(out / "done.json", key)
    if done is not None and (out / "served.parquet").exists():
        logger.info("reusing replay %s", out)
        return json.loads((out / "replay.json").read_text())
    if out.exists():
        shutil.rmtree(out)
    s = refresh_settings(ctx.cfg, ctx.root, out / "offline", models_dir, budget)
    with replay.serving_store(out / "online", plan.store) as store:
        if warm is not None:
            warm(s, store)
        rec = replay.run(ctx.spark, s, ctx.events, models, plan, out, store=store)
    rec["budget_per_row"] = budget
    (out / "replay.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    (out / "done.json").write_text(json.dumps({"key": key}, default=str) + "\n")
    return rec


def derive(ctx: SeedContext, models, base_rec: dict, base_out: Path, plan, budget: float, every: int) -> Path:
    """The replay at ``budget`` and every ``every``-th refresh derived from the one in ``base_out`` (its folder;
    reused when derived before from the same replay and code)."""
    out = ctx.out / f"derived-b{budget:g}-x{every}"
    key = {"base": str(base_out), "base_wall": base_rec.get("wall_s"), "budget": budget, "every": every,
           "models": models.to_dict(), "code": code_version(REPLAY_CODE)}
    if cached_json(out / "done.json", key) is not None and (out / "served.parquet").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    s = refresh_settings(ctx.cfg, ctx.root, base_out / "offline", Path(models.fm.path).parent,
                         base_rec["budget_per_row"])
    curves.derive(ctx.spark, s, base_rec, models, plan, ctx.events, out, budget, every)
    (out / "done.json").write_text(json.dumps({"key": key}, default=str) + "\n")
    return out


@dataclass(frozen=True)
class BaseReplay:
    """A seed's replay at ``budget`` (the largest any point of its run needs) and what is served at smaller budgets
    and slower cadences, derived from it."""
    ctx: SeedContext
    models: object          # ModelSet
    plan: object            # ReplayPlan
    budget: float
    record: dict            # replay.run's record
    out: Path
    wall_s: float           # the replay's wall time (0 when reused)

    def served_at(self, budget: float, mult: int = 1) -> tuple[pa.Table, Path | None]:
        """The rows served at ``budget`` with every ``mult``-th refresh, and the derived replay's folder (None:
        the replay itself)."""
        from solaris_jobs.learning import replay
        if budget == self.budget and mult == 1:
            return replay.read_served(self.out), None
        d = derive(self.ctx, self.models, self.record, self.out, self.plan, budget, mult)
        return replay.read_served(d), d


def warm_from(head_offline: str, refreshes: list[dict], every: pd.Timedelta, ttls) -> Callable:
    """A ``warm`` for ``run_replay``: the replay's store and offline outputs start with the outputs of
    ``refreshes`` (records of a replay whose offline store is ``head_offline``), materialized as that replay made
    them visible."""
    def warm(s, store):
        from solaris_jobs.core import offline as off
        from solaris_jobs.learning import replay
        from solaris_jobs.online.materialize import materialize
        for r in refreshes:
            T = pd.Timestamp(r["cutoff"])
            for ds in views():                     # every online view's offline dataset
                off.write_interval(off.read_table(head_offline, ds, T), s.offline, ds, T,
                                   off.read_stats(head_offline, ds, T))
            materialize(store, s.offline, T, **replay.expiry(store, pd.Timestamp(r["visible_at"])),
                        start=T - every, env=dict(ttls))
    return warm


def replay_summary(rec: dict) -> dict:
    """A replay's record in brief: refreshes, rows, requests, what was served and the reads' latency (p50, p99 ms),
    refresh latencies, wall time."""
    lat = [r["latency_s"] for r in rec["refreshes"]]
    return {"refreshes": len(rec["refreshes"]), "rows": rec["rows"], "requests": rec["requests"],
            "serving": rec["serving"]["counts"], "serving_latency_ms": rec["serving"].get("latency_ms"),
            "latency_s": {"mean": float(np.mean(lat)), "max": float(max(lat))},
            "latency_over_delay": int(sum(r["latency_over_delay"] for r in rec["refreshes"])),
            "wall_s": rec["wall_s"]}
