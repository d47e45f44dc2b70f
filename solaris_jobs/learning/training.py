"""Training and evaluation of the FM, the autoencoder and the VM on a time split of an event log.

The split (``features.time_split``): train = events before the 80% time quantile, valid = up to the 90%
quantile, test = the rest. Inputs of every event come only from events strictly before it (the history index is
built over the whole log; queries never see their own time or later). Each epoch logs train and valid BCE and
AUC; the weights of the best valid BCE are kept (early stopping with ``patience``). Deterministic under a seed
on CPU for a given thread count.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from models import (AEConfig, Autoencoder, FMConfig, FoundationModel, VMConfig, VerticalModel, batch_to_tensors,
                    load_checkpoint, save_checkpoint)
from solaris_jobs.core import events as ev
from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.model_inputs import EventIndex, Examples, id_vocabulary, side_tables, time_split
from solaris_jobs.pipeline.model_refs import check_ae_of_fm, resolve_device

if TYPE_CHECKING:
    from solaris_jobs.core.settings import TrainSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Settings shared by the three trainers."""
    epochs: int = 3
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.0
    patience: int = 1
    seed: int = 0
    device: str = "auto"
    history_len: int = 50
    max_train_rows: int | None = None     # subsample: N train rows, N/4 valid and test rows (large logs)
    split: tuple = (0.8, 0.1, 0.1)

    @classmethod
    def of(cls, ts: TrainSettings, **more) -> "TrainConfig":
        """The trainers' settings from the training settings; ``more``: the other fields (lr, device, ...)."""
        return cls(epochs=ts.epochs, batch_size=ts.batch_size, seed=ts.seed, history_len=ts.history_len,
                   max_train_rows=ts.max_train_rows, **more)


def fm_model_args(ts: TrainSettings) -> dict:
    """The FM's family and config fields of the training settings: its widths and the recipe's dropout and trunk."""
    return {"family": ts.fm_family, "d_model": ts.d_model, "n_layers": ts.layers, "d_interaction": ts.d_interaction,
            "dropout": ts.fm_dropout, "target_user": ts.fm_target_user}


def train_as_product(kind: str, data: "Dataset", out: str | Path, ts: TrainSettings, cfg: TrainConfig | None = None,
                     fm_path: str | Path | None = None, fm_factory: str | None = None) -> dict:
    """Trains ``kind`` (``fm``, ``ae`` or ``verifier``) with the product's recipe of the training settings ``ts``:
    the evaluated one at the defaults (the FM's learning rate, weight decay, dropout and trunk; the autoencoder's
    epochs; the verifier's epochs and patience). ``cfg``: the shared trainer settings (default
    ``TrainConfig.of(ts)``); ``fm_path``: the FM the autoencoder codes (``ae`` only; ``fm_factory``: its
    ``package.module:factory`` when it is a user's own). The training DAG,
    ``solaris train``, the MovieLens experiment and the scale benchmark all train through here."""
    from dataclasses import replace
    cfg = cfg or TrainConfig.of(ts)
    if kind == "fm":
        return train_fm(data, out, replace(cfg, lr=ts.fm_lr, weight_decay=ts.fm_weight_decay), **fm_model_args(ts))
    if kind == "ae":
        if fm_path is None:
            raise ValueError("the autoencoder needs the FM it codes (fm_path)")
        return train_ae(data, fm_path, out, replace(cfg, epochs=ts.ae_epochs), d_code=ts.d_code,
                        fm_factory=fm_factory)
    if kind == "verifier":
        return train_verifier(data, out, replace(cfg, epochs=ts.verifier_epochs, patience=ts.verifier_patience))
    raise ValueError(f"unknown model kind {kind!r}: fm, ae or verifier")


@dataclass
class Dataset:
    """An event log loaded for training: the history index, the three splits and the side tables."""
    root: str
    index: EventIndex
    train: Examples
    valid: Examples
    test: Examples
    cuts: tuple
    user_side: dict
    item_side: dict
    tables: dict = field(repr=False, default_factory=dict)
    rows: dict = field(default_factory=dict)      # events read, and set aside per reason (the event contract)


