"""The refresh as task functions, one per step, for one interval ``[start, end)``: what the Airflow DAG's tasks
call and what ``solaris backfill`` runs without a scheduler. Each returns a JSON-able stats dict (the task's XCom).

Settings come from the environment (``RefreshSettings.from_env``), so that the DAG file stays free of heavy
imports and a worker configured once runs every task:

    SOLARIS_DATA        data root (event log)               SOLARIS_OFFLINE   offline store root
    SOLARIS_MODELS      folder with fm.pt, ae.pt, vm.pt     SOLARIS_FEATURE_REPO / FEAST_FS_YAML_FILE_PATH
    SOLARIS_EXPIRE_FROM event (default) or write            SOLARIS_SPARK_MASTER  (default local[*])
    SOLARIS_MAX_BAD_SHARE  share of an interval's events that may break the contract before validate fails
                        (default 0.05)
    SOLARIS_PRECOMPUTE  JSON overrides of PrecomputeConfig, e.g. {"active_hours": 168, "lookback_days": null,
                        "simulator": {"n_candidates": 100}}
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import pandas as pd

from solaris_jobs.precompute import PrecomputeConfig

logger = logging.getLogger(__name__)

SPARK_STEPS = ("select", "embed", "aggregate", "neighbours")
STEPS = ("validate", "drain_misses", *SPARK_STEPS, "materialize", "report")


def precompute_config(overrides: dict | None) -> PrecomputeConfig:
    """A PrecomputeConfig from JSON-style overrides (unknown keys are an error, named)."""
    from solaris_jobs.candidates import SimulatorConfig
    o = dict(overrides or {})
    known = {f.name for f in fields(PrecomputeConfig)}
    unknown = set(o) - known
    if unknown:
        raise ValueError(f"SOLARIS_PRECOMPUTE: unknown settings {sorted(unknown)}; known: {sorted(known)}")
    if "simulator" in o:
        o["simulator"] = SimulatorConfig(**o["simulator"])
    return PrecomputeConfig(**o)


@dataclass(frozen=True)
class RefreshSettings:
    data: str
    offline: str
    models: str
    feature_repo: str | None = None
    expire_from: str = "event"
    master: str | None = None
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    max_bad_share: float = 0.05

    @classmethod
    def from_env(cls, env=None, **overrides) -> "RefreshSettings":
        env = os.environ if env is None else env
        missing = [v for v in ("SOLARIS_DATA", "SOLARIS_OFFLINE", "SOLARIS_MODELS") if not env.get(v)]
        if missing and not {"data", "offline", "models"} <= set(overrides):
            raise ValueError(f"set {', '.join(missing)} (where the event log, the offline store and the models are)")
        raw = env.get("SOLARIS_PRECOMPUTE")
        try:
            pc = precompute_config(json.loads(raw) if raw else None)
        except json.JSONDecodeError as e:
            raise ValueError(f"SOLARIS_PRECOMPUTE is not JSON: {e}") from e
        s = cls(data=env.get("SOLARIS_DATA", ""), offline=env.get("SOLARIS_OFFLINE", ""),
                models=env.get("SOLARIS_MODELS", ""), feature_repo=env.get("SOLARIS_FEATURE_REPO"),
                expire_from=env.get("SOLARIS_EXPIRE_FROM", "event"), master=env.get("SOLARIS_SPARK_MASTER"),
                precompute=pc, max_bad_share=_share(env.get("SOLARIS_MAX_BAD_SHARE", "0.05")))
        return replace(s, **overrides)

    def job(self, start, end):
        from spark_jobs.common import JobArgs
        return JobArgs(self.data, self.offline, self.models, pd.Timestamp(start).isoformat(),
                       pd.Timestamp(end).isoformat())

    def store(self):
        from solaris_jobs import store_config
        return store_config.load(self.feature_repo)


def _share(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0 <= v <= 1:
        raise ValueError(f"SOLARIS_MAX_BAD_SHARE={raw!r}: need a share between 0 and 1")
    return v


def _utc(t) -> pd.Timestamp:
    from solaris_jobs.events import to_utc
    return to_utc(t)


def validate(s: RefreshSettings, start, end) -> dict:
    """The interval's events are readable and in the contract; counts (an empty hour is allowed, and said).

    Rows that read but break the contract (ids <= 0, labels other than 0/1) are counted per reason; selection
    sets them aside into ``rejects``. More than ``max_bad_share`` of the interval's rows bad fails the task: an
    upstream log that broke is stopped here, before hours of FM inference run on what is left of it.
    """
    from solaris_jobs.events import DataContractError, bad_event_counts, read_events
    start, end = _utc(start), _utc(end)
    t = read_events(s.data, start, end)
    n = t.num_rows
    users = len(set(t.column("user_id").to_pylist())) if n else 0
    bad = bad_event_counts(t)
    n_bad = sum(bad.values())
    if not n:
        logger.warning("no events in [%s, %s): the refresh still runs on the earlier log", start, end)
    elif n_bad > s.max_bad_share * n:
        raise DataContractError(
            f"{s.data}/events [{start.isoformat()}, {end.isoformat()}): {n_bad} of {n} rows break the event "
            f"contract ({', '.join(f'{k}: {v}' for k, v in bad.items() if v)}), more than "
            f"SOLARIS_MAX_BAD_SHARE={s.max_bad_share}; fix the log (or raise the limit) and rerun the interval")
    elif n_bad:
        logger.warning("[%s, %s): %d of %d rows will be set aside: %s", start, end, n_bad, n, bad)
    return {"interval_start": start.isoformat(), "interval_end": end.isoformat(), "events": n, "users": users,
            "bad_events": {k: v for k, v in bad.items() if v}}


def drain_misses(s: RefreshSettings, start=None, end=None) -> dict:
    """Moves the serving miss stream (Redis) into ``<offline>/misses/`` before selection reads it."""
    cfg = s.store()
    if cfg.kind != "redis":
        return {"skipped": "the SQLite store's misses are written to <offline>/misses/ directly"}
    from solaris_jobs.serving import drain_misses as drain
    return drain(cfg, s.offline)


def spark_step(s: RefreshSettings, step: str, start, end, spark=None) -> dict:
    """One of the Spark steps (select, embed, aggregate, neighbours) for the interval, in-process."""
    from solaris_jobs.spark import spark_session
    from spark_jobs import refresh
    if step not in SPARK_STEPS:
        raise ValueError(f"unknown Spark step {step!r}: {SPARK_STEPS}")
    spark = spark or spark_session(f"solaris-{step}", s.master)
    return refresh.run(spark, s.job(_utc(start), _utc(end)), s.precompute, (step,))[step]


def materialize(s: RefreshSettings, start, end) -> dict:
    from solaris_jobs.materialize import materialize as write
    return write(s.store(), s.offline, _utc(end), expire_from=s.expire_from, start=_utc(start))


def report(s: RefreshSettings, start, end) -> dict:
    """Coverage and freshness of the interval.

    Coverage: of the interval's actual events (the requests that came), the share whose pair had an embedding
    precomputed by the previous interval (ending at ``start``), else whose user had an aggregate, else a
    neighbour embedding, else none. Freshness: how old the interval's features are now, and what the online store
    holds. Written to ``<offline>/reports/end=.../report.json`` (local offline stores) and returned.
    """
    import pyarrow.dataset as ds

    from solaris_jobs.events import read_events
    from solaris_jobs.materialize import interval_dir, materialized_intervals
    start, end = _utc(start), _utc(end)
    ev = read_events(s.data, start, end, columns=["user_id", "item_id", "event_timestamp"]).to_pandas()

    def keys(dataset, cols):
        path = interval_dir(s.offline, dataset, start)
        if not Path(path, "_SUCCESS").exists():
            return None
        return ds.dataset(path, format="parquet").to_table(columns=cols).to_pandas()

    tiers = {"pair": 0, "user_aggregate": 0, "neighbour": 0, "none": 0}
    previous = {"pair_embeddings": keys("pair_embeddings", ["user_id", "item_id"]),
                "user_aggregates": keys("user_aggregates", ["user_id"]),
                "neighbours": keys("neighbours", ["user_id"])}
    if len(ev):
        left = ev
        for tier, name, on in (("pair", "pair_embeddings", ["user_id", "item_id"]),
                               ("user_aggregate", "user_aggregates", ["user_id"]),
                               ("neighbour", "neighbours", ["user_id"])):
            if previous[name] is None or not len(left):
                continue
            hit = left.merge(previous[name].drop_duplicates(), on=on, how="left", indicator=True)["_merge"] == "both"
            tiers[tier] = int(hit.sum())
            left = left[~hit.to_numpy()]
        tiers["none"] = len(ev) - sum(tiers.values())
    stored = materialized_intervals(s.store())
    latest = max(stored) if stored else None
    now = pd.Timestamp.now(tz="UTC")
    out = {"interval_start": start.isoformat(), "interval_end": end.isoformat(), "events": len(ev),
           "previous_interval_available": previous["pair_embeddings"] is not None,
           "coverage": {k: round(v / len(ev), 4) if len(ev) else None for k, v in tiers.items()},
           "coverage_counts": tiers,
           "materialized": end in stored, "latest_materialized_end": latest.isoformat() if latest else None,
           "feature_age_hours_now": round((now - end).total_seconds() / 3600, 2)}
    offline = str(s.offline).removeprefix("file://")
    if "://" not in offline:
        path = Path(interval_dir(offline, "reports", end))
        path.mkdir(parents=True, exist_ok=True)
        (path / "report.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def run_step(s: RefreshSettings, step: str, start, end, spark=None) -> dict:
    """Any step by name; the stats as plain JSON types (an Airflow XCom)."""
    if step in SPARK_STEPS:
        out = spark_step(s, step, start, end, spark)
    elif step in STEPS:
        out = {"validate": validate, "drain_misses": drain_misses, "materialize": materialize,
               "report": report}[step](s, start, end)
    else:
        raise ValueError(f"unknown step {step!r}: {STEPS}")
    return json.loads(json.dumps(out, default=str))


def interval_complete(s: RefreshSettings, end) -> bool:
    """The interval's outputs are all complete offline and it was materialized into the configured store."""
    from solaris_jobs.materialize import interval_dir, materialized_intervals
    end = _utc(end)
    done = all(Path(interval_dir(s.offline, d, end), "_SUCCESS").exists()
               for d in ("selection", "pair_embeddings", "user_aggregates", "neighbours"))
    return done and end in materialized_intervals(s.store())


