"""The evaluation's time protocol and the models trained before it.

Dates: ``t0`` (the log's start) <= ``t1`` < ``t2`` < ``t3`` (its end). The FM, the autoencoder and the verifier VM
are trained on ``[t0, t1)`` only (their early stopping on the last ``fm_valid_hours`` of it). The replay walks
``[t1, t3)``. The ranker's VM variants train on ``[t0, valid_from)`` and choose their epoch and grid point on
``[valid_from, t2)``; the test is ``[t2, t3)``. Nothing of ``[t2, t3)`` reaches a model, a setting or a threshold.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING
from pathlib import Path

import numpy as np
import pandas as pd

from solaris_jobs.core.events import to_utc

if TYPE_CHECKING:
    from solaris_jobs.learning.training import TrainConfig

logger = logging.getLogger(__name__)

# The code each cached output depends on (modules or packages). A cache entry written by other code is not reused:
# once, a seed's models came through this cache from training code older than the run's (BENCHMARKS.md, #11).
MODEL_CODE = ("models", "solaris_jobs.core", "solaris_jobs.learning.training", "solaris_jobs.pipeline.model_refs")
REPLAY_CODE = MODEL_CODE + ("solaris_jobs.pipeline", "solaris_jobs.online", "solaris_jobs.learning.replay",
                            "solaris_jobs.data.requests", "solaris_jobs.evaluation.config",
                            "solaris_jobs.evaluation.replays", "solaris_jobs.evaluation.curves")
VARIANT_CODE = MODEL_CODE + ("solaris_jobs.evaluation.variants",)
_LOADED: dict[tuple, str] = {}


def source_hash(modules: tuple) -> str:
    """A hash of the source of ``modules`` (every ``.py`` file of a package) as it is on disk now, by content and
    relative path: it changes with any edit to that code, comments included, and not with where the tree lies."""
    h = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no module {name!r} to hash")
        origin = Path(spec.origin)
        files = sorted(origin.parent.rglob("*.py")) if spec.submodule_search_locations else [origin]
        for f in files:
            h.update(f"{name}:{f.relative_to(origin.parent).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def code_version(modules: tuple = MODEL_CODE) -> str:
    """``source_hash(modules)`` as this process first saw it: hashed once, so that an edit to the tree during a long
    run does not stamp the outputs of the code already loaded with the new code's hash (``evaluate`` calls
    ``freeze_code_versions`` before any work)."""
    if modules not in _LOADED:
        _LOADED[modules] = source_hash(modules)
    return _LOADED[modules]


def freeze_code_versions() -> dict:
    return {name: code_version(mods) for name, mods in
            (("models", MODEL_CODE), ("replay", REPLAY_CODE), ("variants", VARIANT_CODE))}


def data_manifest(root: Path) -> dict:
    """The data set's manifest (``solaris data`` writes one); a log of the user's own without one is described by
    its location and a digest of its files (``events.log_fingerprints``: paths, sizes, modification times)."""
    from solaris_jobs.core import events as ev
    path = Path(root) / "manifest.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"source": str(root), "log": ev.log_fingerprints(root, [(None, None)])[0]}


def data_version(root: Path) -> str:
    """A hash of the data set's manifest (its generator version, configuration, calibration and counts; not its
    generation time): a data set regenerated at the same path is another data set."""
    made = {k: v for k, v in data_manifest(root).items() if k != "seconds"}
    return hashlib.sha256(json.dumps(made, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Protocol:
    t0: pd.Timestamp
    t1: pd.Timestamp
    t2: pd.Timestamp
    t3: pd.Timestamp
    valid_from: pd.Timestamp          # the VMs' validation slice [valid_from, t2)
    fm_valid_from: pd.Timestamp       # the FM's, AE's and verifier's [fm_valid_from, t1)

    def __post_init__(self):
        order = [self.t0, self.fm_valid_from, self.t1, self.valid_from, self.t2, self.t3]
        if any(b <= a for a, b in zip(order, order[1:])):
            raise ValueError(f"protocol dates out of order: {self.to_dict()}")

    def to_dict(self) -> dict:
        return {k: v.isoformat() for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Protocol":
        return cls(**{k: to_utc(v) for k, v in d.items()})


def by_days(first: pd.Timestamp, train_days: float, served_days: float, test_days: float,
            valid_hours: float, fm_valid_hours: float) -> Protocol:
    """Dates counted from the day the log starts (synthetic traffic): train, served-training and test days."""
    t0 = to_utc(first).floor("D")
    d = pd.Timedelta(days=1)
    t1 = t0 + train_days * d
    t2 = t1 + served_days * d
    return Protocol(t0, t1, t2, t2 + test_days * d, t2 - pd.Timedelta(hours=valid_hours),
                    t1 - pd.Timedelta(hours=fm_valid_hours))


def by_quantiles(ts_us: np.ndarray, q1: float = 0.8, q2: float = 0.9, valid_share: float = 0.5,
                 fm_valid_share: float = 0.125, floor: str = "D") -> Protocol:
    """Dates from quantiles of the event times (MovieLens: 80% / 90%, as DESIGN.md's split), floored to ``floor``:
    the VMs validate on the last ``valid_share`` of ``[t1, t2)``, the FM on the last ``fm_valid_share`` of
    ``[t0, t1)``."""
    s = np.sort(np.asarray(ts_us))
    at = lambda q: pd.Timestamp(int(s[min(int(len(s) * q), len(s) - 1)]), unit="us", tz="UTC").floor(floor)
    t0 = pd.Timestamp(int(s[0]), unit="us", tz="UTC").floor(floor)
    t3 = pd.Timestamp(int(s[-1]), unit="us", tz="UTC").floor(floor) + pd.tseries.frequencies.to_offset(floor)
    t1, t2 = at(q1), at(q2)
    return Protocol(t0, t1, t2, t3, (t2 - (t2 - t1) * valid_share).floor("h"),
                    (t1 - (t1 - t0) * fm_valid_share).floor("h"))


@dataclass(frozen=True)
class ModelsConfig:
    """The FM, autoencoder and verifier trained before t1. The FM's recipe (``fm_*``, ``history_len``) is the one
    its validation search chose (``fm_search``); the search's own settings are ``fm_search.PLAN``."""
    d_model: int = 64
    n_layers: int = 2
    d_interaction: int = 128
    d_code: int = 32
    history_len: int = 50
    fm_epochs: int = 3                       # at most; early stopping on [fm_valid_from, t1)
    fm_patience: int = 1
    fm_lr: float = 4e-3
    fm_weight_decay: float = 1e-2
    fm_dropout: float = 0.1
    fm_target_user: bool = True              # the trunk's target x user product
    ae_epochs: int = 1
    vm_epochs: int = 6                       # the verifier's, at most (early stopping, patience vm_patience)
    vm_patience: int = 2
    batch_size: int = 512
    max_train_rows: int | None = None        # None: every row before fm_valid_from trains
    report_rows: int = 150_000               # the trainers' own "test" rows [t1, ...): reported, never used
    fm_family: str = "transformer"           # the FM's family (models.checkpoint.FM_FAMILIES): the evaluated one

    def fm_args(self) -> dict:
        """The FM's family and config fields of this recipe."""
        return {"family": self.fm_family, "d_model": self.d_model, "n_layers": self.n_layers,
                "d_interaction": self.d_interaction, "dropout": self.fm_dropout, "target_user": self.fm_target_user}

    def fm_train(self, seed: int) -> "TrainConfig":
        from solaris_jobs.learning.training import TrainConfig
        return TrainConfig(epochs=self.fm_epochs, batch_size=self.batch_size, seed=seed, lr=self.fm_lr,
                           weight_decay=self.fm_weight_decay, patience=self.fm_patience,
                           history_len=self.history_len, max_train_rows=self.max_train_rows)


def check_training_end(meta: dict, protocol: Protocol, possibly_leaky: bool, name: str) -> None:
    """Refuses a user's FM that may have seen the replay or the test: one whose declared training end
    (``trained_until``) is after t1, or one that declares none unless ``possibly_leaky`` (the report then says so).

    Raises:
        ValueError: naming the FM, its training end and t1.
    """
    until = (meta.get("extra") or {}).get("trained_until")
    if until is None:
        if not possibly_leaky:
            raise ValueError(f"{name} declares no training end (trained_until): it may have been trained on the "
                             f"replay or test periods (from {protocol.t1.isoformat()}); pass --possibly-leaky to "
                             f"evaluate it anyway, and the report says so")
        return
    if to_utc(until) > protocol.t1:
        raise ValueError(f"{name} was trained on data until {to_utc(until).isoformat()}, after t1 "
                         f"({protocol.t1.isoformat()}): it has seen the replay and test periods; give --times with a "
                         f"later t1, or an FM trained before it")


def train_models(root: Path, protocol: Protocol, seed: int, out: Path, cfg: ModelsConfig,
                 label_delay_minutes: float, fm_checkpoint: str | None = None, fm_factory: str | None = None,
                 possibly_leaky: bool = False) -> dict:
    """Trains fm.pt, ae.pt and vm.pt (the verifier) into ``out`` on ``[t0, t1)`` (reused when ``out`` holds them for
    the same data, protocol, seed, settings and training code). The FM, autoencoder and verifier see an event's
    label only ``label_delay_minutes`` after the event, as the refresh does.

    With ``fm_checkpoint`` (a user's trained FM, built by ``fm_factory``), the FM is taken as it is (copied into
    ``out``, after ``check_training_end``): only the autoencoder and the verifier are trained.

    Returns:
        {"fm", "ae", "vm"}: each model's metrics (its validation inside ``[t0, t1)``; the test split of these
        trainers is ``[t1, ...)`` and is reported, never used).
    """
    from solaris_jobs.learning import training
    from solaris_jobs.pipeline.model_refs import load_fm
    out = Path(out)
    user = None
    if fm_checkpoint is not None:
        _, meta = load_fm(fm_checkpoint, fm_factory)
        check_training_end(meta, protocol, possibly_leaky, fm_checkpoint)
        user = {"checkpoint": str(fm_checkpoint), "factory": fm_factory, "version": meta["model_version"]}
    key = {"root": str(root), "protocol": protocol.to_dict(), "seed": seed, "cfg": asdict(cfg),
           "label_delay_minutes": label_delay_minutes,
           "code": code_version(MODEL_CODE), "data": data_version(root), "user_fm": user}
    stamp = out / "trained.json"
    if stamp.exists() and all((out / f"{k}.pt").exists() for k in ("fm", "ae", "vm")):
        done = json.loads(stamp.read_text())
        if done.get("key") == key:
            logger.info("reusing the models in %s", out)
            return done["metrics"]
    out.mkdir(parents=True, exist_ok=True)
    data = training.load_dataset(str(root), cfg.history_len, max_train_rows=cfg.max_train_rows, seed=seed,
                                 cuts=(protocol.fm_valid_from, protocol.t1), label_delay_minutes=label_delay_minutes)
    # The trainers' "test" split is everything from t1 on: reported by them, never used here.
    data.test = training.cap_rows(data.test, cfg.report_rows, seed)
    tc = cfg.fm_train(seed)
    if user is not None:
        import shutil
        shutil.copyfile(fm_checkpoint, out / "fm.pt")          # taken as it is: the file its factory reads
        fm = {"taken_as_is": user, "history": []}
    else:
        # Hours at the full size: resumable per epoch when the run is interrupted.
        fm = training.train_fm(data, out / "fm.pt", tc, resume_key=json.dumps(key, sort_keys=True), **cfg.fm_args())
    # The autoencoder's and the verifier's own recipes (the trainers' default learning rate), whatever the FM's.
    base = training.TrainConfig(batch_size=cfg.batch_size, seed=seed, history_len=cfg.history_len,
                                max_train_rows=cfg.max_train_rows)
    ae = training.train_ae(data, out / "fm.pt", out / "ae.pt", replace(base, epochs=cfg.ae_epochs), d_code=cfg.d_code,
                           fm_factory=fm_factory if user is not None else None)
    vm = training.train_verifier(data, out / "vm.pt", replace(base, epochs=cfg.vm_epochs, patience=cfg.vm_patience))
    keep = lambda m: {k: v for k, v in m.items() if k != "history"}
    metrics = {"fm": keep(fm), "ae": keep(ae), "vm": keep(vm)}
    stamp.write_text(json.dumps({"key": key, "metrics": metrics, "fm_history": fm["history"]}, indent=1,
                                default=str) + "\n")
    return metrics