def load_dataset(root: str, history_len: int = 50, split=(0.8, 0.1, 0.1), max_train_rows: int | None = None,
                 seed: int = 0, cuts: tuple | None = None, label_delay_minutes: float = 0.0) -> Dataset:
    """Reads ``root`` (events + side tables) and splits it by time.

    Args:
        split: train/valid/test shares of the rows, by time quantiles (without ``cuts``).
        cuts: (valid_from, test_from) times instead: train before the first, valid up to the second, test after.
        label_delay_minutes: labels arrive this long after their event (``PrecomputeConfig.label_delay_minutes``):
            every row's inputs see only the labels that had arrived at its time (``EventIndex``), and the rows of
            the last ``label_delay_minutes`` before the test split (the training time) have no label yet: they
            train and validate nothing (label -1).

    Raises:
        DataContractError: no event log under ``root``, or it is empty.
    """
    t0 = time.perf_counter()
    table = ev.read_events(root)
    if table.num_rows == 0:
        raise ev.DataContractError(f"{root}: the event log is empty")
    # The event contract, as the refresh applies it: bad rows are set aside and counted, never trained on.
    bad, rejected = ev.bad_event_rows(table, now=pd.Timestamp.now(tz="UTC"))
    rejected = {k: v for k, v in rejected.items() if v}
    if rejected:
        logger.warning("%s: %d event rows set aside before training: %s", root, int(bad.sum()), rejected)
        table = table.filter(pa.array(~bad))
        if table.num_rows == 0:
            raise ev.DataContractError(f"{root}: every event row breaks the contract ({rejected})")
    delay_us = int(round(label_delay_minutes * 60e6))
    index = EventIndex(table, label_delay_us=delay_us)
    examples = Examples.from_events(index, table, history_len)
    if cuts is not None:
        c1, c2 = (ev.to_utc(c).value // 1000 for c in cuts)
        ts = examples.ts
        train, valid, test, cuts = ts < c1, (ts >= c1) & (ts < c2), ts >= c2, (int(c1), int(c2))
    else:
        train, valid, test, cuts = time_split(examples.ts, split)
    if delay_us:
        pending = (examples.ts >= cuts[1] - delay_us) & (examples.ts < cuts[1])
        examples.label[pending], examples.rating[pending] = -1.0, 0.0
    if max_train_rows:
        # Large logs: N training rows and N/4 each for valid and test, sampled uniformly.
        rng = np.random.default_rng(seed)
        train, valid, test = (_sample(m, n, rng) for m, n in
                              ((train, max_train_rows), (valid, max_train_rows // 4), (test, max_train_rows // 4)))
    users, items = ev.read_side(root, "users"), ev.read_side(root, "items")
    ev.check_unique_ids(users, "user_id", f"{root}/users.parquet")
    ev.check_unique_ids(items, "item_id", f"{root}/items.parquet")
    # Ids index the embedding tables directly, unless they are sparse or hashed int64 ids (the contract allows any
    # positive int64): then a vocabulary of the ids seen (one row each) instead of a row per possible id.
    uvocab = id_vocabulary(table.column("user_id").to_numpy(), users["user_id"].to_numpy())
    ivocab = id_vocabulary(table.column("item_id").to_numpy(), items["item_id"].to_numpy())
    n_of = lambda vocab, col, side: (len(vocab) + 1 if vocab is not None else int(max(
        table.column(col).to_numpy().max(), side[col].max() if len(side) else 0)) + 1)
    n_users, n_items = n_of(uvocab, "user_id", users), n_of(ivocab, "item_id", items)
    uspec, ucat, umulti = side_tables(users, "user_id", n_users, uvocab)
    ispec, icat, imulti = side_tables(items, "item_id", n_items, ivocab)
    as_dict = lambda s, vocab: {"n_ids": s.n_ids, "categorical": dict(s.categorical),
                                "multi": {k: list(v) for k, v in s.multi.items()},
                                **({"sparse": True} if vocab is not None else {})}
    logger.info("loaded %s: %d events (train %d, valid %d, test %d) in %.1fs", root, len(examples), train.sum(),
                valid.sum(), test.sum(), time.perf_counter() - t0)
    return Dataset(str(root), index, examples.subset(train), examples.subset(valid), examples.subset(test), cuts,
                   as_dict(uspec, uvocab), as_dict(ispec, ivocab),
                   {"user": (ucat, umulti, uvocab), "item": (icat, imulti, ivocab)},
                   {"events_read": int(len(bad)), "events_set_aside": rejected})


def _sample(mask: np.ndarray, n: int, rng) -> np.ndarray:
    if mask.sum() <= n:
        return mask
    keep = np.sort(rng.choice(np.flatnonzero(mask), n, replace=False))
    out = np.zeros_like(mask)
    out[keep] = True
    return out


def auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score
    known = y >= 0
    y, p = y[known], p[known]
    return float(roc_auc_score(y, p)) if 0 < y.sum() < len(y) else float("nan")


def bce(y: np.ndarray, p: np.ndarray) -> float:
    known = y >= 0
    p = np.clip(p[known], 1e-7, 1 - 1e-7)
    y = y[known]
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def _progress(iterable, total: int, desc: str):
    if sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc, leave=False)
    return iterable


@torch.inference_mode()
def predict(model, examples: Examples, batch_size: int = 1024, device=None, outputs=("logit",)) -> dict:
    """Runs ``model`` over ``examples`` in eval mode; returns the requested outputs as numpy arrays."""
    device = device or next(model.parameters()).device
    model.eval()
    got = {k: [] for k in outputs}
    for b in examples.batches(batch_size):
        out = model(batch_to_tensors(b, device))
        for k in outputs:
            got[k].append(out[k].float().cpu().numpy())
    return {k: np.concatenate(v) if v else np.zeros(0, np.float32) for k, v in got.items()}


def evaluate(model, examples: Examples, batch_size: int = 1024) -> dict:
    """BCE and AUC of ``model``'s label logit on ``examples``."""
    p = 1.0 / (1.0 + np.exp(-predict(model, examples, batch_size)["logit"].astype(np.float64)))
    return {"bce": bce(examples.label, p), "auc": auc(examples.label, p), "rows": int(len(examples))}


def fit(model, data: Dataset, cfg: TrainConfig, name: str, resume: tuple[Path, str] | None = None) -> dict:
    """Trains ``model`` (which has ``loss(out, batch)``) on data.train, early-stopped on data.valid BCE.

    Args:
        resume: (path, key): after every epoch the whole training state (weights, optimizer, random generators,
            history) is saved at ``path``; a later call with the same ``key`` (what the run depends on) continues
            after the last saved epoch, with the result an uninterrupted run gives. The file is removed at the end.

    Returns:
        Per-epoch history and the best epoch's valid metrics; the model holds the best weights.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    best, best_state, history, bad = math.inf, None, [], 0
    n_batches = math.ceil(len(data.train) / cfg.batch_size)
    start = 0
    if resume is not None and Path(resume[0]).exists():
        state = torch.load(resume[0], weights_only=False)
        if state["key"] == resume[1]:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            torch.set_rng_state(state["torch_rng"])
            np.random.set_state(state["numpy_rng"])
            best, best_state, history, bad = state["best"], state["best_state"], state["history"], state["bad"]
            start = len(history)
            logger.info("%s: resuming after epoch %d (%s)", name, start, resume[0])
    for epoch in range(start, cfg.epochs):
        if bad >= cfg.patience:
            break
        t0 = time.perf_counter()
        model.train()
        ys, ps = [], []
        for b in _progress(data.train.batches(cfg.batch_size, shuffle_seed=cfg.seed * 1000 + epoch), n_batches,
                           f"{name} epoch {epoch + 1}"):
            tb = batch_to_tensors(b, device)
            out = model(tb)
            loss = model.loss(out, tb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ys.append(b["label"])
            ps.append(torch.sigmoid(out["logit"]).detach().cpu().numpy())
        y, p = np.concatenate(ys), np.concatenate(ps)
        valid = evaluate(model, data.valid)
        rec = {"epoch": epoch + 1, "train_bce": bce(y, p), "train_auc": auc(y, p), "valid_bce": valid["bce"],
               "valid_auc": valid["auc"], "seconds": round(time.perf_counter() - t0, 2)}
        history.append(rec)
        logger.info("%s epoch %d: train BCE %.4f AUC %.4f | valid BCE %.4f AUC %.4f | %.1fs", name, epoch + 1,
                    rec["train_bce"], rec["train_auc"], rec["valid_bce"], rec["valid_auc"], rec["seconds"])
        if valid["bce"] < best:
            best, bad = valid["bce"], 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            bad += 1
        if resume is not None:
            tmp = Path(f"{resume[0]}.tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": resume[1], "model": model.state_dict(), "opt": opt.state_dict(),
                        "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "best": best,
                        "best_state": best_state, "history": history, "bad": bad}, tmp)
            tmp.replace(resume[0])
    model.load_state_dict(best_state)
    if resume is not None:
        Path(resume[0]).unlink(missing_ok=True)
    best_epoch = min(history, key=lambda r: r["valid_bce"])["epoch"]
    return {"history": history, "best_epoch": best_epoch}


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def _base_rate(data: Dataset) -> dict:
    y = data.train.label[data.train.label >= 0]
    p = float(y.mean())
    return {"p": p, "valid_bce": bce(data.valid.label, np.full(len(data.valid), p)),
            "test_bce": bce(data.test.label, np.full(len(data.test), p))}


def _split_info(data: Dataset) -> dict:
    import pandas as pd
    to_iso = lambda us: pd.Timestamp(us, unit="us", tz="UTC").isoformat()
    return {"train_rows": len(data.train), "valid_rows": len(data.valid), "test_rows": len(data.test),
            "valid_from": to_iso(data.cuts[0]), "test_from": to_iso(data.cuts[1])}


def build_fm(data: Dataset, cfg: TrainConfig, family: str = "transformer", **model_args):
    """A freshly initialised FM of ``family`` (``models.checkpoint.FM_FAMILIES``) for ``data`` (seeded by
    ``cfg.seed``, on ``cfg.device``); ``model_args``: the other fields of its config (widths, dropout,
    target_user)."""
    from models.checkpoint import FM_FAMILIES
    if family not in FM_FAMILIES:
        raise ValueError(f"unknown FM family {family!r}: {sorted(FM_FAMILIES)}")
    config_cls, model_cls = FM_FAMILIES[family]
    _seed(cfg.seed)
    model = model_cls(config_cls(user_side=data.user_side, item_side=data.item_side, history_len=cfg.history_len,
                                 **model_args))
    model.users.set_tables(*data.tables["user"])
    model.items.set_tables(*data.tables["item"])
    return model.to(resolve_device(cfg.device))


def cap_rows(examples: Examples, n: int, seed: int) -> Examples:
    """At most ``n`` of ``examples``, sampled uniformly (in time order)."""
    return examples.subset(_sample(np.ones(len(examples), bool), n, np.random.default_rng(seed)))


def train_fm(data: Dataset, out: str | Path, cfg: TrainConfig = TrainConfig(), resume_key: str | None = None,
             **model_args) -> dict:
    """Trains the FM; saves the checkpoint at ``out``; returns metrics (valid/test BCE and AUC, base rate).
    ``resume_key``: resumable per epoch (``fit``), from ``<out>.resume`` when written under the same key."""
    model = build_fm(data, cfg, **model_args)
    t0 = time.perf_counter()
    run = fit(model, data, cfg, "fm", resume=(Path(f"{out}.resume"), resume_key) if resume_key else None)
    metrics = _final_metrics(model, data, run, t0)
    version = save_checkpoint(model.cpu(), out, extra={"metrics": metrics, "train": _cfg_dict(cfg)})
    metrics["model_version"] = version
    return metrics


def _cfg_dict(cfg: TrainConfig) -> dict:
    from dataclasses import asdict
    return asdict(cfg)


def _final_metrics(model, data: Dataset, run: dict, t0: float) -> dict:
    seconds = time.perf_counter() - t0
    valid, test = evaluate(model, data.valid), evaluate(model, data.test)
    m = {"valid_bce": valid["bce"], "valid_auc": valid["auc"], "test_bce": test["bce"], "test_auc": test["auc"],
         "train_seconds": round(seconds, 1), **run, "split": _split_info(data), "base_rate": _base_rate(data),
         "events": data.rows}
    logger.info("test BCE %.4f AUC %.4f (base rate BCE %.4f), %.1fs", test["bce"], test["auc"],
                m["base_rate"]["test_bce"], seconds)
    return m


@torch.inference_mode()
def fm_outputs(fm: FoundationModel, examples: Examples, batch_size: int = 1024) -> dict:
    """The FM's probability (N,) and interaction embedding h (N, d_interaction) for every example."""
    out = predict(fm, examples, batch_size, outputs=("logit", "h"))
    return {"prob": (1.0 / (1.0 + np.exp(-out["logit"].astype(np.float64)))).astype(np.float32), "h": out["h"]}


@torch.inference_mode()
def fm_user_vectors(fm: FoundationModel, examples: Examples, batch_size: int = 1024) -> np.ndarray:
    """The FM's user embedding (N, 2 x d_model; no target) at every example's time, as the refresh computes it."""
    fm.eval()
    device = next(fm.parameters()).device
    got = [fm.user_embedding(batch_to_tensors(b, device)).float().cpu().numpy() for b in examples.batches(batch_size)]
    return np.concatenate(got) if got else np.zeros((0, fm.user_width), np.float32)


def _fit_coder(coder, params, x_train: torch.Tensor, x_valid: torch.Tensor, cfg: TrainConfig, name: str):
    """Trains one coder of the autoencoder (``params``: its parameters) for ``5 x epochs`` epochs, keeping the weights
    of the best validation MSE; returns the per-epoch history."""
    coder.set_scale(x_train)
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    best, best_state, history = math.inf, None, []
    for epoch in range(max(cfg.epochs, 1) * 5):
        coder.train()
        for idx in torch.randperm(len(x_train), generator=gen).split(cfg.batch_size):
            loss = coder.loss(x_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        coder.eval()
        with torch.inference_mode():
            v = float(coder.loss(x_valid))
        history.append({"epoch": epoch + 1, "valid_mse": v})
        logger.info("%s epoch %d: valid MSE (standardised) %.4f", name, epoch + 1, v)
        if v < best:
            best, best_state = v, {k: t.clone() for k, t in coder.state_dict().items()}
    coder.load_state_dict(best_state)
    coder.eval()
    return history


def train_ae(data: Dataset, fm_path: str | Path, out: str | Path, cfg: TrainConfig = TrainConfig(),
             d_code: int = 32, user_rows: int = 50_000, fm_factory: str | None = None) -> dict:
    """Trains the autoencoder on the FM's h over the training split, and its user coder on the FM's user
    embeddings of (at most ``user_rows``) training rows; reports explained variance of each on test.
    ``fm_factory``: the FM's ``package.module:factory`` when it is a user's own (``model_refs.load_fm``)."""
    from solaris_jobs.pipeline.model_refs import load_fm
    _seed(cfg.seed)
    fm, fm_meta = load_fm(fm_path, fm_factory)
    if data.train.history_len != fm.history_len:
        raise ValueError(f"{fm_path}: the FM reads {fm.history_len} events of history, the data set was loaded with "
                         f"{data.train.history_len}: load it at the FM's (--history-len {fm.history_len})")
    h_train = torch.from_numpy(fm_outputs(fm, data.train)["h"])
    h_test = torch.from_numpy(fm_outputs(fm, data.test)["h"])
    h_valid = torch.from_numpy(fm_outputs(fm, data.valid)["h"])
    ae = Autoencoder(AEConfig(d_in=fm.width, d_code=d_code, d_user=fm.user_width))
    t0 = time.perf_counter()
    pair_params = [p for n, p in ae.named_parameters() if not n.startswith("user.")]
    history = _fit_coder(ae, pair_params, h_train, h_valid, cfg, "ae")
    users = {k: torch.from_numpy(fm_user_vectors(fm, cap_rows(part, n, cfg.seed))) for k, part, n in
             (("train", data.train, user_rows), ("valid", data.valid, user_rows // 4),
              ("test", data.test, user_rows // 4))}
    user_history = _fit_coder(ae.user, list(ae.user.parameters()), users["train"], users["valid"], cfg, "ae user")
    with torch.inference_mode():
        metrics = {"test_mse": float(ae.loss(h_test)), "test_explained_variance": ae.explained_variance(h_test),
                   "user_test_explained_variance": ae.user.explained_variance(users["test"]),
                   "history": history, "user_history": user_history,
                   "train_seconds": round(time.perf_counter() - t0, 1),
                   "fm_version": fm_meta["model_version"], "split": _split_info(data)}
    logger.info("ae: test explained variance %.3f (user coder %.3f)", metrics["test_explained_variance"],
                metrics["user_test_explained_variance"])
    metrics["model_version"] = save_checkpoint(ae, out, extra={"metrics": metrics, "fm_version":
                                                               fm_meta["model_version"]})
    return metrics


def attach_fm_features(data: Dataset, fm_path, ae_path=None, kd: bool = False, coverage: float = 1.0,
                       seed: int = 0, fm_factory: str | None = None) -> dict:
    """Adds FM-derived per-row inputs to every split: ``fm_prob`` (KD) or ``fm_emb`` + ``tier`` (transfer).

    With ``coverage`` < 1, a random share of rows gets zeros and tier none instead, as a cache miss would.

    Returns:
        The versions of the models used.
    """
    from solaris_jobs.pipeline.model_refs import load_fm
    fm, fm_meta = load_fm(fm_path, fm_factory)
    versions = {"fm_version": fm_meta["model_version"]}
    ae = None
    if not kd:
        ae, ae_meta = load_checkpoint(ae_path, kind="ae")
        check_ae_of_fm(fm_meta, ae_meta, fm_path, ae_path)
        versions["ae_version"] = ae_meta["model_version"]
    rng = np.random.default_rng(seed)
    for split in (data.train, data.valid, data.test):
        out = fm_outputs(fm, split)
        if kd:
            split.extras["fm_prob"] = out["prob"]
            continue
        with torch.inference_mode():
            code = ae.encode(torch.from_numpy(out["h"])).numpy()
        hit = rng.random(len(split)) < coverage
        split.extras["fm_emb"] = np.where(hit[:, None], code, 0.0).astype(np.float32)
        split.extras["tier"] = np.where(hit, TIERS.index("pair"), TIERS.index("none")).astype(np.int64)
    return versions


def train_vm(data: Dataset, out: str | Path, cfg: TrainConfig = TrainConfig(), mode: str = "plain",
             fm_path=None, ae_path=None, kd_weight: float = 0.5, coverage: float = 1.0, fm_factory: str | None = None,
             **model_args) -> dict:
    """Trains the VM: ``plain`` (no FM), ``kd`` (FM soft labels) or ``transfer`` (FM embedding input);
    ``fm_factory``: the FM's ``package.module:factory`` when it is a user's own.

    Returns:
        Metrics (valid/test BCE and AUC, base rate); saves the checkpoint at ``out``.
    """
    if mode not in ("plain", "kd", "transfer"):
        raise ValueError(f"unknown VM mode {mode!r}: plain, kd or transfer")
    _seed(cfg.seed)
    device = resolve_device(cfg.device)
    versions = {}
    fm_dim = 0
    if mode in ("kd", "transfer"):
        if fm_path is None or (mode == "transfer" and ae_path is None):
            raise ValueError(f"VM mode {mode!r} needs --fm" + (" and --ae" if mode == "transfer" else ""))
        for s in (data.train, data.valid, data.test):
            s.extras.clear()
        versions = attach_fm_features(data, fm_path, ae_path, kd=mode == "kd", coverage=coverage, seed=cfg.seed,
                                      fm_factory=fm_factory)
        if mode == "transfer":
            fm_dim = data.train.extras["fm_emb"].shape[1]
    _seed(cfg.seed)
    model = VerticalModel(VMConfig(user_side=data.user_side, item_side=data.item_side, fm_dim=fm_dim,
                                   kd_weight=kd_weight if mode == "kd" else 0.0, **model_args))
    for s in (data.train, data.valid, data.test):
        s.recency = model.cfg.recency
    model.users.set_tables(*data.tables["user"])
    model.items.set_tables(*data.tables["item"])
    model.to(device)
    t0 = time.perf_counter()
    run = fit(model, data, cfg, f"vm-{mode}")
    metrics = _final_metrics(model, data, run, t0)
    metrics.update(mode=mode, coverage=coverage, **versions)
    metrics["model_version"] = save_checkpoint(model.cpu(), out, extra={"metrics": metrics, **versions,
                                                                          "train": _cfg_dict(cfg)})
    return metrics


def train_verifier(data: Dataset, out: str | Path, cfg: TrainConfig = TrainConfig()) -> dict:
    """The refresh's verifier: the plain VM on the lifetime counters only, without the recency inputs (the select
    step scores candidate pairs from the interval state's counters at T; the rankers take the recency inputs)."""
    return train_vm(data, out, cfg, recency=False)


def transfer_ratio(l_vm: float, l_variant: float, l_fm: float) -> float:
    """TR = (L_VM - L_variant) / (L_VM - L_FM): the share of the FM's gain over the VM that the variant keeps."""
    return (l_vm - l_variant) / (l_vm - l_fm) if l_vm != l_fm else float("nan")
