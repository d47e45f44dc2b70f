"""One whole refresh of an interval in one Spark session: selection -> FM inference -> user aggregates ->
neighbours. (The Airflow DAG runs the same steps as separate tasks.)"""
from __future__ import annotations

from spark_jobs import fm_inference, neighbours, select_candidates, user_aggregates

STEPS = {"select": select_candidates.run, "embed": fm_inference.run, "aggregate": user_aggregates.run,
         "neighbours": neighbours.run}


def run(spark, job, cfg, steps=tuple(STEPS)) -> dict:
    return {name: STEPS[name](spark, job, cfg) for name in steps}


if __name__ == "__main__":
    from spark_jobs.common import entry
    entry(run, __doc__)
