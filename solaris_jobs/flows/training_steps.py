"""The training DAG's task functions: versioned model folders, training, atomic publication, re-embedding.

Registry layout (``settings.model_registry()``)::

    versions/<stamp>/{fm,ae,vm,vm_transfer}.pt     one folder per training run
    current                                        a pointer file, "versions/<stamp>": what the refresh DAG uses
                                                   (Settings.models = <registry>/current)
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pandas as pd

from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import Settings, TrainSettings, env_var, train_settings, ttl_env
from solaris_jobs.core.settings import model_registry as registry

logger = logging.getLogger(__name__)


def new_version_dir(run_id: str) -> str:
    stamp = re.sub(r"[^0-9A-Za-z_.-]", "_", run_id)
    path = registry() / "versions" / stamp
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def served_protocol(root: str, o: TrainSettings):
    """The training DAG's time protocol (``evaluation.protocol.Protocol``): the FM, autoencoder and verifier learn
    from the log before ``t1 = end - served_hours`` (early stopping on its last tenth); the ranker's VM trains on
    what a replay of ``[t1, end)`` served with them (out of their sample), validating on the window's last quarter.
    ``end`` is the log's last event, rounded up to ``served_every``.

    Raises:
        ValueError: the log is shorter than the served window.
    """
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation.protocol import Protocol
    every = pd.Timedelta(o.served_every)
    ts = ev.read_events(root, columns=["user_id", "item_id", "event_timestamp"]).column("event_timestamp").cast(
        "int64").to_numpy()
    end = pd.Timestamp(int(ts.max()), unit="us", tz="UTC").floor(every) + every
    t0 = pd.Timestamp(int(ts.min()), unit="us", tz="UTC").floor("D")
    t1 = end - pd.Timedelta(hours=o.served_hours)
    if t1 <= t0 + every:
        raise ValueError(f"{root}: the log ({t0.isoformat()} to {end.isoformat()}) is not longer than the served "
                         f"window (training setting served_hours={o.served_hours})")
    valid_from = max((t1 + (end - t1) * 0.75).floor(every), t1 + every) if end - t1 > every else t1 + every / 2
    return Protocol(t0, t1, end, end + every, valid_from, (t1 - (t1 - t0) / 10).floor("min"))


def train(kind: str, version_dir: str) -> dict:
    """Trains one model of the version (fm, ae, vm = the verifier, vm_transfer = the ranker's VM)."""
    from solaris_jobs.learning import training
    o = train_settings()
    d = Path(version_dir)
    if Settings.from_env(require=False).fm_factory:
        raise ValueError(f"{env_var('fm_factory')} names your own FM: the training DAG trains SOLARIS's own FM and "
                         f"publishes it as `current`, which your factory would then be given; unset one of the two "
                         f"(train the autoencoder and rankers for your FM with `solaris train ae --fm-factory` and "
                         f"`solaris train vm --fm-factory`)")
    cfg = training.TrainConfig.of(o)
    root = Settings.from_env(require=False).data
    if not root:
        raise ValueError("set the data root (Settings.data) for training")
    P = served_protocol(root, o)
    if kind == "vm_transfer":
        return json.loads(json.dumps(train_served_vm(root, d, o, P), default=str))
    if kind not in ("fm", "ae", "vm"):
        raise ValueError(f"unknown model kind {kind!r}")
    # Nothing from the served window reaches the FM, the autoencoder or the verifier: the ranker's VM trains on
    # their outputs there, which must be out of their sample as in serving.
    delay = Settings.from_env(require=False).precompute.label_delay_minutes
    data = training.load_dataset(root, o.history_len, max_train_rows=o.max_train_rows, seed=o.seed,
                                 cuts=(P.fm_valid_from, P.t1), label_delay_minutes=delay)
    m = training.train_as_product({"vm": "verifier"}.get(kind, kind), data, d / f"{kind}.pt", o, cfg, d / "fm.pt")
    return json.loads(json.dumps({k: v for k, v in m.items() if k != "history"}, default=str))


def train_served_vm(root: str, version_dir: Path, o: TrainSettings, P) -> dict:
    """The ranker's VM, trained on what the store would serve it: the refresh and the serving client replayed
    (``solaris_jobs.learning.replay``) over ``[P.t1, P.t2)`` with this version's FM, autoencoder and verifier
    (trained before ``P.t1``), the refresh settings of the environment and the views' TTLs; rows before that window carry tier none
    (nothing of this version was served then). Validation: ``[P.valid_from, P.t2)``. Output: ``vm_transfer.pt``
    (all tiers, tier and age inputs)."""
    import numpy as np

    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation import variants
    from solaris_jobs.learning import replay, training
    from solaris_jobs.online.views import views
    from solaris_jobs.pipeline import jobs, model_refs
    from solaris_jobs.pipeline.event_source import EventTable
    every = pd.Timedelta(o.served_every)
    table = ev.read_events(root)
    s = Settings.from_env(models=str(version_dir), offline=str(version_dir / "served" / "offline"), require=False)
    models = model_refs.resolve(version_dir, ("fm", "ae", "vm"))
    ttls = ttl_env({n: f"{int(v.ttl.total_seconds())}s" for n, v in views().items()})
    plan = replay.ReplayPlan(P.t1, P.t2, every, pd.Timedelta(minutes=10), ttls)
    rec = replay.run(jobs.session(s, "train-served"), s, EventTable(table, root), models, plan,
                     version_dir / "served")
    data = training.load_dataset(root, models.history_len, cuts=(P.valid_from, P.t2),
                                 label_delay_minutes=s.precompute.label_delay_minutes)
    served = replay.read_served(version_dir / "served")
    out = variants.train_on_served(data, P, served, models, version_dir / "vm_transfer.pt", seed=o.seed)
    out.update(mode="transfer", protocol=P.to_dict(), served_every=str(every), replay_wall_s=rec["wall_s"],
               fm_version=models.fm.version, ae_version=models.ae.version,
               served_tiers=np.bincount(served.column("tier").to_numpy(), minlength=len(TIERS)).tolist())
    return out


def publish(version_dir: str) -> dict:
    """Checks that the version's checkpoints belong together, then points ``current`` (a pointer file) at it
    atomically."""
    from models import load_checkpoint
    from solaris_jobs.core.contract import embedding_version, vm_embedding_version
    from solaris_jobs.pipeline.model_refs import check_ae_of_fm
    d = Path(version_dir).resolve()
    metas = {k: load_checkpoint(d / f"{k}.pt")[1] for k in ("fm", "ae", "vm", "vm_transfer")}
    fm_v, ae_v = metas["fm"]["model_version"], metas["ae"]["model_version"]
    check_ae_of_fm(metas["fm"], metas["ae"], d / "fm.pt", d / "ae.pt")
    want = embedding_version(fm_v, ae_v)
    if vm_embedding_version(metas["vm_transfer"]) != want:
        raise ValueError(f"{d}: vm_transfer.pt takes embeddings {vm_embedding_version(metas['vm_transfer'])}, "
                         f"not {want}")
    # ``current`` is a pointer file naming the version (relative to the registry), replaced whole: readers
    # (``model_refs.models_folder``) see the old version or the new one, on any file system (a link is not).
    current = registry() / "current"
    tmp = registry() / f".current-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.write_text(os.path.relpath(d, registry().resolve()) + "\n")
    os.replace(tmp, current)
    logger.info("published %s (embeddings %s+%s)", d, fm_v, ae_v)
    return {"current": str(d), "embedding_version": want}


def reembed_latest() -> dict:
    """Re-embeds the latest materialized interval with the current models and materializes it again."""
    from solaris_jobs.flows import refresh_steps as o
    from solaris_jobs.online.materialize import materialized_intervals
    s = Settings.from_env(models=str(registry() / "current"))
    done = materialized_intervals(o.store(s))
    if not done:
        return {"skipped": "no interval was materialized yet"}
    end = max(done)
    start = latest_start(done)
    out = {"interval_start": start.isoformat(), "interval_end": end.isoformat()}
    for step in ("embed", "aggregate", "neighbours", "materialize"):
        out[step] = o.run_step(s, step, start, end)
    return out


def latest_start(done: dict) -> pd.Timestamp:
    """The start of the latest materialized interval: as recorded by materialize; for records written before
    starts were recorded, the end of the interval before it (contiguous refreshes)."""
    end = max(done)
    recorded = done[end].get("interval_start")
    if recorded:
        return pd.Timestamp(recorded)
    earlier = [e for e in done if e < end]
    if not earlier:
        raise ValueError(f"the interval ending {end.isoformat()} has no recorded start and no interval before it; "
                         "re-run its refresh (solaris backfill --force) to record one")
    return max(earlier)
