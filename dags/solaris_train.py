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

from airflow.sdk import DAG, CronTriggerTimetable, get_current_context, task

CRON = os.environ.get("SOLARIS_TRAIN_CRON", "0 3 * * 0")

with DAG(
    dag_id="solaris_train",
    schedule=None if CRON.lower() == "none" else CronTriggerTimetable(CRON, timezone="UTC"),
    start_date=datetime.fromisoformat(os.environ.get("SOLARIS_START_DATE", "2026-01-01T00:00:00+00:00")),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": int(os.environ.get("SOLARIS_RETRIES", "1")), "retry_delay": timedelta(minutes=10),
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

    trains = [task(task_id=f"train_{kind}", doc_md=doc)(_train)(kind) for kind, doc in (
        ("fm", "Trains the foundation model (sequence model, label + rating heads). Output: fm.pt."),
        ("ae", "Trains the autoencoder on the new FM's interaction embeddings. Output: ae.pt."),
        ("vm", "Trains the verifier VM (no FM input), used by candidate selection. Output: vm.pt."),
        ("vm_transfer", "Trains the ranker's VM on what the store would serve it: a replay of the refresh and the "
                        "serving client over the log's last `served_hours` with the new models, then the all-tiers "
                        "VM on those rows. Output: vm_transfer.pt (and the replay under served/)."))]

    @task(doc_md="Checks the four checkpoints belong together and switches `current` to them atomically.")
    def publish() -> dict:
        from solaris_jobs.flows import training_steps as t
        return t.publish(_version_dir())

    @task(doc_md="Re-embeds the latest refreshed interval with the new models (FM inference, aggregates, "
                 "neighbours) and materializes it: the online store holds the new version.")
    def reembed() -> dict:
        from solaris_jobs.flows import training_steps as t
        from solaris_jobs.online.store_config import use_airflow_connection
        use_airflow_connection(os.environ.get("SOLARIS_REDIS_CONN_ID"))       # the online store, if on Redis
        return t.reembed_latest()

    chain = prepare()
    for t in trains:
        chain = chain >> t
    chain >> publish() >> reembed()
