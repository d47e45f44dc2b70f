"""
### SOLARIS refresh

Every interval (hourly by default), after it closes: validate the interval's events, move serving misses into
the offline store, select candidate pairs (request simulator, negative exclusion, VM verifier, misses forced in),
run the FM on them, recompute user aggregates and neighbours, report the interval's coverage as the serving client
resolved it from the store it found, then materialize all three into the online store. Each output is an Airflow Asset
(`solaris_pair_embeddings`, ...), so other DAGs can be scheduled on it.

Configured by the environment of the workers: one settings object, built by
`solaris_jobs.core.settings.Settings.from_env()`
when a task runs (`SOLARIS_DATA`, `SOLARIS_OFFLINE`, `SOLARIS_MODELS`, `SOLARIS_PRECOMPUTE`, ...;
docs/configuration.md lists them all) and passed whole to the Spark steps, in-process or as `--settings` JSON through spark-submit.
DAG-level: `SOLARIS_REFRESH_CRON` (default `0 * * * *`), `SOLARIS_START_DATE`, `SOLARIS_END_DATE`, `SOLARIS_CATCHUP`,
`SOLARIS_SPARK_CONN_ID` (Spark steps through `SparkSubmitOperator` instead of in-process),
`SOLARIS_REDIS_CONN_ID` (the Redis online store from an Airflow connection instead of `SOLARIS_REDIS`),
`SOLARIS_FM_QUEUE` / `SOLARIS_FM_POOL` (send FM inference to GPU workers), `SOLARIS_OWNER` (the owner shown here).

**What a run did**: each output task's Asset Events tab (and this DAG's Overview, and each asset's page) shows its
step's numbers as the event's extra: pairs considered / excluded / selected, pairs embedded and FM pairs/s, users
aggregated, users with neighbours, rows written per view, coverage per tier and the features' age. Every task
(`validate` and `drain_misses` too: events read, bad rows, misses moved) pushes the same numbers as its XCom
`summary`, and the step's full stats as `return_value` (`stats` under spark-submit); `solaris status` lists the
last intervals from the stores alone. (A run's note is not set: the Task SDK's execution API gives a task no way to
write one; only a user can, through the UI or the REST API.)

**When a task fails**: its doc (Details tab) says which setting to check and how to rerun it; clearing a task and
its downstream reruns the interval from there, and a rerun replaces the interval's outputs whole.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, CronDataIntervalTimetable, get_current_context, task

ROOT = Path(__file__).resolve().parent.parent
SPARK_CONN = os.environ.get("SOLARIS_SPARK_CONN_ID")
REDIS_CONN = os.environ.get("SOLARIS_REDIS_CONN_ID")     # an Airflow connection for the Redis online store


def _prepare_store(context=None) -> None:
    """``SOLARIS_REDIS`` from the Airflow connection, when one is configured (before a task touches the store); an
    SQLite store under an executor that runs tasks on several hosts is refused."""
    from solaris_jobs.online.store_config import for_airflow_task
    for_airflow_task(_settings(), REDIS_CONN)


def _asset(name: str) -> Asset:
    # A stable URI (Airflow keeps name <-> URI pairs unique): moving the offline store must not orphan the asset.
    return Asset(name=f"solaris_{name}", uri=f"solaris://offline/{name}", group="solaris")


ASSETS = {n: _asset(n) for n in ("selection", "pair_embeddings", "pair_fallbacks", "user_aggregates", "user_states",
                                  "neighbours", "reports")}
ONLINE = Asset(name="solaris_online_store", uri="solaris://online-store/solaris_v3", group="solaris")

OWNER = os.environ.get("SOLARIS_OWNER") or "solaris"      # as settings.owner(): Feast shows the same
RERUN = ("\n\n**Rerun** the interval once fixed: clear this task (and its downstream) in the UI, or "
         "`solaris {cmd} --start <data_interval_start> --end <data_interval_end>` from a worker's environment; "
         "a rerun replaces the interval's outputs whole (nothing half-written is served). "
         "**Its numbers**: the asset event this task emits (its Asset Events tab) and its XCom `summary`; the "
         "full stats are its XCom `return_value` (`stats` under spark-submit).")
WHOLE = ("\n\n**Rerun**: clear the task (and its downstream) in the UI, or `solaris backfill --start "
         "<data_interval_start> --end <data_interval_end> --force` for the whole interval; its numbers are its XCom "
         "`summary`.")
DOCS = {
    "validate": "Reads the interval's events (hour partitions of the event log), counts them and the rows that "
                "break the contract (per reason; selection sets them aside). Fails on a missing or malformed log "
                "or when more than `SOLARIS_MAX_BAD_SHARE` (0.05) of the rows are bad. An empty hour is allowed "
                "(the refresh still runs on the earlier log).\n\n**If it fails**: the log names the file, "
                "column and count. Fix the upstream log (or raise `SOLARIS_MAX_BAD_SHARE` if the share is "
                "expected) and clear the task; `SOLARIS_DATA` must point at the event log root." + WHOLE,
    "drain_misses": "Moves the Redis miss stream (pairs the ranker asked for without a fresh embedding) into "
                    "`<offline>/misses/`, where selection forces them in. Nothing to do with SQLite.\n\n"
                    "**If it fails**: Redis is unreachable or refused the login: check `SOLARIS_REDIS` or the "
                    "connection `SOLARIS_REDIS_CONN_ID` names; undrained misses stay in the stream for the next "
                    "run. By hand: `solaris misses drain --offline <offline>`." + WHOLE,
    "select": "Active users and their simulated candidates, negative exclusion, VM verifier scores, top share "
              "selected. Output: offline `selection`.\n\n**If it fails**: a missing `vm.pt` or a "
              "`history_len` that is not the models' (`SOLARIS_MODELS`, `SOLARIS_PRECOMPUTE`), Spark out of "
              "memory (`SOLARIS_SPARK_DRIVER_MEMORY`, or the cluster's executors), or another run holding the "
              "interval's lease (wait for it, or `SOLARIS_LEASE_MINUTES`)." + RERUN.format(cmd="select"),
    "embed": "Batched FM + autoencoder inference on the selected pairs (GPU pool/queue when configured). "
             "Output: offline `pair_embeddings` (non-finite outputs set aside in `embedding_rejects`, counted)."
             "\n\n**If it fails**: `fm.pt`/`ae.pt` missing or of another FM (the message names the file), or "
             "memory: lower `batch_size` in `SOLARIS_PRECOMPUTE`." + RERUN.format(cmd="embed"),
    "aggregate": "Mean pair embedding per user over the trailing 24 h, and the item-aware fallback of each pair "
                 "ranked, missed or left out by the selection lately without one (the user's pair embeddings "
                 "weighted by item similarity). "
                 "Outputs: offline `user_aggregates`, `pair_fallbacks`.\n\n"
                 "**If it fails**: it needs this interval's complete `pair_embeddings`: rerun `embed` first."
                 + RERUN.format(cmd="aggregate"),
    "neighbours": "FM user embeddings, FAISS top-k, neighbour embeddings. Outputs: `user_embeddings`, "
                  "`neighbours`.\n\n**If it fails**: it needs this interval's `user_aggregates`; driver memory "
                  "holds the FAISS index (1M users x 128 floats = 512 MB): raise `SOLARIS_SPARK_DRIVER_MEMORY`."
                  + RERUN.format(cmd="neighbours"),
    "materialize": "Writes the interval's five views into the online store (Feast layout, per-view expiry). "
                   "Fails the task on any store error; only complete intervals are recorded.\n\n**If it "
                   "fails**: a Spark step before it failed (fix that one first), or the store refused the writes "
                   "(`FEAST_FS_YAML_FILE_PATH`, `SOLARIS_REDIS`). To rerun: clear it (it rewrites the interval), or "
                   "`solaris materialize --start <data_interval_start> --end <data_interval_end>`. Its asset event gives "
                   "the rows written per view.",
    "report": "Coverage of the interval's logged requests as the serving client resolved them from the online "
              "store the interval found (pair, aggregate, neighbour, none; TTL and model version applied), before "
              "this refresh's features are written, and freshness; `<offline>/reports/end=.../report.json`. "
              "Coverage per tier and the features' age are on its asset event.\n\n**If it fails**: diagnostic "
              "only: materialize still runs (trigger rule `all_done`). Usually the online store was unreachable "
              "or `SOLARIS_MODELS` has no `fm.pt`/`ae.pt`. Clear the task to rerun it (it reads the store as it "
              "is then, so rerun it before materialize to see what the interval found).",
}


def _settings():
    from solaris_jobs.core.settings import Settings
    return Settings.from_env()


def _announce(step: str, stats: dict, ctx) -> None:
    """The step's headline numbers (``run_summary.step_summary``) as the extra of every asset event the task emits
    and as its small XCom ``summary`` (tasks without an output asset too): what an operator sees on the run's,
    the task's and the asset's pages without opening a log."""
    from solaris_jobs.flows.run_summary import step_summary
    extra = step_summary(step, stats)
    for asset in ctx["task"].outlets:
        ctx["outlet_events"][asset].extra = extra
    ctx["ti"].xcom_push(key="summary", value=extra)


def _run(step: str) -> dict:
    from solaris_jobs.flows import refresh_steps as o
    ctx = get_current_context()
    _prepare_store()
    # The run id owns the interval's lease for the run's steps: another run of the same interval (a backfill beside
    # the schedule) stops with a clear error instead of mixing its outputs with this one's.
    stats = o.run_step(_settings(), step, ctx["data_interval_start"], ctx["data_interval_end"], owner=ctx["run_id"])
    _announce(step, stats, ctx)
    return stats


def _announce_published(step: str):
    """For a step run by spark-submit (another process): its published stats, read back after it, announced."""
    def post_execute(context, result=None):
        from solaris_jobs.flows import refresh_steps as o
        stats = o.published_stats(_settings(), step, context["data_interval_end"])
        _announce(step, stats, context)
        context["ti"].xcom_push(key="stats", value=stats)   # spark-submit returns nothing: the full stats here
    return post_execute


def _settings_json() -> str:
    """The worker's settings, whole, for spark-submit (rendered when the task runs, not when the DAG is parsed)."""
    return _settings().for_spark_submit().to_json()


