"""
### SOLARIS training

Weekly (or on demand): train the FM, its autoencoder, the verifier VM and the transfer VM (the ranker's model,
which takes SOLARIS features, trained on what the store would serve it) on the event log, into a new version folder; publish it by switching the
`current` link atomically; then re-embed the latest refreshed interval with the new models and materialize it,
so that the online store holds embeddings of the new version. Old-version embeddings are never mixed with new
ones: user aggregates only average pairs of one version, and the serving client only serves the version the
ranker's VM was trained with (until the ranker loads the new VM it gets tier none for re-embedded keys).

Environment (read by `solaris_jobs.core.settings` when a task runs): `SOLARIS_DATA`, `SOLARIS_MODEL_REGISTRY` (holds
`versions/<stamp>/` and the `current` link; point `SOLARIS_MODELS` at `<registry>/current` for the refresh DAG),
`SOLARIS_TRAIN` (JSON: epochs, history_len, d_model, layers, d_interaction, d_code, max_train_rows, batch_size,
seed, served_hours and served_every: the replay the ranker's VM is trained on),
plus the refresh DAG's settings for the re-embedding. DAG-level: `SOLARIS_TRAIN_CRON` (default weekly, `none` for
on demand only).
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Asset, CronTriggerTimetable, get_current_context, task

CRON = os.environ.get("SOLARIS_TRAIN_CRON", "0 3 * * 0")
OWNER = os.environ.get("SOLARIS_OWNER") or "solaris"      # as settings.owner(): Feast shows the same
KINDS = ("fm", "ae", "vm", "vm_transfer")
# The published model version (its event's extra: the version, its embedding version and every model's metrics)
# and the online store the re-embedding rewrites (the refresh DAG's asset of the same name).
MODELS = Asset(name="solaris_models", uri="solaris://model-registry/current", group="solaris")
ONLINE = Asset(name="solaris_online_store", uri="solaris://online-store/solaris_v3", group="solaris")
RERUN = ("\n\n**If it fails**: the log names the file or setting (`SOLARIS_DATA`, `SOLARIS_MODEL_REGISTRY`, "
         "`SOLARIS_TRAIN`); `current` is switched only by `publish`, so the refresh keeps serving the last good "
         "version meanwhile. Clear the task to retry it; its metrics are its XCom `return_value`.")

with DAG(
    dag_id="solaris_train",
    schedule=None if CRON.lower() == "none" else CronTriggerTimetable(CRON, timezone="UTC"),
    start_date=datetime.fromisoformat(os.environ.get("SOLARIS_START_DATE", "2026-01-01T00:00:00+00:00")),
    catchup=False,
    max_active_runs=1,
    default_args={"owner": OWNER, "retries": int(os.environ.get("SOLARIS_RETRIES", "1")),
                  "retry_delay": timedelta(minutes=10),
                  "execution_timeout": timedelta(hours=12)},
    tags=["solaris", "training"],
    doc_md=__doc__,
) as dag:
    def _version_dir() -> str:
        ctx = get_current_context()
        return ctx["ti"].xcom_pull(task_ids="prepare")

    @task(doc_md="Creates `versions/<run stamp>/` in the model registry for this run's checkpoints.")
    def prepare() -> str:
        from solaris_jobs.flows import training_steps as t
        return t.new_version_dir(get_current_context()["run_id"])

    def _train(kind: str) -> dict:
        from solaris_jobs.flows import training_steps as t
        return t.train(kind, _version_dir())

    trains = [task(task_id=f"train_{kind}", doc_md=doc + RERUN)(_train)(kind) for kind, doc in (
        ("fm", "Trains the foundation model (sequence model, label + rating heads). Output: fm.pt."),
        ("ae", "Trains the autoencoder on the new FM's interaction embeddings. Output: ae.pt."),
        ("vm", "Trains the verifier VM (no FM input), used by candidate selection. Output: vm.pt."),
        ("vm_transfer", "Trains the ranker's VM on what the store would serve it: a replay of the refresh and the "
                        "serving client over the log's last `served_hours` with the new models, then the all-tiers "
                        "VM on those rows. Output: vm_transfer.pt (and the replay under served/)."))]

    @task(doc_md="Checks the four checkpoints belong together and switches `current` to them atomically. Its "
                 "asset event (`solaris_models`) carries the new version and every model's test metrics.\n\n"
                 "**If it fails**: a checkpoint is missing, truncated or of another FM (the message names the "
                 "file); `current` still points at the previous version. Retrain (clear the train task named).",
          outlets=[MODELS])
    def publish() -> dict:
        from solaris_jobs.flows import training_steps as t
        from solaris_jobs.flows.run_summary import training_summary
        ctx = get_current_context()
        out = t.publish(_version_dir())
        extra = {"version": os.path.basename(out["current"]), "embedding_version": out["embedding_version"]}
        for kind in KINDS:
            metrics = ctx["ti"].xcom_pull(task_ids=f"train_{kind}") or {}
            extra.update({f"{kind}_{k}": v for k, v in training_summary(kind, metrics).items() if k != "model"})
        ctx["outlet_events"][MODELS].extra = extra
        return out

    @task(doc_md="Re-embeds the latest refreshed interval with the new models (FM inference, aggregates, "
                 "neighbours) and materializes it: the online store holds the new version.\n\n**If it fails**: "
                 "the new version is published already; the next refresh embeds with it anyway. Check the "
                 "online store (`SOLARIS_REDIS`) and clear the task.", outlets=[ONLINE])
    def reembed() -> dict:
        from solaris_jobs.flows import training_steps as t
        from solaris_jobs.flows.run_summary import step_summary
        from solaris_jobs.core.settings import Settings
        from solaris_jobs.online.store_config import for_airflow_task
        # SOLARIS_REDIS from the Airflow connection, if any; SQLite only under a single-host executor.
        for_airflow_task(Settings.from_env(require=False), os.environ.get("SOLARIS_REDIS_CONN_ID"))
        out = t.reembed_latest()
        if "materialize" in out:
            get_current_context()["outlet_events"][ONLINE].extra = {
                **step_summary("materialize", out["materialize"]), "model_version": out["embed"]["model_version"],
                "pairs_reembedded": out["embed"]["pairs"]}
        return out

    chain = prepare()
    for t in trains:
        chain = chain >> t
    chain >> publish() >> reembed()
