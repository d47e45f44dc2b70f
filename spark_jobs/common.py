"""Argument parsing and settings shared by the Spark entry points (run in-process or with spark-submit)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from solaris_jobs.candidates import SimulatorConfig
from solaris_jobs.precompute import PrecomputeConfig


@dataclass(frozen=True)
class JobArgs:
    """Where things are and which interval to run. ``models`` holds fm.pt, ae.pt and vm.pt."""
    data: str
    offline: str
    models: str
    start: str
    end: str

    def model(self, kind: str) -> str:
        path = Path(self.models) / f"{kind}.pt"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no {kind.upper()} checkpoint (train one with `solaris train {kind}`)")
        return str(path)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", required=True, help="Data root with the event log.")
    p.add_argument("--offline", required=True, help="Offline store root (outputs, keyed by interval end).")
    p.add_argument("--models", required=True, help="Folder with fm.pt, ae.pt, vm.pt.")
    p.add_argument("--start", required=True, help="Interval start (UTC, inclusive).")
    p.add_argument("--end", required=True, help="Interval end (UTC, exclusive); the cutoff T.")
    p.add_argument("--master", default=None, help="Spark master (default: spark-submit's, or local[*]).")
    p.add_argument("--select-share", type=float, default=0.2, help="Share of scored pairs sent to the FM.")
    p.add_argument("--select-scope", choices=["user", "global"], default="user",
                   help="user: top share of each user's candidates; global: top share of all pairs.")
    p.add_argument("--exclusion-runs", type=int, default=3,
                   help="K: skip pairs in their user's bottom share in each of the last K runs (0: off).")
    p.add_argument("--exclusion-share", type=float, default=0.5, help="The bottom share for negative exclusion.")
    p.add_argument("--active-hours", type=float, default=24.0,
                   help="Users with an event in the last this many hours before T are expected soon.")
    p.add_argument("--lookback-days", type=float, default=30.0,
                   help="History, counters and co-visitation read this many days before T (0: all).")
    p.add_argument("--candidates", type=int, default=200, help="Request-simulator candidates per user.")
    p.add_argument("--batch-size", type=int, default=1024, help="Rows per model batch on executors.")
    p.add_argument("--history-len", type=int, default=50, help="FM history length (as the FM was trained).")
    p.add_argument("--knn-k", type=int, default=10, help="Neighbours per user.")
    p.add_argument("--knn-exact-max", type=int, default=100_000,
                   help="Exact FAISS search up to this many users, HNSW above (recall measured and logged).")
    p.add_argument("--aggregate-hours", type=float, default=24.0, help="Window of the user aggregate.")
    p.add_argument("--miss-hours", type=float, default=24.0,
                   help="Serving misses recorded this many hours before T are forced into the selection.")
    p.add_argument("--device", default="auto", help="Torch device for the models (auto: CUDA when present).")
    p.add_argument("--stats-out", default=None, help="Also write the job's stats (JSON) to this local file.")
    return p


def config(ns: argparse.Namespace) -> tuple[JobArgs, PrecomputeConfig]:
    from solaris_jobs.events import to_utc
    start, end = to_utc(ns.start), to_utc(ns.end)
    if end <= start:
        raise ValueError(f"interval end {end} is not after its start {start}")
    job = JobArgs(ns.data, ns.offline, ns.models, start.isoformat(), end.isoformat())
    cfg = PrecomputeConfig(
        simulator=SimulatorConfig(n_candidates=ns.candidates, n_popular=ns.candidates // 2),
        active_hours=ns.active_hours, lookback_days=ns.lookback_days or None, select_share=ns.select_share,
        select_scope=ns.select_scope, exclusion_runs=ns.exclusion_runs, exclusion_share=ns.exclusion_share,
        batch_size=ns.batch_size, history_len=ns.history_len, knn_k=ns.knn_k, knn_exact_max=ns.knn_exact_max,
        aggregate_hours=ns.aggregate_hours, miss_hours=ns.miss_hours, device=ns.device)
    return job, cfg


def entry(run, description: str, argv=None) -> dict:
    """Parses arguments, gets the Spark session and calls ``run(spark, job, cfg)``; prints the stats as JSON."""
    import json

    from solaris_jobs.spark import spark_session
    logging.basicConfig(level=os.environ.get("SOLARIS_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    ns = parser(description).parse_args(argv)
    job, cfg = config(ns)
    spark = spark_session(f"solaris-{run.__module__.rsplit('.', 1)[-1]}", ns.master)
    stats = run(spark, job, cfg)
    text = json.dumps(stats, indent=2, sort_keys=True, default=str)
    if ns.stats_out:
        with open(ns.stats_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return stats