def _submit_settings(task) -> None:
    """The step's spark-submit settings (``SOLARIS_SPARK_SUBMIT``: conf, a packed environment or py-files, env vars,
    deploy mode, where the cluster finds the script) set on its operator when the task runs: the DAG file imports
    nothing of SOLARIS when it is parsed."""
    from solaris_jobs.core.settings import Settings
    args = Settings.from_env(require=False).spark_submit.operator_args(task.task_id, Path(task.application).name,
                                                                        str(ROOT / "spark_jobs"))
    task.application, task.conf, task.py_files = args["application"], args["conf"], args["py_files"]
    task._archives, task.env_vars = args["archives"], args["env_vars"]
    if "deploy_mode" in args:
        task._deploy_mode = args["deploy_mode"]


def _before_spark_submit(context=None) -> None:
    """Before spark-submit runs (``pre_execute``: an exception here fails the task; Airflow only logs one raised by
    an ``on_execute_callback``): the online store prepared and checked, the step's spark-submit settings applied,
    and a deploy mode the connection's master cannot run a Python driver in refused."""
    from airflow.sdk import Connection
    _prepare_store()
    _submit_settings(context["task"])
    c = Connection.get(SPARK_CONN)
    master = f"{c.host}:{c.port}" if c.port else str(c.host)
    _settings().spark_submit.check_master(master, c.extra_dejson.get("deploy-mode"))


