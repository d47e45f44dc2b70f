"""The refresh DAG's per-task times under the real Airflow services vs the same task functions in one process,
side by side in one run, on the demo's MovieLens data and seed-0 checkpoints (run ``make demo`` first):

1. Airflow: ``LocalAirflow`` (API server, scheduler, DAG processor, triggerer; LocalExecutor, SQLite metadata DB
   on a free port, started and stopped here); the intervals are backfilled with Airflow's own
   ``airflow backfill create --max-active-runs 1``; task durations are read back from the REST API. Every task is
   its own process, so each Spark step starts its own local Spark.
2. In-process: ``solaris backfill`` (``orchestration.backfill``) over the same intervals into a second offline
   store: one Python process, one Spark session, no scheduler.

    .venv/bin/python benchmarks/airflow_refresh.py --intervals 2

Saves benchmarks/results/airflow_refresh.json. Both write embedded SQLite online stores of their own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solaris_jobs.core.settings import Settings  # noqa: E402
from solaris_jobs.dev.airflow_local import LocalAirflow  # noqa: E402
from solaris_jobs.flows import refresh_steps as o  # noqa: E402
from solaris_jobs.flows.demo import _settings_env  # noqa: E402
from tests.support import feast_yaml  # noqa: E402

HOUR = pd.Timedelta(hours=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=str(ROOT / "artifacts" / "demo"), help="the demo's workdir")
    ap.add_argument("--end", default="1998-03-01T00:00:00Z", help="end of the last interval")
    ap.add_argument("--intervals", type=int, default=2)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "airflow_refresh.json"))
    args = ap.parse_args()
    work, end = Path(args.workdir).resolve(), pd.Timestamp(args.end)
    models = work / "models" / "seed0"
    if not (models / "fm.pt").exists():
        sys.exit(f"{models}/fm.pt is missing: run `make demo` first")
    start = end - args.intervals * HOUR
    tmp = Path(tempfile.mkdtemp(prefix="solaris-bench-airflow-"))
    result = {"intervals": [(start + k * HOUR).isoformat() for k in range(1, args.intervals + 1)],
              "master": args.master, "cpus": os.cpu_count()}

    # 1. Airflow, each task in its own process.
    for d in ("af", "inproc"):
        (tmp / d).mkdir()
    env = {k: v for k, v in _settings_env(tmp / "af", models, args.master, end).items()
           if k.startswith("SOLARIS_")}
    env.update(Settings.from_env(env, data=str(work / "data"), offline=str(tmp / "af" / "offline"),
                                 spark_driver_memory="1g").to_env(),
               FEAST_FS_YAML_FILE_PATH=str(_sqlite_yaml(tmp / "af")))
    t0 = time.perf_counter()
    with LocalAirflow(tmp / "af" / "home", env=env, parallelism=2) as af:
        started = time.perf_counter() - t0
        af.wait_for_dag("solaris_refresh")
        af.api("PATCH", "/api/v2/dags/solaris_refresh", {"is_paused": False})
        t1 = time.perf_counter()
        res = af.cli("backfill", "create", "--dag-id", "solaris_refresh", "--from-date", start.isoformat(),
                     "--to-date", (end - HOUR).isoformat(), "--max-active-runs", "1")
        if res.returncode != 0:
            sys.exit(f"airflow backfill create failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        runs = af.runs("solaris_refresh", run_type="backfill")
        tasks = {}
        for r in sorted(runs, key=lambda r: r["data_interval_end"]):
            state = af.wait_for_run("solaris_refresh", r["dag_run_id"], timeout=3600)
            tis = af.api("GET", f"/api/v2/dags/solaris_refresh/dagRuns/{r['dag_run_id']}/taskInstances")
            tasks[r["data_interval_end"]] = {"state": state, "seconds": {
                t["task_id"]: round(t["duration"], 1) for t in tis["task_instances"] if t["duration"] is not None}}
        result["airflow"] = {"services_start_s": round(started, 1),
                             "backfill_wall_s": round(time.perf_counter() - t1, 1), "runs": tasks}

    # 2. The same task functions in one process (solaris backfill).
    os.environ.update(env, FEAST_FS_YAML_FILE_PATH=str(_sqlite_yaml(tmp / "inproc")))
    s = Settings.from_env(offline=str(tmp / "inproc" / "offline"))
    t1 = time.perf_counter()
    out = o.backfill(s, start, end, force=True)
    result["in_process"] = {"backfill_wall_s": round(time.perf_counter() - t1, 1),
                            "runs": {r["interval_end"]: {"state": r["status"], "seconds": r["seconds"]} for r in out}}

    steps = o.STEPS
    print(f"{'':28s}{'interval end':27s}" + "".join(f"{s_[:9]:>10s}" for s_ in steps) + f"{'total':>9s}")
    for kind in ("airflow", "in_process"):
        for e, r in result[kind]["runs"].items():
            secs = r["seconds"]
            print(f"{kind:28s}{pd.Timestamp(e).isoformat():27s}"
                  + "".join(f"{secs.get(s_, float('nan')):10.1f}" for s_ in steps)
                  + f"{sum(secs.values()):9.1f}  {r['state']}")
        print(f"{kind:28s}backfill wall {result[kind]['backfill_wall_s']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


def _sqlite_yaml(d: Path) -> Path:
    return feast_yaml(d / "fs.yaml", f"  type: sqlite\n  path: {d / 'online.db'}")


if __name__ == "__main__":
    main()
