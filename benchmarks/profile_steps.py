"""Where a refresh step's time goes: runs steps of one interval of ``benchmarks/scale.py``'s data in one Spark
session (``local[2]``) and reads the Spark UI's REST API back: every Spark job longer than ``--min-seconds`` (wall)
and the stages with the most task time (rows in, shuffled, spilled).

    .venv/bin/python benchmarks/profile_steps.py --users 100000 --steps select embed aggregate neighbours

Uses ``scale.py``'s log, models and settings (``--config``) under ``--work``: run ``scale.py`` for that size first
(it generates the log and trains the models). Writes to the configuration's offline folder there, as ``scale.py``
does. Prints only; a profile is a guide to where to look, not a figure to quote (the steps share one warm
session here, unlike ``scale.py``'s fresh process per size).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    import pandas as pd

    import scale
    from solaris_jobs.data import synth
    from solaris_jobs.pipeline import jobs
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--steps", nargs="+", default=list(jobs.SPARK_STEPS), choices=jobs.SPARK_STEPS)
    ap.add_argument("--config", choices=("per-user-share", "evaluated"), default="evaluated")
    ap.add_argument("--work", default="/tmp/scale/work")
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--days", type=float, default=2.0)
    ap.add_argument("--min-seconds", type=float, default=0.8)
    ap.add_argument("--top-stages", type=int, default=15)
    ap.add_argument("--steady", action="store_true", help="run the steps for the hour before first (not profiled), "
                    "so that the last hour's select updates that hour's state, as in scale.py --steady")
    a = ap.parse_args()
    work = Path(a.work)
    data, offline = scale.folders(work, a.users, a.days, a.config)
    if not (data / "manifest.json").exists() or not (work / "models" / "vm.pt").exists():
        sys.exit(f"no log or models under {work}: run benchmarks/scale.py --users {a.users} --work {work} first")
    s = scale.settings_for(a.config, data, offline, work / "models", "local[2]")
    cfg = synth.SynthConfig(users=a.users, items=a.items, days=a.days, seed=0)
    end = pd.Timestamp(cfg.start) + pd.Timedelta(days=a.days)
    start = end - pd.Timedelta(hours=1)
    spark = jobs.session(s, "profile")
    sc = spark.sparkContext
    try:
        if a.steady:
            sc.setJobGroup("previous", "previous")
            jobs.run(spark, s, start - pd.Timedelta(hours=1), start, tuple(a.steps))
        for step in a.steps:
            sc.setJobGroup(step, step)
            t0 = time.perf_counter()
            jobs.run(spark, s, start, end, (step,))
            print(f"== {step}: {time.perf_counter() - t0:.1f} s", flush=True)

        def get(path):
            return json.load(urllib.request.urlopen(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/{path}"))

        def seconds(j):
            return (pd.Timestamp(j["completionTime"].replace("GMT", "")) -
                    pd.Timestamp(j["submissionTime"].replace("GMT", ""))).total_seconds()
        for j in sorted(get("jobs"), key=lambda j: j["jobId"]):
            if "completionTime" in j and seconds(j) >= a.min_seconds and j.get("jobGroup") != "previous":
                print(f"job {j['jobId']:4d} {seconds(j):6.1f} s  {j.get('jobGroup')}  {j['name'][:80]}")
        print("-- stages by task time")
        profiled = {i for j in get("jobs") if j.get("jobGroup") != "previous" for i in j["stageIds"]}
        for x in sorted((x for x in get("stages") if x["stageId"] in profiled),
                        key=lambda x: -x["executorRunTime"])[:a.top_stages]:
            print(f"stage {x['stageId']:4d} task {x['executorRunTime'] / 1000:7.1f} s  tasks {x['numTasks']:4d}  rows in "
                  f"{x['inputRecords']:>11,}  shuffle read {x['shuffleReadRecords']:>11,} write "
                  f"{x['shuffleWriteRecords']:>11,}  spill {x['diskBytesSpilled'] >> 20} MB  {x['name'][:50]}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
