"""The refresh DAG's per-task times under the real Airflow services vs the same task functions in one process,
side by side in one run, on the MovieLens demo's data and seed-0 checkpoints (run ``make demo-movielens`` first):

1. Airflow (``--modes``): ``LocalAirflow`` (API server, scheduler, DAG processor, triggerer; LocalExecutor, SQLite
   metadata DB on a free port, started and stopped here); the intervals are backfilled with Airflow's own
   ``airflow backfill create --max-active-runs 1``; task durations are read back from the REST API. Every task is
   its own process. ``classic``: each Spark step starts its own local Spark (a JVM per task); ``connect``: the
   Spark steps connect to the Spark Connect server ``solaris airflow`` starts beside the scheduler.
2. The floor: in the same Airflow, a DAG of 8 empty tasks (what any task costs the scheduler and the task
   process: start, DAG parse, state updates), triggered once per run of the refresh.
3. In-process: ``solaris backfill`` (``orchestration.backfill``) over the same intervals into another offline
   store: one Python process, one Spark session, no scheduler.

Per-task overhead = a task's duration under Airflow - the same task in process; the target (#13) is at most 5 s
above the floor's mean task.

    .venv/bin/python benchmarks/airflow_refresh.py --intervals 2 [--modes classic connect]

Saves benchmarks/results/airflow_refresh.json. Each writes an embedded SQLite online store of its own.
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
from solaris_jobs.flows.demo import movielens_env  # noqa: E402
from tests.support import feast_yaml  # noqa: E402

HOUR = pd.Timedelta(hours=1)


FLOOR_DAG = """
from datetime import datetime

from airflow.sdk import DAG, task

with DAG("solaris_floor", schedule=None, start_date=datetime(2020, 1, 1), catchup=False, tags=["benchmark"]):
    prev = None
    for k in range(8):
        @task(task_id=f"empty_{k}")
        def empty():
            return None
        t = empty()
        if prev is not None:
            prev >> t
        prev = t