def _spark_submit(step: str, script: str, **kwargs):
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    args = ["--settings", "{{ solaris_settings() }}",
            "--start", "{{ data_interval_start.isoformat() }}", "--end", "{{ data_interval_end.isoformat() }}",
            "--lease-owner", "{{ run_id }}"]
    # The step's spark-submit settings (SOLARIS_SPARK_SUBMIT) are applied when the task runs (_before_spark_submit;
    # a bad value fails it naming the variable). In client mode spark-submit inherits the task's environment: the
    # driver takes the interval's lease in the same store.
    return SparkSubmitOperator(task_id=step, application=str(ROOT / "spark_jobs" / script), conn_id=SPARK_CONN,
                               application_args=args, doc_md=DOCS[step], pre_execute=_before_spark_submit,
                               post_execute=_announce_published(step), **kwargs)


with DAG(
    dag_id="solaris_refresh",
    schedule=CronDataIntervalTimetable(os.environ.get("SOLARIS_REFRESH_CRON", "0 * * * *"), timezone="UTC"),
    start_date=datetime.fromisoformat(os.environ.get("SOLARIS_START_DATE", "2026-01-01T00:00:00+00:00")),
    end_date=datetime.fromisoformat(os.environ["SOLARIS_END_DATE"]) if os.environ.get("SOLARIS_END_DATE") else None,
    catchup=os.environ.get("SOLARIS_CATCHUP", "false").lower() == "true",
    max_active_runs=1,
    default_args={"owner": OWNER, "retries": int(os.environ.get("SOLARIS_RETRIES", "2")),
                  "retry_delay": timedelta(minutes=float(os.environ.get("SOLARIS_RETRY_MINUTES", "5"))),
                  "retry_exponential_backoff": True,
                  "execution_timeout": timedelta(hours=2),
                  # An interval builds on the one before (negative-exclusion history, trailing aggregates): a
                  # backfill's runs (Airflow runs up to its own --max-active-runs at once, 10 by default) go
                  # through each step one at a time (the oldest ready interval first), pipelined across steps.
                  "max_active_tis_per_dag": 1},
    dagrun_timeout=timedelta(hours=6),
    user_defined_macros={"solaris_settings": _settings_json},
    tags=["solaris", "features"],
    doc_md=__doc__,
) as dag:
    @task(doc_md=DOCS["validate"], execution_timeout=timedelta(minutes=20))
    def validate() -> dict:
        return _run("validate")

    @task(doc_md=DOCS["drain_misses"], execution_timeout=timedelta(minutes=20))
    def drain_misses() -> dict:
        return _run("drain_misses")

    # The report before it is diagnostic: its failure must not keep the interval's features from being published
    # (all_done; a failed Spark step still fails materialize, which finds no complete output to write).
    @task(doc_md=DOCS["materialize"], outlets=[ONLINE], execution_timeout=timedelta(hours=1),
          trigger_rule="all_done")
    def materialize() -> dict:
        return _run("materialize")

    @task(doc_md=DOCS["report"], outlets=[ASSETS["reports"]], execution_timeout=timedelta(minutes=20))
    def report() -> dict:
        return _run("report")

    fm_queue = {k: v for k, v in (("queue", os.environ.get("SOLARIS_FM_QUEUE")),
                                  ("pool", os.environ.get("SOLARIS_FM_POOL"))) if v}
    spark_tasks = []
    for step, script, outlets, extra in (
            ("select", "select_candidates.py", [ASSETS["selection"]], {}),
            ("embed", "fm_inference.py", [ASSETS["pair_embeddings"]], fm_queue),
            ("aggregate", "user_aggregates.py", [ASSETS["user_aggregates"], ASSETS["pair_fallbacks"]], {}),
            ("neighbours", "neighbours.py", [ASSETS["user_states"], ASSETS["neighbours"]], {})):
        if SPARK_CONN:
            spark_tasks.append(_spark_submit(step, script, outlets=outlets, **extra))
        else:
            spark_tasks.append(task(task_id=step, doc_md=DOCS[step], outlets=outlets, **extra)(_run)(step))

    first = validate() >> drain_misses()
    chain = first
    for t in spark_tasks:
        chain = chain >> t
    # The report serves the interval's requests again from the store they met, so it runs before materialize.
    chain >> report() >> materialize()