def backfill(s: RefreshSettings, start, end, every="1h", force: bool = False, progress: bool = False) -> list:
    """Runs every step for each interval of ``[start, end)`` in order, skipping complete intervals (unless
    ``force``). A failing interval raises after logging which one; a rerun starts again from that interval.

    Returns:
        Per interval: {"interval_end", "status": "done" | "skipped", "steps": {step: stats}, "seconds": {...}}.
    """
    from solaris_jobs.events import split_intervals
    from solaris_jobs.spark import spark_session
    intervals = split_intervals(start, end, every)
    spark = None
    out = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(intervals), unit="interval", desc="backfill")
    try:
        for a, b in intervals:
            if not force and interval_complete(s, b):
                out.append({"interval_end": b.isoformat(), "status": "skipped"})
            else:
                steps, secs = {}, {}
                for step in STEPS:
                    if step in SPARK_STEPS and spark is None:
                        spark = spark_session("solaris-backfill", s.master)
                    t0 = time.perf_counter()
                    try:
                        steps[step] = run_step(s, step, a, b, spark)
                    except Exception:
                        logger.error("backfill: interval ending %s failed in step %s", b, step)
                        raise
                    secs[step] = round(time.perf_counter() - t0, 2)
                out.append({"interval_end": b.isoformat(), "status": "done", "steps": steps, "seconds": secs})
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{b.isoformat()} {out[-1]['status']}")
    finally:
        if bar is not None:
            bar.close()
    return out