"""


def _airflow(mode: str, tmp: Path, work: Path, models: Path, args, start, end) -> dict:
    """One Airflow (``classic`` or ``connect``): the refresh backfilled over the intervals, and the floor DAG run
    after each refresh run; task durations from the REST API."""
    d = tmp / mode
    dags = d / "dags"
    dags.mkdir(parents=True)
    for f in (ROOT / "dags").glob("*.py"):
        (dags / f.name).symlink_to(f)
    (dags / "solaris_floor.py").write_text(FLOOR_DAG)
    env = {k: v for k, v in movielens_env(d, models, args.master, end).items() if k.startswith("SOLARIS_")}
    env.update(Settings.from_env(env, data=str(work / "data"), offline=str(d / "offline"),
                                 spark_driver_memory="1g").to_env(),
               FEAST_FS_YAML_FILE_PATH=str(_sqlite_yaml(d)))
    t0 = time.perf_counter()
    with LocalAirflow(d / "home", env=env, parallelism=2, spark_connect=mode == "connect", dags_folder=dags) as af:
        started = time.perf_counter() - t0
        af.wait_for_dag("solaris_refresh")
        af.wait_for_dag("solaris_floor")
        af.api("PATCH", "/api/v2/dags/solaris_refresh", {"is_paused": False})
        af.api("PATCH", "/api/v2/dags/solaris_floor", {"is_paused": False})
        t1 = time.perf_counter()
        res = af.cli("backfill", "create", "--dag-id", "solaris_refresh", "--from-date", start.isoformat(),
                     "--to-date", (end - HOUR).isoformat(), "--max-active-runs", "1")
        if res.returncode != 0:
            sys.exit(f"airflow backfill create failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        runs = af.runs("solaris_refresh", run_type="backfill")
        tasks, floor = {}, []
        for r in sorted(runs, key=lambda r: r["data_interval_end"]):
            state = af.wait_for_run("solaris_refresh", r["dag_run_id"], timeout=3600)
            tasks[r["data_interval_end"]] = {"state": state, "seconds": _durations(af, "solaris_refresh",
                                                                                    r["dag_run_id"])}
        wall = time.perf_counter() - t1
        for k in range(len(runs)):                      # after the refresh, so that the two never share the cores
            rid = af.api("POST", "/api/v2/dags/solaris_floor/dagRuns",
                         {"logical_date": None, "dag_run_id": f"floor_{k}"})["dag_run_id"]
            af.wait_for_run("solaris_floor", rid, timeout=600)
            floor.extend(_durations(af, "solaris_floor", rid).values())
    return {"services_start_s": round(started, 1), "backfill_wall_s": round(wall, 1), "runs": tasks,
            "floor_task_s": floor, "floor_mean_s": round(sum(floor) / len(floor), 2) if floor else None}


def _durations(af: LocalAirflow, dag_id: str, run_id: str) -> dict:
    tis = af.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {t["task_id"]: round(t["duration"], 2) for t in tis if t["duration"] is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=str(ROOT / "artifacts" / "demo-movielens"),
                    help="the MovieLens demo's workdir")
    ap.add_argument("--end", default="1998-03-01T00:00:00Z", help="end of the last interval")
    ap.add_argument("--intervals", type=int, default=2)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--modes", nargs="+", default=["classic", "connect"], choices=["classic", "connect"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "airflow_refresh.json"))
    args = ap.parse_args()
    work, end = Path(args.workdir).resolve(), pd.Timestamp(args.end)
    models = work / "models" / "seed0"
    if not (models / "fm.pt").exists():
        sys.exit(f"{models}/fm.pt is missing: run `make demo-movielens` first")
    start = end - args.intervals * HOUR
    tmp = Path(tempfile.mkdtemp(prefix="solaris-bench-airflow-"))
    result = {"intervals": [(start + k * HOUR).isoformat() for k in range(1, args.intervals + 1)],
              "master": args.master, "cpus": os.cpu_count(), "modes": args.modes}
    for mode in args.modes:
        result[f"airflow_{mode}"] = _airflow(mode, tmp, work, models, args, start, end)

    # The same task functions in one process (solaris backfill).
    env = {k: v for k, v in movielens_env(tmp / "inproc", models, args.master, end).items()
           if k.startswith("SOLARIS_")}
    (tmp / "inproc").mkdir(exist_ok=True)
    env.update(Settings.from_env(env, data=str(work / "data"), offline=str(tmp / "inproc" / "offline"),
                                 spark_driver_memory="1g").to_env())
    os.environ.update(env, FEAST_FS_YAML_FILE_PATH=str(_sqlite_yaml(tmp / "inproc")))
    s = Settings.from_env()
    t1 = time.perf_counter()
    out = o.backfill(s, start, end, force=True)
    result["in_process"] = {"backfill_wall_s": round(time.perf_counter() - t1, 1),
                            "runs": {r["interval_end"]: {"state": r["status"], "seconds": r["seconds"]} for r in out}}

    steps = o.STEPS
    kinds = [f"airflow_{m}" for m in args.modes] + ["in_process"]
    print(f"{'':28s}{'interval end':27s}" + "".join(f"{s_[:9]:>10s}" for s_ in steps) + f"{'total':>9s}")
    for kind in kinds:
        for e, r in result[kind]["runs"].items():
            secs = r["seconds"]
            print(f"{kind:28s}{pd.Timestamp(e).isoformat():27s}"
                  + "".join(f"{secs.get(s_, float('nan')):10.1f}" for s_ in steps)
                  + f"{sum(secs.values()):9.1f}  {r['state']}")
        print(f"{kind:28s}backfill wall {result[kind]['backfill_wall_s']} s"
              + (f"; empty task (floor) {result[kind]['floor_mean_s']} s" if "floor_mean_s" in result[kind] else ""))
    # Per-task overhead over the in-process run, per Spark step, averaged over the intervals.
    inproc = list(result["in_process"]["runs"].values())
    for kind in kinds[:-1]:
        runs = list(result[kind]["runs"].values())
        over = {st: round(sum(r["seconds"].get(st, 0) - i["seconds"].get(st, 0) for r, i in zip(runs, inproc))
                          / len(runs), 2) for st in steps}
        result[kind]["overhead_over_in_process_s"] = over
        floor = result[kind]["floor_mean_s"] or 0.0
        result[kind]["overhead_above_floor_s"] = {st: round(v - floor, 2) for st, v in over.items()}
        print(f"{kind:28s}overhead per task over in-process (s): {over}; above the empty task's "
              f"{result[kind]['floor_mean_s']} s: {result[kind]['overhead_above_floor_s']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


def _sqlite_yaml(d: Path) -> Path:
    return feast_yaml(d / "fs.yaml", f"  type: sqlite\n  path: {d / 'online.db'}")


if __name__ == "__main__":
    main()
